"""Per-query precision in a multi-token decode call (speculative decoding's verification).

Decoded one at a time, query ``p`` reads the store as it was after ``p`` tokens: rows packed by then are
quantized, the sinks and the recent tail exact. When several draft tokens are verified in one forward call,
the rows packed *during* the call (a recent window slides by one row per draft token) are exact for the
call's first queries and quantized for its later ones. Attention has one row per key, so those rows get
extra key columns: the call's keys are the usual ones (the history as stored before the call, plus the call's
own rows, exact) followed by column *sets* over the affected positions ``[lo, lo + width)``, each set one
(K version, V version) pair: K quantized / V as before, K as before / V quantized, both quantized. The mask
then gives each query exactly one version of each key: the one it would have read decoding one at a time.
Every attention path that takes a mask (SDPA, eager, the fused torch reference, the native kernel) runs it.

Sides can differ (a KIVI key block of 32 tokens next to per-token values): each side has its own cut per query.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Precision", "plan_precision", "precision_mask", "rows_in_parts", "set_rows"]

_SETS = ((True, False), (False, True), (True, True))  # (K quantized, V quantized) of each possible column set


@dataclass
class Precision:
    """What the queries of one call see of the rows packed during it (positions are absolute tokens)."""

    n0: int  # position of the call's first row (its first query)
    first_decode: int  # queries before this index are prefill rows: they read the call's rows exact
    lo: int  # the column sets cover positions [lo, lo + width)
    width: int
    cut0: tuple[int, int]  # (K, V) tail start before the call: positions below were already stored quantized
    cuts: tuple[tuple[int, ...], tuple[int, ...]]  # (K, V) tail start each query reads (len = queries)
    sets: tuple[tuple[bool, bool], ...]  # the column sets present, in order

    def flags(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Bool ``[L, width]`` per side: query i reads position lo + j quantized, where it was exact before."""
        pos = torch.arange(self.lo, self.lo + self.width, device=device)
        out = []
        for side in (0, 1):
            cut = torch.tensor(self.cuts[side], device=device)[:, None]
            q = (pos[None, :] >= self.cut0[side]) & (pos[None, :] < cut)
            q[: self.first_decode] = False
            out.append(q)
        return out[0], out[1]


def plan_precision(n0: int, first_decode: int, cut0: tuple[int, int], cuts: tuple[list, list],
                   lowest_visible: int) -> Precision | None:
    """The plan for a call, or None when every query reads what the call's first one reads (nothing packed
    during the call is visible to a decode query, or no query is a decode row)."""
    hi = max(max(cuts[0][first_decode:], default=0), max(cuts[1][first_decode:], default=0))
    lo = max(min(cut0), lowest_visible)
    if hi <= lo or first_decode >= len(cuts[0]):
        return None
    plan = Precision(n0, first_decode, lo, hi - lo, cut0, (tuple(cuts[0]), tuple(cuts[1])), ())
    kq, vq = plan.flags("cpu")
    present = tuple(s for s in _SETS if bool(((kq == s[0]) & (vq == s[1]) & (kq | vq)).any()))
    if not present:
        return None
    plan.sets = present
    return plan


def precision_mask(attention_mask: torch.Tensor | None, plan: Precision, total: int, batch: int,
                   device) -> torch.Tensor:
    """The call's mask ``[B, 1, L, total]`` (bool, additive 0/-inf, or None: causal) extended by the plan's
    column sets, in the same kind (None -> bool). Base column ``c`` holds position ``n0 + L - total + c``."""
    L = len(plan.cuts[0])
    first_pos = plan.n0 + L - total
    if attention_mask is None:
        q_pos = torch.arange(plan.n0, plan.n0 + L, device=device)[:, None]
        keep = (torch.arange(first_pos, first_pos + total, device=device)[None, :] <= q_pos)
        keep = keep.view(1, 1, L, total).expand(batch, 1, L, total)
        kind = None
    else:
        m = attention_mask[:, :, -L:, -total:]
        if m.shape[-1] < total:
            raise ValueError(f"the attention mask covers {m.shape[-1]} keys, the call reads {total}")
        if m.dtype == torch.bool:
            keep, kind = m, torch.bool
        else:
            low = torch.finfo(m.dtype).min / 2
            if not bool(((m == 0) | (m <= low)).all()):
                raise ValueError("an additive attention bias (not a 0/-inf mask): per-query precision in a "
                                 "speculative verification call needs a plain mask")
            keep, kind = m == 0, m.dtype
        if keep.shape[1] != 1:
            raise ValueError("per-head attention masks are not supported in a speculative verification call")
    kq, vq = plan.flags(device)
    c0 = plan.lo - first_pos
    cols = keep[..., c0 : c0 + plan.width]
    keep = keep.clone()
    keep[..., c0 : c0 + plan.width] = cols & ~(kq | vq)
    extra = [cols & (kq == s[0]) & (vq == s[1]) for s in plan.sets]
    out = torch.cat([keep, *extra], dim=-1)
    if kind is None or kind == torch.bool:
        return out
    return torch.zeros(out.shape, dtype=kind, device=device).masked_fill(~out, torch.finfo(kind).min)


def set_rows(plan: Precision, base: tuple[torch.Tensor, torch.Tensor],
             quant: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V rows of the plan's column sets, joined: ``[B, H, len(sets) * width, D]`` each. ``base``: the
    (K, V) rows at ``[lo, lo + width)`` as the call's first query reads them; ``quant``: as stored packed."""
    ks = [quant[0] if s[0] else base[0] for s in plan.sets]
    vs = [quant[1] if s[1] else base[1] for s in plan.sets]
    return torch.cat(ks, dim=2), torch.cat(vs, dim=2)


def rows_in_parts(parts: tuple, first: int, a: int, b: int, store, dtype: torch.dtype) -> torch.Tensor:
    """Rows at positions ``[a, b)`` of a store snapshot (``(kind, n, payload)`` parts in token order, the first
    at position ``first``): dense parts sliced, packed parts decoded unit by unit."""
    out, pos = [], first
    for kind, n, payload in parts:
        lo, hi = max(a, pos), min(b, pos + n)
        if lo < hi:
            if kind == "dense":
                out.append(payload[:, :, lo - pos : hi - pos].to(dtype))
            else:
                u = store.codec.tokens_per_unit
                u0, u1 = (lo - pos) // u, -(-(hi - pos) // u)
                dec = store.codec.decode({k: t[:, :, u0:u1] for k, t in payload.items()}, store.state, dtype)
                out.append(dec[:, :, lo - pos - u0 * u : hi - pos - u0 * u])
        pos += n
    return torch.cat(out, dim=2)


def quantized_rows(base: torch.Tensor, lo: int, chunks: list, store, dtype: torch.dtype) -> torch.Tensor:
    """``base`` (rows at ``[lo, lo + width)``) with every row packed by ``chunks`` (``(position, encoded)``)
    replaced by its stored (dequantized) value."""
    out = base.clone()
    width = base.shape[2]
    for start, enc in chunks:
        a, b = max(start, lo), min(start + next(iter(enc.values())).shape[2] * store.codec.tokens_per_unit,
                                   lo + width)
        if a < b:
            dec = store.codec.decode(enc, store.state, dtype)
            out[:, :, a - lo : b - lo] = dec[:, :, a - start : b - start]
    return out
