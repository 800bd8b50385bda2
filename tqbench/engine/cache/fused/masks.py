"""The attention mask a fused kernel takes, read once from what transformers passes (both kernel paths use it)."""

from __future__ import annotations

import torch


def bool_mask(attention_mask: torch.Tensor | None, seq: int, total: int) -> torch.Tensor | str | None:
    """``[B, L, total]`` bool (True = attend) from a 4-D mask ``[B, 1, >= L, >= total]``; None when there is no
    mask (causal over the last ``seq`` rows); or a string saying why the kernels cannot take it: a per-head mask,
    or an additive bias (a float mask with values other than 0 and "masked": -inf or at most ``finfo.min / 2``,
    which is what transformers writes)."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
        return "per-head attention masks"
    m = attention_mask[:, 0, -seq:, -total:]
    if m.dtype == torch.bool:
        return m
    keep = m == 0
    if not bool((keep | (m <= torch.finfo(m.dtype).min / 2)).all()):
        return "an additive attention bias (not a 0/-inf mask)"
    return keep


def ragged_mask(attention_mask: torch.Tensor | None, lengths: list[int], query: torch.Tensor, total: int,
                additive: bool) -> torch.Tensor | None:
    """The mask of a ragged layer's call (heads=ada, per-head keeps): its keys hold each KV head's ``lengths[h]``
    rows first (its demoted rows, then its held rows), padding
    up to ``max(lengths)``, then the call's rows (``total`` columns in all); each head's padding is masked for
    the query heads it serves (``[B, Hq, L, total]``), on top of ``attention_mask`` (bool, or additive
    0/min; None: causal over the call's rows). ``additive``: return a float mask (eager attention)."""
    span = max(lengths)
    if all(n == span for n in lengths):
        return attention_mask
    hq, seq = query.shape[1], query.shape[2]
    dev = query.device
    col = torch.arange(total, device=dev)
    held = torch.tensor(lengths, device=dev).repeat_interleave(hq // len(lengths)).view(1, hq, 1, 1)
    pad = (col >= held) & (col < span)  # [1, Hq, 1, total]
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        m = attention_mask[..., :total]
        return m.masked_fill(pad, torch.finfo(m.dtype).min)
    if attention_mask is None:
        row = torch.arange(seq, device=dev).view(1, 1, seq, 1)
        allowed = (col < span) | (col - span <= row)
    else:
        allowed = attention_mask[..., :total]
    allowed = allowed & ~pad
    if not additive:
        return allowed
    return torch.zeros(allowed.shape, dtype=query.dtype, device=dev).masked_fill(~allowed, torch.finfo(query.dtype).min)
