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
