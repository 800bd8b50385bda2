"""The measuring half of ``speed.py``: one layer's fused decode call per codec choice, whole decode steps against
a dense ``DynamicCache``, and the key a cost table is cached under (this machine, its threads, the model, the context
and the protection). ``speed.py`` holds the model, the constrained solve and the cache of tables."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from tqbench.engine.allocate.budget import REFERENCE
from tqbench.engine.policy.spec import Policy

COSTS_FORMAT = "tqbench-decode-costs/2"  # /2: the group overhead past two groups
LAYER_REPEATS = 31
STEP_REPEATS = 16


@dataclass(frozen=True)
class DecodeCosts:
    """The measured decode costs the speed model predicts from (see the module doc). Seconds throughout."""

    context: int
    kv_heads: int
    layer: dict[str, dict[str, float]]  # role -> codec -> one layer's fused call (other role at ``reference``)
    mixed: float  # extra seconds of a layer whose KV heads form two groups (two (K, V) codec pairs) over one
    dense_step: float  # one decode step of the model, DynamicCache
    reference_step: float  # one decode step of the model, the uniform reference policy in fused mode
    reference: str = REFERENCE
    machine: dict = field(default_factory=dict)
    mixed_extra_group: float | None = None  # each group past two (None: ``mixed`` again)

    def __post_init__(self) -> None:
        for role in ("k", "v"):
            if self.reference not in self.layer.get(role, {}):
                raise ValueError(f"decode costs need the reference codec {self.reference} for role {role}")
        if min(self.dense_step, self.reference_step) <= 0:
            raise ValueError("decode step seconds must be positive")

    def group_overhead(self, groups: int) -> float:
        """Extra seconds of a layer whose KV heads form ``groups`` groups of one (K, V) codec pair each."""
        if groups <= 1:
            return 0.0
        extra = self.mixed if self.mixed_extra_group is None else self.mixed_extra_group
        return self.mixed + (groups - 2) * extra

    @property
    def uniform_layer(self) -> float:
        """One layer's call with both roles at the reference codec."""
        return self.layer["k"][self.reference]

    def choices(self) -> list[tuple[str, str]]:
        return [(role, c) for role in ("k", "v") for c in self.layer[role]]

    def per_row(self) -> dict[str, dict[str, float]]:
        """Nanoseconds per stored row and KV head of each choice's layer call (the table as the report gives it)."""
        n = self.context * self.kv_heads
        return {role: {c: round(t / n * 1e9, 3) for c, t in row.items()} for role, row in self.layer.items()}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DecodeCosts:
        return cls(int(d["context"]), int(d["kv_heads"]), {r: {c: float(t) for c, t in row.items()}
                                                            for r, row in d["layer"].items()},
                   float(d["mixed"]), float(d["dense_step"]), float(d["reference_step"]),
                   d.get("reference", REFERENCE), dict(d.get("machine", {})),
                   None if d.get("mixed_extra_group") is None else float(d["mixed_extra_group"]))


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key(engine, context: int, base: Policy) -> dict:
    """What a cost table depends on: this machine, its threads, the model, the context and the protection."""
    return {"host": platform.node(), "cpu": _cpu_model(),
            "threads": torch.get_num_threads(), "device": str(getattr(engine, "device", "cpu")),
            "model_fingerprint": engine.loaded.fingerprint, "context": context,
            "protection": f"sink={base.sink},recent={base.recent}", "codec_options": base.to_string(),
            "torch": torch.__version__}


def costs_path(partial_path: str | None) -> Path:
    """Beside the partial results file, else ``$XDG_CACHE_HOME/tqbench/decode-costs.json``."""
    if partial_path:
        return Path(str(partial_path) + ".decode-costs.json")
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "tqbench" / "decode-costs.json"


def _digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def layer_seconds(engine, policies: list[Policy], layer: int, context: int, repeats: int = LAYER_REPEATS,
                  warmup: int = 3) -> list[float]:
    """Median seconds of one fused decode call of ``layer`` (the ``TQLayer`` append of one token + the attention)
    over ``context`` synthetic stored rows, for each policy; the calls are interleaved round by round (one call of
    each policy per round), so a load spike of a shared machine falls on every policy alike."""
    from tqbench.engine.cache.fused.install import fused_attention
    from tqbench.engine.cache.layer import TQLayer

    g = engine.geometry
    q_heads = int(getattr(engine.config, "num_attention_heads", g.kv_heads))
    dtype = next(engine.model.parameters()).dtype
    gen = torch.Generator().manual_seed(layer)
    k = (torch.randn(1, g.kv_heads, context, g.head_dim, generator=gen)
         + torch.randn(1, g.kv_heads, 1, g.head_dim, generator=gen)).to(dtype)
    v = torch.randn(1, g.kv_heads, context, g.v_dim, generator=gen).to(dtype)
    q = torch.randn(1, q_heads, 1, g.head_dim, generator=gen).to(dtype)
    k1, v1 = k[:, :, -1:].clone(), v[:, :, -1:].clone()
    scale = g.head_dim ** -0.5

    def stepper(policy: Policy):
        plans = policy.plan(g.num_layers, list(g.layer_types) if g.layer_types else None)
        tq = TQLayer(plans[layer], "fused", policy, g.sliding_window, kv_heads=g.kv_heads)
        tq.update(k, v)

        def step():
            kk, vv = tq.update(k1, v1)
            if isinstance(kk, torch.Tensor):  # lossless both roles: the model's own attention over dense rows
                rep = q_heads // g.kv_heads
                return torch.nn.functional.scaled_dot_product_attention(
                    q, kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1), scale=scale)
            return fused_attention(q, kk, None, scale)

        return step

    with torch.inference_mode():
        steps = [stepper(p) for p in policies]
        times: list[list[float]] = [[] for _ in policies]
        for i in range(warmup + repeats):
            for j, step in enumerate(steps):
                t = time.perf_counter()
                step()
                if i >= warmup:
                    times[j].append(time.perf_counter() - t)
    return [statistics.median(t) for t in times]


def decode_steps(engine, policies: list[Policy | None], context: int, steps: int = STEP_REPEATS,
                 seed: int = 0) -> list[float]:
    """Median seconds of one decode step at ``context`` tokens for each policy (None: a dense ``DynamicCache``;
    a policy: fused mode), the steps interleaved in one process (each cache prefilled once)."""
    from tqbench.engine.generate import prefill

    vocab = int(getattr(engine.config, "vocab_size", 1000))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, max(4, vocab - 1), (1, context), generator=gen)
    device = next(engine.model.parameters()).device
    ids = ids.to(device)
    caches = [engine.make_cache(p, "fused") if p is not None else engine.make_cache(None) for p in policies]
    with torch.inference_mode():
        for cache in caches:
            prefill(engine.model, ids[:, :-1], cache)
    tok = ids[:, -1:]
    times: list[list[float]] = [[] for _ in policies]
    with torch.inference_mode():
        for i in range(steps + 2):
            for j, cache in enumerate(caches):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                engine.model(input_ids=tok, cache=cache, use_cache=True)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if i >= 2:  # two warm-up steps
                    times[j].append(time.perf_counter() - t)
    return [statistics.median(t) for t in times]


def measure_costs(engine, context: int, base: Policy, choices: dict[str, list[str]], layer: int,
                  reference: str = REFERENCE, repeats: int = LAYER_REPEATS, steps: int = STEP_REPEATS) -> DecodeCosts:
    """Measure the cost table (module doc) for the role -> codec ``choices`` (``reference`` and fp16 added)."""
    pol = replace(base, protect="", overrides=())
    heads = engine.geometry.kv_heads
    configs: list[tuple[str, str, str]] = [(reference, reference, "")]  # (K spec, V spec, what it measures)
    for role in ("k", "v"):
        for codec in dict.fromkeys([*choices.get(role, []), "fp16"]):
            if codec != reference:
                configs.append((codec, reference, "k") if role == "k" else (reference, codec, "v"))
    others = [c for c in choices.get("k", []) if c not in (reference, "fp16")]
    two = many = None
    if heads > 1 and others:  # two groups: K alternating another codec and the reference
        two = [others[0] if h % 2 == 0 else reference for h in range(heads)]
        configs.append(("|".join(two), reference, "two"))
        kinds = [reference, *others]
        many = [kinds[h % len(kinds)] for h in range(heads)]  # as many groups as K choices allow
        if len(set(many)) > 2:
            configs.append(("|".join(many), reference, "many"))
        else:
            many = None
    secs = layer_seconds(engine, [replace(pol, k=kc, v=vc) for kc, vc, _ in configs], layer, context, repeats)
    table: dict[str, dict[str, float]] = {"k": {reference: secs[0]}, "v": {reference: secs[0]}}
    mixed, extra = 0.0, None
    for (kc, vc, what), t in zip(configs, secs):
        if what in ("k", "v"):
            table[what][kc if what == "k" else vc] = max(t, 1e-9)
    for (_, _, what), t in zip(configs, secs):
        if what == "two":
            mixed = max(0.0, t - sum(table["k"][s] for s in two) / heads)
    for (_, _, what), t in zip(configs, secs):
        if what == "many":
            over = t - sum(table["k"][s] for s in many) / heads
            extra = max(0.0, (over - mixed) / (len(set(many)) - 2))
    dense, ref = decode_steps(engine, [None, replace(pol, k=reference, v=reference)], context, steps)
    return DecodeCosts(context, heads, table, mixed, dense, ref, reference, mixed_extra_group=extra)


def measure_speed(engine, policy: Policy, context: int, steps: int = 16) -> dict:
    """A short decode of ``policy`` (fused) vs dense, interleaved in one process: tokens/s and their ratio."""
    dense, fused = decode_steps(engine, [None, policy], context, steps)
    return {"dense_tok_s": 1.0 / dense, "policy_tok_s": 1.0 / fused, "ratio": dense / fused, "steps": steps,
            "context_tokens": context}
