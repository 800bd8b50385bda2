"""Per-(layer, role, codec) sensitivity: the KL that quantizing one layer's K (or V) alone costs.

The measure (a "one-layer chunk" proxy of teacher-forced KL): prefill ``prefill`` tokens of a calibration text
once with exact attention and keep the dense K/V; then, for each cell, replace one layer's K (or V) history by
what a ``KVStore`` under that codec gives back (sinks and the recent window exact, the rest packed and
dequantized, the codec calibrated on those rows as the cache does) and feed the next ``steps`` tokens in one
forward call. The cell's sensitivity is the mean KL(exact || candidate) of those ``steps`` next-token
distributions (``metrics.kl_rows``). One chunk forward per cell instead of ``steps`` single-token calls: on
SmolLM2-135M (2 threads) 0.45 s a cell against 12.7 s for the one-layer teacher-forced run, and it ranks the
60 (layer, role) cells at turbo2 like that run (Spearman 0.94 against benchmarks/results/sensitivity-turbo2.json;
``rank_correlation`` below, see the README's Auto-policy section).

Sliding-window layers (transformers' bounded dense window) are not quantized by any policy and get no cells.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from tqbench.engine.cache.store import KVStore
from tqbench.engine.events import CancelFlag, OnEvent, SensitivityMeasured, emit, raise_if_cancelled
from tqbench.engine.metrics import kl_rows
from tqbench.engine.policy.spec import Policy

JOB = "allocate"
ROLES = ("k", "v")


def cell_key(layer: int, role: str, codec: str) -> str:
    return f"{layer}/{role}/{codec}"


@dataclass
class SensitivityTable:
    """``kl[(layer, role)][codec]``: the measured KL of quantizing that layer's K or V alone with that codec."""

    layers: list[int]
    codecs: list[str]
    kl: dict[tuple[int, str], dict[str, float]] = field(default_factory=dict)

    def get(self, layer: int, role: str, codec: str) -> float:
        return self.kl[(layer, role)][codec]

    def to_rows(self) -> list[dict]:
        return [{"layer": layer, "role": role, **{c: self.kl[(layer, role)][c] for c in self.codecs}}
                for layer in self.layers for role in ROLES]

    def as_tensor(self) -> torch.Tensor:
        """``[layers, 2 (k, v), codecs]`` float64 (the policy artifact's safetensors sidecar)."""
        return torch.tensor([[[self.kl[(layer, r)][c] for c in self.codecs] for r in ROLES] for layer in self.layers],
                            dtype=torch.float64)


def quantized_rows(policy: Policy, spec: str, role: str, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` ([batch, heads, tokens, head_dim]) as a cache under ``policy`` with codec ``spec`` holds them."""
    store = KVStore(policy.build_codec(spec, role), policy.sink, policy.recent)
    store.append(rows)
    return store.dense(rows.dtype)


def _dense_cache(config, keys: list, values: list) -> DynamicCache:
    cache = DynamicCache(config=config)
    for i, (k, v) in enumerate(zip(keys, values)):
        cache.update(k, v, i)
    return cache


def measure_sensitivity(
    engine,
    ids: torch.Tensor,
    prefill: int,
    codecs: list[str],
    policy: Policy,
    *,
    known: dict[str, float] | None = None,
    on_cell: Callable[[str, float], None] | None = None,
    on_event: OnEvent | None = None,
    cancel: CancelFlag | None = None,
) -> SensitivityTable:
    """Measure every (layer, role, codec) cell on ``ids`` ([1, prefill + steps]).

    ``policy`` supplies the token protection (sink, recent) and codec options (rotation, centering, ...).
    Cells already in ``known`` (``cell_key`` -> KL, a resumed job's partial results) are not measured again;
    ``on_cell(key, kl)`` is called after each new measurement (to persist it). One ``SensitivityMeasured`` per
    cell; ``cancel`` is checked before each: a cancelled job raises ``Cancelled``.
    """
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"ids must be shaped [1, tokens], got {tuple(ids.shape)}")
    steps = ids.shape[1] - prefill
    if prefill < 1 or steps < 1:
        raise ValueError(f"prefill={prefill} must leave at least one calibration step in {ids.shape[1]} tokens")
    if not codecs:
        raise ValueError("no codecs to measure: give at least one, e.g. turbo1,turbo2,turbo3,turbo4")
    known = dict(known or {})
    geo = engine.geometry
    plans = policy.plan(geo.num_layers, list(geo.layer_types) if geo.layer_types else None)
    layers = [p.layer for p in plans if not p.dense_window]
    if not layers:
        raise ValueError(f"{engine.name} has only sliding-window layers: there is nothing to allocate")
    table = SensitivityTable(layers, list(codecs))
    cells = [(layer, role, c) for layer in layers for role in ROLES for c in codecs]
    device = next(engine.model.parameters()).device
    ids = ids.to(device)
    chunk = ids[:, prefill:]
    raise_if_cancelled(cancel, JOB)
    todo = [cell for cell in cells if cell_key(*cell) not in known]
    with torch.inference_mode():
        base_lp = None
        if todo:
            cache = DynamicCache(config=engine.config)
            engine.model(input_ids=ids[:, :prefill], cache=cache, use_cache=True)
            keys = [layer.keys.clone() for layer in cache.layers]
            values = [layer.values.clone() for layer in cache.layers]
            del cache

            def chunk_logprobs(ks: list, vs: list) -> torch.Tensor:
                out = engine.model(input_ids=chunk, cache=_dense_cache(engine.config, ks, vs), use_cache=True)
                return torch.log_softmax(out.logits[0].float(), -1)

            base_lp = chunk_logprobs(keys, values)
        for i, (layer, role, spec) in enumerate(cells):
            raise_if_cancelled(cancel, JOB)
            key = cell_key(layer, role, spec)
            resumed = key in known
            if not resumed:
                ks, vs = list(keys), list(values)
                target = ks if role == "k" else vs
                target[layer] = quantized_rows(policy, spec, role, target[layer])
                kl = float(kl_rows(base_lp, chunk_logprobs(ks, vs)).mean())
                known[key] = kl
                if on_cell is not None:
                    on_cell(key, kl)
            table.kl.setdefault((layer, role), {})[spec] = known[key]
            emit(on_event, SensitivityMeasured("sensitivity", i + 1, len(cells), f"layer {layer} {role.upper()} {spec}",
                                               layer=layer, role=role, codec=spec, kl=known[key], resumed=resumed))
    return table


def rank_correlation(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation of two equal-length lists (average ranks for ties)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("rank_correlation needs two lists of the same length, at least 2 long")

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (sx * sy) if sx and sy else 0.0
