"""A tqbench policy as the closest KV setting an engine accepts, and what that setting cannot carry.

``map_policy(policy, "llamacpp", geometry)`` -> ``EngineSetting``: the engine's type names for K and V, the
command-line flags or config lines, the layers the engine can leave unquantized (vLLM's
``--kv-cache-dtype-skip-layers``), every part of the policy it could not map (per-layer widths on an engine
with one KV type, sink/recent windows, codecs the engine does not have, a larger cache), and the mapped
policy as tqbench runs it (the engine's own formats, bit-exact), so the two can be measured side by side.

How a role is mapped: when every layer uses one codec that is one of the engine's types, that type; else the
engine type whose bits per element (scales counted) are nearest the policy's mean for that role over the
layers it compresses (layers kept fp16 in K and V are reported apart). vLLM, SGLang and TensorRT-LLM take one dtype for K and V together:
the mean over both roles picks it. Layers the policy keeps fp16 in K and V become vLLM's skip list.

vLLM's TurboQuant presets (``turboquant_k8v4``, ``turboquant_4bit_nc``, ``turboquant_k3v4_nc``,
``turboquant_3bit_nc``) set K and V apart: a policy with TurboQuant codecs (``turbo*``) maps to the preset whose
K and V bits are nearest its own (``_pick_vllm_tq``), a vLLM TurboQuant setting to itself. vLLM keeps the first
and last 2 layers at the model's dtype with them (the mapped policy does too), and its attention kernels are
Triton on CUDA/ROCm: the mapped policy stores vLLM's bytes bit for bit but is computed by tqbench's attention
("storage-only").
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tqbench.engine.codecs import codec_from_spec
from tqbench.engine.codecs.engine_formats import ENGINE_KV_PAIRS, ENGINE_KV_TYPES, canonical_engine
from tqbench.engine.codecs.vllm_tq import BOUNDARY_LAYERS, VLLM_TQ_PRESETS
from tqbench.engine.policy.files import parse_policy
from tqbench.engine.policy.keep import fmt_keep
from tqbench.engine.policy.spec import DENSE_SPECS, Policy

__all__ = ["ENGINE_LABELS", "EngineSetting", "map_policy"]

ENGINE_LABELS = {"llamacpp": "llama.cpp", "vllm": "vLLM", "sglang": "SGLang", "trtllm": "TensorRT-LLM"}
#: engine -> its KV types tqbench maps onto, in order of preference on equal bits (one name per codec)
_CHOICES: dict[str, tuple[str, ...]] = {
    "llamacpp": ("f16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl"),
    "vllm": ("auto", "fp8", "fp8_e5m2"),
    "sglang": ("auto", "fp8_e4m3", "fp8_e5m2", "fp4_mx_block16"),
    "trtllm": ("auto", "fp8"),
}
#: engines whose one dtype covers K and V both
_ONE_DTYPE = ("vllm", "sglang", "trtllm")


@dataclass(frozen=True)
class EngineSetting:
    engine: str
    policy: str  # the original policy's label
    k_type: str  # the engine's type names
    v_type: str
    lines: tuple[str, ...]  # flags or config lines, ready to paste
    mapped_policy: str  # the mapped setting as a tqbench policy (engine:K/V), measurable here
    skip_layers: tuple[int, ...] = ()
    unmapped: tuple[str, ...] = ()  # what the engine setting does not carry, plainly
    notes: tuple[str, ...] = ()  # the engine's own constraints on the setting
    original_bits: float = 0.0  # bits per K/V element (scales, sinks and window rows included) at ``seq_len``
    mapped_bits: float = 0.0
    seq_len: int = 0

    @property
    def engine_label(self) -> str:
        return ENGINE_LABELS[self.engine]

    def to_dict(self) -> dict:
        return {
            "engine": self.engine, "policy": self.policy, "k_type": self.k_type, "v_type": self.v_type,
            "lines": list(self.lines), "mapped_policy": self.mapped_policy, "skip_layers": list(self.skip_layers),
            "unmapped": list(self.unmapped), "notes": list(self.notes),
            "original_bits_per_element": round(self.original_bits, 4),
            "mapped_bits_per_element": round(self.mapped_bits, 4), "seq_len": self.seq_len,
        }


def _bits(spec: str, role: str, dim: int) -> float:
    return codec_from_spec(spec, role).bits_per_element(dim)


def _usable(engine: str, dim: int) -> tuple[str, ...]:
    """The engine's types that can store rows of ``dim`` (GGML blocks need a multiple of 32)."""
    out = []
    for t in _CHOICES[engine]:
        try:
            _bits(ENGINE_KV_TYPES[engine][t], "k", dim)
        except ValueError:
            continue
        out.append(t)
    return tuple(out)


def _pick(engine: str, want_bits: float, roles: tuple[str, ...], dim: int) -> str:
    """The engine type whose bits per element are nearest ``want_bits`` (ties: more bits, then the earlier in
    ``_CHOICES``)."""
    types = ENGINE_KV_TYPES[engine]
    usable = _usable(engine, dim)
    cost = {t: sum(_bits(types[t], r, dim) for r in roles) / len(roles) for t in usable}
    return min(usable, key=lambda t: (round(abs(cost[t] - want_bits), 9), -cost[t], usable.index(t)))


def _exact(engine: str, specs: set[str]) -> str | None:
    """The engine's name for the single codec in ``specs`` when it is one of the engine's types."""
    if len(specs) != 1:
        return None
    spec = next(iter(specs))
    for t in _CHOICES[engine]:
        if ENGINE_KV_TYPES[engine][t] == spec:
            return t
    return None


def _pick_vllm_tq(specs: dict[str, list[str]], dims: dict[str, int]) -> str | None:
    """The vLLM TurboQuant preset for a policy with TurboQuant codecs: the one whose K and V codecs equal the
    policy's, else the nearest in K bits plus V bits (ties: more bits); None where the policy has no ``turbo*``
    codec or no preset can store this head_dim (its Hadamard rotation needs a power of two)."""
    if not any(s.startswith("turbo") or s.startswith("vllm_") for r in ("k", "v") for s in specs[r]):
        return None
    for preset, (k, v) in VLLM_TQ_PRESETS.items():
        if set(specs["k"]) == {k} and set(specs["v"]) == {v}:
            return preset
    want = {r: sum(_bits(s, r, dims[r]) for s in specs[r]) / max(len(specs[r]), 1) for r in ("k", "v")}
    cost = {}
    for preset, (k, v) in VLLM_TQ_PRESETS.items():
        try:
            cost[preset] = (_bits(k, "k", dims["k"]), _bits(v, "v", dims["v"]))
        except ValueError:
            continue
    if not cost:
        return None
    return min(cost, key=lambda p: (round(abs(cost[p][0] - want["k"]) + abs(cost[p][1] - want["v"]), 9),
                                    -sum(cost[p])))


def _describe(specs: list[str]) -> str:
    counts: dict[str, int] = {}
    for s in specs:
        counts[s] = counts.get(s, 0) + 1
    return ", ".join(f"{s} on {n} layer{'s' if n > 1 else ''}" for s, n in counts.items())


def _lines(engine: str, k: str, v: str, skip: tuple[int, ...]) -> tuple[str, ...]:
    if engine == "llamacpp":
        fa = " -fa on" if v != "f16" else ""
        return (f"llama-server -m MODEL.gguf -ctk {k} -ctv {v}{fa}",
                f"(llama-cli / llama-bench take the same flags: --cache-type-k {k} --cache-type-v {v})")
    if engine == "vllm":
        extra = f" --kv-cache-dtype-skip-layers {' '.join(map(str, skip))}" if skip else ""
        return (f"vllm serve MODEL --kv-cache-dtype {k}{extra}",)
    if engine == "sglang":
        return (f"python -m sglang.launch_server --model-path MODEL --kv-cache-dtype {k}",)
    return ("trtllm-serve MODEL --extra_llm_api_options kv.yaml   # kv.yaml:",
            "kv_cache_config:", f"  dtype: {k}")


def _notes(engine: str, k: str, v: str) -> tuple[str, ...]:
    if engine == "llamacpp":
        out = []
        if v not in ("f16", "bf16", "f32"):
            out.append("a quantized V cache needs flash attention (-fa on); without it llama.cpp refuses the "
                       "setting")
        if k != v and {k, v} - {"f16"}:
            out.append("CUDA builds compile flash-attention kernels for mixed K/V types only with "
                       "GGML_CUDA_FA_ALL_QUANTS=ON (the CPU backend takes any pair)")
        return tuple(out)
    if engine == "vllm" and k in VLLM_TQ_PRESETS:
        return ("storage-only: the mapped policy stores vLLM's TurboQuant bytes bit for bit, but vLLM's attention "
                "kernels (Triton, CUDA/ROCm GPUs) cannot run here, so its measured quality is tqbench's attention "
                "over those bytes (vLLM's prefill attends to the prompt's raw K/V and only later tokens read the "
                "quantized cache, as tqbench's compressed mode does)",
                f"vLLM keeps the first and last {BOUNDARY_LAYERS} layers at the model's dtype with any turboquant "
                "preset (none on hybrid Mamba models); the mapped policy does too")
    if engine in ("vllm", "sglang"):
        return ("fp8 scales come from the checkpoint's k_scale/v_scale; without them both are 1.0 (what "
                "the mapped policy here measures)",) if k != "auto" else ()
    return ("TensorRT-LLM's fp8 KV uses the checkpoint's calibrated per-tensor scales; here the scale is "
            "computed on the prefill (fp8_e4m3-prefill)",) if k != "auto" else ()


def map_policy(policy: Policy | str, engine: str, geometry, seq_len: int = 1024) -> EngineSetting:
    """The closest ``engine`` KV setting to ``policy`` for a model of ``geometry`` (``KVGeometry``)."""
    from tqbench.engine.cache.estimate import estimate_kv

    engine = canonical_engine(engine)
    pol = parse_policy(policy)
    label = ENGINE_LABELS[engine]
    plan = pol.plan(geometry.num_layers, list(geometry.layer_types) if geometry.layer_types else None)
    dims = {"k": geometry.head_dim, "v": geometry.v_dim}
    unmapped: list[str] = []
    skip: tuple[int, ...] = ()
    layers = [p for p in plan if not p.dense_window]
    dense = tuple(p.layer for p in layers if p.k in DENSE_SPECS and p.v in DENSE_SPECS)
    if dense and len(dense) < len(layers):  # the uniform type is chosen on the layers the policy compresses
        layers = [p for p in layers if p.layer not in dense]
        if engine == "vllm":
            skip = dense
    specs = {"k": [p.k for p in layers], "v": [p.v for p in layers]}

    def mean_bits(role: str) -> float:
        return sum(_bits(s, role, dims[role]) for s in specs[role]) / max(len(specs[role]), 1)

    tq = _pick_vllm_tq(specs, dims) if engine == "vllm" else None
    if tq is not None:
        k = v = tq
    elif engine in _ONE_DTYPE:
        both = set(specs["k"]) | set(specs["v"])
        want = (mean_bits("k") + mean_bits("v")) / 2
        k = v = _exact(engine, both) or _pick(engine, want, ("k", "v"), dims["k"])
    else:
        k = _exact(engine, set(specs["k"])) or _pick(engine, mean_bits("k"), ("k",), dims["k"])
        v = _exact(engine, set(specs["v"])) or _pick(engine, mean_bits("v"), ("v",), dims["v"])

    known = set(ENGINE_KV_TYPES[engine].values()) | {c for kv in ENGINE_KV_PAIRS.get(engine, {}).values() for c in kv}
    for role, chosen in (("k", k), ("v", v)):
        used = sorted(set(specs[role]))
        if len(used) > 1:
            unmapped.append(f"per-layer {role.upper()} widths ({_describe(specs[role])}): {label} has one "
                            f"{role.upper()} type for every layer; mapped to {chosen} on all of them")
        foreign = [s for s in used if s not in known]
        if foreign and len(used) == 1:
            stored = VLLM_TQ_PRESETS[chosen][0 if role == "k" else 1] if tq else chosen
            unmapped.append(f"{role.upper()} codec {foreign[0]}: {label} has no such KV type; the nearest to its "
                            f"{mean_bits(role):.2f} bits/element is {chosen}"
                            + (f" ({role.upper()} stored as {stored}, {_bits(stored, role, dims[role]):.2f} "
                               "bits/element)" if tq else ""))
    if tq is not None:
        n_layers = geometry.num_layers
        edge = min(BOUNDARY_LAYERS, n_layers // 2)
        boundary = sorted(set(range(edge)) | set(range(n_layers - edge, n_layers)))
        skip = tuple(sorted(set(skip) - set(boundary)))  # vLLM adds its boundary layers itself
        squeezed = [i for i in boundary if i not in dense]
        if squeezed:
            unmapped.append(f"vLLM's {tq} keeps layers {','.join(map(str, boundary))} at the model's dtype (its "
                            "boundary protection, always on for non-hybrid models): the policy compresses "
                            f"{','.join(map(str, squeezed))}")
    elif engine == "vllm" and any(s.startswith("turbo") for r in ("k", "v") for s in specs[r]):
        unmapped.append(f"vLLM's TurboQuant presets need head_dim a power of two (this model: {dims['k']}): "
                        f"mapped to {k}")
    if engine in _ONE_DTYPE and (set(specs["k"]) != set(specs["v"])) and tq is None:
        unmapped.append(f"different K and V codecs: {label}'s --kv-cache-dtype sets both; mapped to {k}")
    if dense and not skip and len(dense) < len(plan) and tq is None:
        unmapped.append(f"fp16 layers {','.join(map(str, dense))}: {label} cannot leave single layers "
                        "unquantized; they get the uniform type")
    if pol.sink or pol.recent or pol.srecent > 0:
        windows = f" / srecent={pol.srecent}" if pol.srecent >= 0 else ""
        unmapped.append(f"sink={pol.sink} / recent={pol.recent}{windows} full-precision tokens: {label} stores every "
                        "token in its cache type")
    if pol.evicts:
        unmapped.append(f"token eviction (keep={fmt_keep(pol.keep)}, score={pol.score}"
                        + (f", demote={pol.demote}" if pol.demote else "")
                        + (", demote per layer" if any(o[0] == "demote" for o in pol.overrides) else "") + f"): {label}'s KV cache type keeps every "
                        "token; the mapped setting evicts nothing (its cache holds every row)")
    if any(p.dense_window for p in plan):
        unmapped.append("sliding-window layers kept as a bounded dense window here: the engine applies its "
                        "dtype to them too")
    lost = [t for t in _CHOICES[engine] if t not in _usable(engine, min(dims.values()))]
    if lost:
        unmapped.append(f"{label}'s {', '.join(lost)} need head_dim a multiple of 32 (this model: "
                        f"{min(dims.values())}): not available for this model")
    mapped = f"{engine}:{k}/{v}" if k != v else f"{engine}:{k}"
    if skip:  # vLLM's skip list: the mapped policy keeps those layers fp16 here too
        mapped_pol = replace(parse_policy(mapped), overrides=(("kv", "+".join(map(str, skip)), "fp16"),),
                             name=None)
        mapped_text = mapped_pol.to_string()
    else:
        mapped_pol = parse_policy(mapped)
        mapped_text = mapped
    orig_bits = estimate_kv(pol, geometry, seq_len).bits_per_element
    new_bits = estimate_kv(mapped_pol, geometry, seq_len).bits_per_element
    if new_bits > orig_bits + 0.005:
        unmapped.append(f"the {label} setting stores {new_bits:.2f} bits/element against the policy's "
                        f"{orig_bits:.2f}: the cache is {new_bits / orig_bits:.2f}x larger")
    return EngineSetting(
        engine=engine, policy=pol.label, k_type=k, v_type=v, lines=_lines(engine, k, v, skip),
        mapped_policy=mapped_text, skip_layers=skip, unmapped=tuple(unmapped), notes=_notes(engine, k, v),
        original_bits=orig_bits, mapped_bits=new_bits, seq_len=seq_len,
    )

