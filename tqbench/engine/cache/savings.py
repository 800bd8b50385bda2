"""Does a policy store fewer bytes than its baseline, at a given length, and from which length on?

One rule, one definition: a policy **saves** at ``seq_len`` tokens when its exact byte estimate
(``estimate.estimate_kv``, what the cache report measures) is below the baseline's at the same length
(``stores_less``). Its **break-even** is the length from which on it saves (``break_even_tokens``: doubling,
then bisection between the last length that does not save and the first that does, checked over one cycle
of the policy's codec units), or None when it does not save up to the searched limit (the model's context).
``Savings`` carries both, the bytes, and why a policy that saves nothing at this length does not: layers kept
dense or bypassed, fixed bytes (shared rotations and codebooks, per-layer codec state) and the rows kept at
16 bits (sinks, the recent window, unfilled units).

validate, compare-policies, the workbench and the server all ask this module; none re-derives the rule.
Messages here name no front-end flag.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import asdict, dataclass

from tqbench.engine.cache.estimate import KVGeometry, estimate_kv
from tqbench.engine.policy.files import parse_policy
from tqbench.engine.policy.spec import Policy

__all__ = ["BREAK_EVEN_LIMIT", "USAGE_LENGTHS", "Savings", "break_even_tokens", "saves", "savings", "stores_less"]

#: the longest length ``break_even_tokens`` searches when the model's context is unknown
BREAK_EVEN_LIMIT = 1 << 20
#: the lengths a model is used at, where every verdict also states its bytes (those within the model's context):
#: a hybrid model's windows are a fixed cost, so its saving at the tested length is not its saving at 8K or 32K
USAGE_LENGTHS = (1024, 8192, 32768)


def stores_less(nbytes: int, baseline_bytes: int) -> bool:
    """The rule itself: a policy saves when it stores fewer bytes than the baseline (equal bytes save nothing)."""
    return nbytes < baseline_bytes


def saves(policy: Policy | str, baseline: Policy | str, geometry: KVGeometry, seq_len: int) -> bool:
    """``stores_less`` of ``policy`` against ``baseline`` at ``seq_len`` tokens (exact estimates)."""
    return stores_less(estimate_kv(policy, geometry, seq_len).total_bytes,
                       estimate_kv(baseline, geometry, seq_len).total_bytes)


def break_even_tokens(policy: Policy | str, baseline: Policy | str, geometry: KVGeometry,
                      limit: int | None = None, after: int = 0) -> int | None:
    """The length from which on ``policy`` saves against ``baseline`` (``saves``), above ``after`` tokens and up to
    ``limit`` (default ``BREAK_EVEN_LIMIT``); None when there is none.

    The first saving length above ``after`` is found by doubling, then bisection (it does not save one token
    below it). Bytes are not monotone in the length everywhere: a window-bounded store evicts whole codec units,
    so a sliding layer holds up to one unit more than its window, in a cycle of that unit's length. So the
    length found must keep saving for one full cycle (the lcm of the policy's codec units); where it does not,
    the search goes on from the first length that does not save."""
    return _break_even(parse_policy(policy), parse_policy(baseline), geometry, max(1, limit or BREAK_EVEN_LIMIT),
                       max(0, after))


@functools.lru_cache(maxsize=256)
def _break_even(pol: Policy, base: Policy, geometry: KVGeometry, cap: int, after: int) -> int | None:
    """``break_even_tokens`` of parsed policies (a pure function of its arguments: cached for a run of cells)."""
    period = _cycle(pol, geometry)
    lo = after
    while True:
        n = _first_saving(pol, base, geometry, lo, cap)
        if n is None:
            return None
        bad = next((m for m in range(n + 1, min(n + period, cap) + 1) if not saves(pol, base, geometry, m)), None)
        if bad is None:
            return n
        lo = bad


def _first_saving(pol: Policy, base: Policy, geometry: KVGeometry, lo: int, cap: int) -> int | None:
    """The first length above ``lo`` (which does not save, or is 0: no bytes) that saves, by doubling the step
    then bisection; None when none does up to ``cap``."""
    step = 1
    hi = lo + step
    while not saves(pol, base, geometry, min(hi, cap)):
        if hi >= cap:
            return None
        lo, step = hi, 2 * step
        hi = lo + step
    hi = min(hi, cap)
    while hi - lo > 1:  # saves(hi), not saves(lo)
        mid = (lo + hi) // 2
        if saves(pol, base, geometry, mid):
            hi = mid
        else:
            lo = mid
    return hi


def _cycle(pol: Policy, g: KVGeometry) -> int:
    """The lcm of the policy's codec units over its compressed layers (the cycle of a window-bounded store)."""
    units = [c.tokens_per_unit for p in pol.plan(g.num_layers, list(g.layer_types) if g.layer_types else None)
             if not p.dense_window for c in pol.layer_codecs(p, g.kv_heads)]
    return math.lcm(*units) if units else 1


@dataclass(frozen=True)
class Savings:
    """A policy's bytes against its baseline's at ``seq_len`` tokens, and its break-even length."""

    policy: str
    baseline: str
    seq_len: int
    bytes: int
    baseline_bytes: int
    #: the length from which on it saves (``break_even_tokens``; above ``seq_len`` where it saves nothing there);
    #: None: none up to ``searched_to``
    break_even_tokens: int | None
    searched_to: int
    reasons: tuple[str, ...] = ()  # why it saves nothing at ``seq_len`` (empty when it saves)
    #: (tokens, bytes, baseline bytes) at each of ``USAGE_LENGTHS`` within the model's context (exact estimates)
    at_lengths: tuple[tuple[int, int, int], ...] = ()

    @property
    def saves(self) -> bool:
        """The rule (``stores_less``): fewer bytes than the baseline at this length."""
        return stores_less(self.bytes, self.baseline_bytes)

    @property
    def starts_to_save(self) -> str:
        """From which length on it saves, in words."""
        if self.break_even_tokens is None:
            return f"it never saves (none up to {self.searched_to} tokens)"
        return f"it starts to save at {self.break_even_tokens} tokens"

    @property
    def message(self) -> str:
        """One line: saves X% at this length, or saves nothing, why, and from which length it would."""
        if self.saves:
            pct = 100.0 * (1 - self.bytes / self.baseline_bytes)
            return f"saves {pct:.1f}% against {self.baseline} at {self.seq_len} tokens"
        head = (f"saves nothing at {self.seq_len} tokens: {self.bytes} B against {self.baseline_bytes} B for "
                f"{self.baseline}")
        return "; ".join([head, *self.reasons, self.starts_to_save])

    @property
    def lengths_message(self) -> str:
        """One line: the bytes and the saving at each usage length (``USAGE_LENGTHS``), or "" when none was asked."""
        return "; ".join(f"{n} tokens: {b} B against {base} B ({100.0 * (1 - b / base):.1f}% saved)"
                         for n, b, base in self.at_lengths if base)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["reasons"] = list(self.reasons)
        d["at_lengths"] = [{"tokens": n, "bytes": b, "baseline_bytes": base,
                            "saved_pct": round(100.0 * (1 - b / base), 2) if base else 0.0}
                           for n, b, base in self.at_lengths]
        d["saves"] = self.saves
        d["message"] = self.message
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Savings:
        return cls(d["policy"], d["baseline"], d["seq_len"], d["bytes"], d["baseline_bytes"],
                   d["break_even_tokens"], d["searched_to"], tuple(d.get("reasons", ())),
                   tuple((r["tokens"], r["bytes"], r["baseline_bytes"]) for r in d.get("at_lengths", ())))


def savings(policy: Policy | str, baseline: Policy | str, geometry: KVGeometry, seq_len: int,
            limit: int | None = None) -> Savings:
    """``Savings`` of ``policy`` against ``baseline`` at ``seq_len`` tokens of ``geometry``; ``limit`` bounds the
    break-even search (the model's context) and the usage lengths stated beside it (``USAGE_LENGTHS``)."""
    pol, base = parse_policy(policy), parse_policy(baseline)
    est, base_est = estimate_kv(pol, geometry, seq_len), estimate_kv(base, geometry, seq_len)
    cap = max(1, limit or BREAK_EVEN_LIMIT)
    saving = stores_less(est.total_bytes, base_est.total_bytes)
    reasons = () if saving else _reasons(pol, geometry, est)
    # where it saves nothing, the break-even lies above this length (bytes need not be monotone below it)
    at = tuple((n, estimate_kv(pol, geometry, n).total_bytes, estimate_kv(base, geometry, n).total_bytes)
               for n in USAGE_LENGTHS if limit is None or n <= limit)
    return Savings(pol.label, base.label, seq_len, est.total_bytes, base_est.total_bytes,
                   break_even_tokens(pol, base, geometry, cap, after=0 if saving else seq_len), cap, reasons, at)


def _reasons(pol: Policy, g: KVGeometry, est) -> tuple[str, ...]:
    """Why ``pol`` stores as much as it does at ``est.seq_len``: dense layers, fixed bytes, 16-bit rows."""
    plans = pol.plan(g.num_layers, list(g.layer_types) if g.layer_types else None)
    out = []
    dense = Counter(p.reason or "the policy keeps this layer's K and V dense" for p in plans if not p.compressed)
    for why, n in dense.items():
        out.append(f"{n} of {len(plans)} layers store K/V uncompressed ({why})")
    if est.shared_bytes or est.state_bytes:
        out.append(f"{est.shared_bytes + est.state_bytes} B of fixed bytes ({est.shared_bytes} B of shared "
                   f"rotations/codebooks, {est.state_bytes} B of per-layer codec state such as key centering)")
    packed_layers = sorted((p for p in plans if p.compressed), key=lambda p: p.sliding)  # full layers first
    if packed_layers and est.full_precision_bytes:
        sink, recent = packed_layers[0].sink, packed_layers[0].recent
        window = f"{sink} sink + {recent} recent tokens per layer" if sink or recent else "unfilled codec units"
        out.append(f"{est.full_precision_bytes} B of rows kept at 16 bits ({window}, dense layers included)")
    return tuple(out)
