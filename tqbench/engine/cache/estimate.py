"""KV byte estimates from a model geometry alone (no weights), exact to the byte, and ``kv-estimate``.

The rules mirror ``store.KVStore``: sinks and the recent window stay full precision (counted as fp16),
the rest is packed in whole codec units, per-layer codec state is counted per layer and shared objects
(rotations, codebooks) once. ``TQCache.report()`` after a run over ``seq_len`` tokens gives the same bytes.
``kv_estimate`` answers the command of that name: the bytes of one or more policies for a model geometry
(``geometry.model_geometry``) and, under a memory budget, the longest context that fits.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from tqbench.engine.cache.evict.bookkeeping import bookkeeping_bytes
from tqbench.engine.cache.geometry import KVGeometry, ModelGeometry, fp16_row_bytes
from tqbench.engine.cache.report import bits_vs_fp16
from tqbench.engine.cache.store import window_start
from tqbench.engine.policy.files import parse_policy
from tqbench.engine.policy.keep import head_keeps, held_rows
from tqbench.engine.policy.spec import Policy
from tqbench.engine.request import RequestError, check_estimate_args, parse_bytes  # noqa: F401 (re-exported)

__all__ = [
    "KVEstimate",
    "KVEstimateReport",
    "KVEstimateRow",
    "KVGeometry",
    "estimate_kv",
    "kv_estimate",
    "longest_context",
    "parse_bytes",
    "store_bytes",
    "store_parts",
]


@dataclass
class KVEstimate:
    policy: str
    seq_len: int
    batch: int
    total_bytes: int
    dense_fp16_bytes: int
    shared_bytes: int
    layer_bytes: list[int] = field(default_factory=list)
    #: of ``total_bytes``: per-layer codec state (key centering means, calibrated scales ...), counted per layer
    state_bytes: int = 0
    #: of ``total_bytes``: rows kept at 16 bits (sinks, the recent window, unfilled units, dense/bypassed layers)
    full_precision_bytes: int = 0
    #: per layer, the rows each KV head holds where the policy fixes different counts (a per-head keep list:
    #: the report's ``head_tokens``), else () (every head the same; heads=ada: chosen by the scores at run time)
    head_rows: list[tuple[int, ...]] = field(default_factory=list)

    @property
    def bits_per_element(self) -> float:
        return bits_vs_fp16(self.total_bytes, self.dense_fp16_bytes)

    @property
    def saved_pct(self) -> float:
        return 100.0 * (1 - self.total_bytes / self.dense_fp16_bytes) if self.dense_fp16_bytes else 0.0

    def to_dict(self) -> dict:
        return {
            "kv_policy": self.policy, "seq_len": self.seq_len, "batch": self.batch,
            "total_bytes": self.total_bytes, "dense_fp16_bytes": self.dense_fp16_bytes,
            "shared_bytes": self.shared_bytes, "bits_per_element": round(self.bits_per_element, 4),
            "saved_pct": round(self.saved_pct, 2), "layer_bytes": list(self.layer_bytes),
        } | ({"head_rows": [list(h) for h in self.head_rows]} if any(self.head_rows) else {})


def _state_bytes(codec, batch: int, heads: int, head_dim: int) -> int:
    probe = torch.randn(batch, heads, max(codec.tokens_per_unit, 2), head_dim)
    return codec.state_bytes(codec.calibrate(probe))


@dataclass(frozen=True)
class StoreBytes:
    """The bytes of one K or V store: rows kept at 16 bits, packed units, per-layer codec state."""

    full_precision: int
    packed: int
    state: int
    packed_tokens: int

    @property
    def total(self) -> int:
        return self.full_precision + self.packed + self.state


def store_parts(codec, sink: int, recent: int, tokens: int, batch: int, heads: int, head_dim: int) -> StoreBytes:
    """``StoreBytes`` of one K or V store holding ``tokens`` rows (the rules of ``store.KVStore``)."""
    rows = batch * heads
    if codec.lossless:
        return StoreBytes(tokens * batch * codec.units_bytes(head_dim, heads), 0, 0, 0)
    head = min(sink, tokens)
    rest = tokens - head
    tpu = codec.tokens_per_unit
    packed = max(0, (rest - recent) // tpu) * tpu
    fp = fp16_row_bytes((tokens - packed) * rows, head_dim)
    if not packed:
        return StoreBytes(fp, 0, 0, 0)
    units = packed // tpu
    return StoreBytes(fp, units * batch * codec.units_bytes(head_dim, heads),
                      _state_bytes(codec, batch, heads, head_dim), packed)


def ragged_store_parts(codecs: list, sink: int, recent: int, held: list[int], batch: int, head_dim: int) -> StoreBytes:
    """``StoreBytes`` of a ragged layer's K or V (``evict.ragged.RaggedStore``: one store per KV head, head ``h``'s
    at its own codec ``codecs[h]`` holding its ``held[h]`` rows): the heads' one-head stores summed. Under
    ``heads=ada`` ``held`` is the uniform share for every head, exact for any split of the rows between the heads:
    each head holds its sinks and at least its protected tail, so its full-precision rows are the same in every
    head and its packed rows are its rows less those (codecs of one token per unit,
    ``ragged.check_ragged_codec``); every head keeps a packed row whenever the uniform share does
    (``keep.ada_floor_rows``), so each head's store holds its own codec state exactly when a uniform head would.
    ``packed_tokens``: the most any head packed."""
    parts = [store_parts(c, sink, recent, n, batch, 1, head_dim) for c, n in zip(codecs, held)]
    return StoreBytes(sum(p.full_precision for p in parts), sum(p.packed for p in parts),
                      sum(p.state for p in parts), max((p.packed_tokens for p in parts), default=0))


def store_bytes(codec, sink: int, recent: int, tokens: int, batch: int, heads: int, head_dim: int) -> tuple[int, int]:
    """(bytes, packed_tokens) of one K or V store holding ``tokens`` rows."""
    parts = store_parts(codec, sink, recent, tokens, batch, heads, head_dim)
    return parts.total, parts.packed_tokens


def estimate_kv(policy: Policy | str, geometry: KVGeometry, seq_len: int, batch: int = 1,
                prefill: int | None = None) -> KVEstimate:
    """``prefill``: how many of the ``seq_len`` tokens came in prefill calls (default: all); the rest were decoded
    one per call. It matters only to a policy that evicts (``keep``), which evicts at the end of each prefill
    call (and, with ``every``, every that many decoded tokens)."""
    if seq_len < 0 or batch < 1:
        raise ValueError("seq_len must be >= 0 and batch >= 1")
    prefill = seq_len if prefill is None else prefill
    pol = parse_policy(policy)
    g = geometry
    plans = pol.plan(g.num_layers, list(g.layer_types) if g.layer_types else None)
    shared: dict[str, int] = {}
    per_layer = []
    head_rows: list[tuple[int, ...]] = []
    dense_total = state_total = fp_total = 0
    for plan in plans:
        head_rows.append(())
        if plan.dense_window:
            held = g.window_held(seq_len)  # transformers' DynamicSlidingWindowLayer
            dense = g.dense_fp16_bytes(held, batch)
            per_layer.append(dense)
            dense_total += dense
            fp_total += dense
            continue
        total = 0
        codecs = list(zip(pol.layer_codecs(plan, g.kv_heads), (plan.k, plan.v)))
        held, fp16_held = seq_len, seq_len
        if plan.sliding and g.sliding_window:  # a window-bounded store (store.window_start)
            align = math.lcm(*(c.tokens_per_unit for c, _ in codecs))
            held = seq_len - window_start(seq_len, g.window_rows, align)
            fp16_held = g.window_held(seq_len)
        elif plan.evicts:  # token eviction (policy.keep): the rows each KV head still holds
            keeps = head_keeps(plan.keep, g.kv_heads, plan.layer)
            heads_held = [held_rows(seq_len, prefill, k, plan.sink, pol.window, plan.recent, pol.every) for k in keeps]
            held = sum(heads_held) // g.kv_heads  # (ragged: the mean; heads=ada, budget=global: every head's share)
            if plan.head_keeps:
                head_rows[-1] = tuple(heads_held)
        ragged = pol.ragged(plan)
        for (codec, _), role, dim in zip(codecs, ("k", "v"), (g.head_dim, g.v_dim)):
            if ragged:  # one store per KV head, each at its head's own codec
                heads = [pol.head_codec(plan, role, h) for h in range(g.kv_heads)]
                parts = ragged_store_parts(heads, plan.sink, plan.recent, heads_held, batch, dim)
                for c, n in zip(heads, heads_held):
                    if store_parts(c, plan.sink, plan.recent, n, batch, 1, dim).packed_tokens:
                        shared.update(c.shared_items(dim))
            else:
                parts = store_parts(codec, plan.sink, plan.recent, held, batch, g.kv_heads, dim)
                if parts.packed_tokens:
                    shared.update(codec.shared_items(dim))
            total += parts.total
            state_total += parts.state
            fp_total += parts.full_precision
        if plan.evicts:  # the held rows' positions (and h2o's mass)
            extra = sum(bookkeeping_bytes(pol.score, batch, 1, n) for n in heads_held)
            total += extra
            state_total += extra
        if plan.evicts and plan.demote:  # the evicted rows at the layer's demote codec (no sinks, no recent rows)
            for role, dim in (("k", g.head_dim), ("v", g.v_dim)):
                if ragged:  # each head's evicted rows in its own store, at the codec built for that head
                    heads = [pol.build_codec(plan.demote, role, layer=plan.layer, heads=(h,)) for h in range(g.kv_heads)]
                    gone = [seq_len - n for n in heads_held]
                    parts = ragged_store_parts(heads, 0, 0, gone, batch, dim)
                    for c, n in zip(heads, gone):
                        if n:
                            shared.update(c.shared_items(dim))
                else:
                    codec = pol.build_codec(plan.demote, role, layer=plan.layer)
                    parts = store_parts(codec, 0, 0, seq_len - held, batch, g.kv_heads, dim)
                    if parts.packed_tokens:
                        shared.update(codec.shared_items(dim))
                total += parts.total
                state_total += parts.state
                fp_total += parts.full_precision
        per_layer.append(total)
        dense_total += g.dense_fp16_bytes(fp16_held, batch)
    sb = sum(shared.values())
    return KVEstimate(pol.label, seq_len, batch, sum(per_layer) + sb, dense_total, sb, per_layer, state_total,
                      fp_total, head_rows)


def longest_context(policy, geometry: KVGeometry, budget_bytes: int, batch: int = 1,
                    limit: int | None = None) -> int:
    """The largest ``seq_len`` whose KV bytes fit ``budget_bytes`` (bytes grow with seq_len), capped at ``limit``."""
    if budget_bytes < 0:
        raise ValueError("the memory budget must be >= 0")
    cap = limit or (1 << 24)

    def fits(n: int) -> bool:
        return estimate_kv(policy, geometry, n, batch).total_bytes <= budget_bytes

    if not fits(1):
        return 0
    if fits(cap):
        return cap
    lo, hi = 1, cap  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class KVEstimateRow:
    """One policy of a ``kv-estimate``: its ``KVEstimate`` at the report's length (bits and saving rounded as
    shown), and, with a memory budget, the longest context that fits. ``to_dict()`` is its JSON row."""

    kv_policy: str
    seq_len: int
    batch: int
    total_bytes: int
    dense_fp16_bytes: int
    shared_bytes: int
    bits_per_element: float
    saved_pct: float
    kv_policy_string: str
    note: str | None = None  # e.g. seq_len beyond the model's context
    max_seq_len_in_budget: int | None = None  # with a memory budget only
    capped_by_model_context: bool | None = None
    #: per layer, the rows each KV head holds (a per-head keep list: ``KVEstimate.head_rows``), else None
    head_rows: list[list[int]] | None = None

    @classmethod
    def of(cls, est: KVEstimate, policy_string: str, **extra) -> KVEstimateRow:
        d = est.to_dict()
        return cls(d["kv_policy"], d["seq_len"], d["batch"], d["total_bytes"], d["dense_fp16_bytes"],
                   d["shared_bytes"], d["bits_per_element"], d["saved_pct"], policy_string,
                   head_rows=d.get("head_rows"), **extra)

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.note is None:
            del d["note"]
        if self.max_seq_len_in_budget is None:
            del d["max_seq_len_in_budget"], d["capped_by_model_context"]
        if self.head_rows is None:
            del d["head_rows"]
        return d


@dataclass
class KVEstimateReport:
    model: ModelGeometry
    seq_len: int
    batch: int
    memory_budget_bytes: int | None
    rows: list[KVEstimateRow] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"model": self.model.to_dict(), "seq_len": self.seq_len, "batch": self.batch,
                "memory_budget_bytes": self.memory_budget_bytes, "rows": [r.to_dict() for r in self.rows]}


def kv_estimate(model: ModelGeometry, policies: list[str], seq_len: int, batch: int = 1,
                memory_budget_bytes: int | None = None, decoded: int = 0) -> KVEstimateReport:
    """``decoded``: of ``seq_len``, the tokens decoded one per call after the prompt (``estimate_kv``'s
    ``prefill`` is the rest)."""
    check_estimate_args(seq_len, batch, decoded)
    if not policies:
        raise RequestError("policies", list(policies), "give at least one policy, e.g. fp16,turbo4")
    rep = KVEstimateReport(model, seq_len, batch, memory_budget_bytes)
    for text in policies:
        pol = parse_policy(text)
        extra = {}
        if model.max_context and seq_len > model.max_context:
            extra["note"] = f"seq_len is beyond the model's context of {model.max_context} tokens"
        if memory_budget_bytes is not None:
            n = longest_context(pol, model.geometry, memory_budget_bytes, batch, model.max_context)
            extra.update(max_seq_len_in_budget=n, capped_by_model_context=bool(model.max_context and
                                                                                n == model.max_context))
        est = estimate_kv(pol, model.geometry, seq_len, batch, prefill=seq_len - decoded)
        rep.rows.append(KVEstimateRow.of(est, pol.to_string(), **extra))
    return rep
