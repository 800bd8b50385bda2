"""The cache report: what a policy's KV cache costs, to the byte, and what the run actually held."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from tqbench.constants import FUSED_KERNELS, FUSED_NATIVE
from tqbench.engine.cache.geometry import FP_BYTES
from tqbench.engine.codecs.base import bits_per_element


def bits_vs_fp16(stored_bytes: int, dense_fp16_bytes: int) -> float:
    """Bits per element of K/V stored in ``stored_bytes`` that an fp16 cache holds in ``dense_fp16_bytes``."""
    return bits_per_element(stored_bytes, dense_fp16_bytes // FP_BYTES)


def ran_in_kernels(fused_impl: dict[str, int], fallbacks: dict[str, int]) -> bool:
    """Every fused call ran in a kernel (native CPU or Triton: ``constants.FUSED_KERNELS``) and none fell back:
    the one test of "nothing was decoded resident" that the report and the cache's byte count share."""
    return bool(fused_impl) and all(k in FUSED_KERNELS for k in fused_impl) and not fallbacks


@dataclass(frozen=True)
class LayerBytes:
    layer: int
    k_codec: str
    v_codec: str
    tokens: int
    k_bytes: int  # all K bytes of this layer: fp16 rows + packed tensors + codec state
    v_bytes: int
    full_precision_bytes: int  # sink / recent-window / partial-block rows, counted as fp16
    packed_bytes: int
    state_bytes: int  # per-layer codec state (key centering means, outlier channel lists)
    k_packed_tokens: int
    v_packed_tokens: int
    dense_fp16_bytes: int  # what an fp16 DynamicCache holds for the same tokens
    reason: str | None = None
    #: token eviction (policy keep): rows each KV head dropped at prefill and at decode points (``tokens``:
    #: the rows each head holds; every head of a layer holds as many, each its own)
    evicted_prefill: int = 0
    evicted_decode: int = 0
    demoted_tokens: int = 0  # of the evicted rows, those kept at the policy's demote codec (in this layer's bytes)
    #: a ragged layer (heads=ada, a per-head keep list): the rows each KV head holds (they differ; ``tokens`` is
    #: their mean, the layer's budget per head); empty when every head holds ``tokens``
    head_tokens: tuple[int, ...] = ()

    @property
    def total_bytes(self) -> int:
        return self.k_bytes + self.v_bytes

    @property
    def bits_per_element(self) -> float:
        return bits_vs_fp16(self.total_bytes, self.dense_fp16_bytes)


@dataclass(frozen=True)
class CacheReport:
    cache_mode: str
    kv_policy: str
    policy_string: str
    tokens: int
    compressed_storage_bytes: int  # every layer's bytes + shared objects (rotations, codebooks) once
    dense_fp16_bytes: int
    resident_decode_bytes: int  # what this mode keeps in memory during decode (see notes)
    shared_bytes: int
    bits_per_element: float
    memory_saved_pct: float
    compressed_at_rest_saved_pct: float
    active_decode_memory_saved_pct: float
    quality_claims: bool
    layers: list[LayerBytes] = field(default_factory=list)
    shared_objects: dict[str, int] = field(default_factory=dict)
    bypassed_layers: list[dict] = field(default_factory=list)
    fused_calls: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)
    fused_impl: dict[str, int] = field(default_factory=dict)  # which implementation ran, calls per case
    sparse_v: dict | None = None  # fused Sparse-V: threshold, skipped / weighted value rows, share
    #: per-head layers in fused mode: each group of heads ("k=turbo4 v=turbo2 heads 0,2") -> implementation -> calls
    fused_groups: dict[str, dict[str, int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @classmethod
    def build(cls, *, mode, policy, layers, shared, transient_layer_bytes, fused_calls, fallbacks, held_dtype,
              fused_impl=None, sparse_v=None, fused_groups=None):
        fused_impl = dict(fused_impl or {})
        fused_groups = {k: dict(v) for k, v in (fused_groups or {}).items()}
        storage = sum(r.total_bytes for r in layers) + sum(shared.values())
        dense = sum(r.dense_fp16_bytes for r in layers)
        if mode in ("dense-shadow", "simulate"):
            resident = storage + dense
        else:  # compressed, and fused on its torch reference path: one layer's rows decoded transiently
            resident = storage + transient_layer_bytes
        notes = [
            f"full-precision rows (sinks, recent window, partial blocks) and dense baselines are counted as fp16 "
            f"({FP_BYTES} bytes/element); this run held activations in {held_dtype or 'the model dtype'}",
        ]
        if mode == "dense-shadow":
            notes.append("dense-shadow: attention read exact K/V; outputs equal fp16 by construction (storage-only)")
        if mode == "simulate":
            notes.append("simulate: attention read dequantized K/V from a dense buffer kept beside the store")
        if mode == "compressed":
            notes.append("compressed: one layer's K/V is dequantized transiently per step (counted in resident)")
        if mode == "fused":
            ran = ", ".join(f"{k} x{v}" for k, v in sorted(fused_impl.items())) or "no fused call yet"
            if ran_in_kernels(fused_impl, fallbacks):
                notes.append(f"fused: {ran}; the kernels read the packed codes in place and hold only split-K "
                             "partials (+ the call's full-precision rows), counted in resident")
                if "native-cpu" in fused_impl and native_int_scoring():
                    notes.append(native_int_scoring_note())
            elif transient_layer_bytes:
                notes.append(
                    f"fused: {ran}; the torch reference decodes one side of one layer (codes to rotated-domain "
                    "or dequantized rows) transiently per step, counted in resident"
                )
            else:
                notes.append(f"fused: {ran}; the kernels hold only split-K partials (nothing decoded resident)")
        if fused_groups:
            notes.append("fused per-head groups (each group of KV heads attended with its own K and V codecs): "
                         + "; ".join(f"{g}: " + ", ".join(f"{k} x{v}" for k, v in sorted(ran.items()))
                                     for g, ran in sorted(fused_groups.items())))
        if sparse_v:
            notes.append(
                f"sparse-V (threshold {sparse_v['threshold']:g}): skipped {sparse_v['skipped_rows']} of "
                f"{sparse_v['weighted_rows']} weighted value rows ({100 * sparse_v['skipped_share']:.1f}%)"
                + ("" if FUSED_NATIVE in fused_impl else "; only the native CPU kernel skips rows")
            )
        if fallbacks:
            notes.append(
                "fused fallbacks: " + ", ".join(f"{k} x{v}" for k, v in sorted(fallbacks.items()))
            )

        def pct(x: int) -> float:
            return round(100.0 * (1 - x / dense), 2) if dense else 0.0

        return cls(
            cache_mode=mode,
            kv_policy=policy.label,
            policy_string=policy.to_string(),
            tokens=max((r.tokens + r.evicted_prefill + r.evicted_decode for r in layers), default=0),
            compressed_storage_bytes=storage,
            dense_fp16_bytes=dense,
            resident_decode_bytes=resident,
            shared_bytes=sum(shared.values()),
            bits_per_element=round(bits_vs_fp16(storage, dense), 4),
            memory_saved_pct=pct(storage),
            compressed_at_rest_saved_pct=pct(storage),
            active_decode_memory_saved_pct=pct(resident),
            quality_claims=mode != "dense-shadow",
            layers=list(layers),
            shared_objects=dict(shared),
            bypassed_layers=[{"layer": r.layer, "reason": r.reason} for r in layers if r.reason],
            fused_calls=fused_calls,
            fallbacks=dict(fallbacks),
            fused_impl=fused_impl,
            sparse_v=sparse_v,
            fused_groups=fused_groups,
            notes=notes,
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        # as JSON reads it back (a tuple is a list there), so a saved and reloaded report compares equal
        d["layers"] = [asdict(r) | {"total_bytes": r.total_bytes, "head_tokens": list(r.head_tokens)}
                       for r in self.layers]
        return d


def native_int_scoring() -> bool:
    """Whether the loaded native kernel scores eligible turbo keys in integers (its build has AVX-512 VNNI)."""
    from tqbench.kernels.cpu.attention import kernel_rules

    return bool(kernel_rules()["score_int8_bits"])


def native_int_scoring_note() -> str:
    """The report's note on the keys the loaded native kernel scores in 16-bit integers (from its rules)."""
    from tqbench.kernels.cpu import attention

    rules = attention.kernel_rules()
    bits = "/".join(str(b) for b in rules["score_int8_bits"])
    pcaq = (f" and calibrated pcaq keys (widths <= {attention.PCAQ_INT16_MAX_WIDTH})"
            if rules.get("score_int16_pcaq") and attention.PCAQ_KEY_INT_SCORING else "")
    return (f"native-cpu scores packed {bits}-bit turbo keys{pcaq} (float32, head_dim % 64 == 0) in 16-bit "
            "integers: each score within a stated bound of the float score (tqbench.kernels.cpu.attention."
            "int_score_bound, pcaq_int_score_bound)")

