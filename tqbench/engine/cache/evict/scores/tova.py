"""TOVA (Oren et al. 2024; kvpress ``TOVAPress``): the softmax attention of the last query over the rows,
averaged over every query head of the layer (one score per position, shared by the layer's KV heads).

A ragged layer (each KV head its own rows) averages by position: a head that no longer holds a position adds
nothing to it (kvpress has no ragged layer; with every head holding the same rows it is kvpress's mean)."""

from __future__ import annotations

import torch

from tqbench.engine.cache.evict.scores.attention import attention_probs
from tqbench.engine.cache.evict.scores.base import PAD, Score, ScoreInput, register


def tova(q_last, k, scaling, k_pos=None) -> torch.Tensor:
    """[B, H, T]: the last query's attention, the mean over all the layer's query heads at each row's position
    (``k_pos``: a ragged layer's padded positions, its padding masked; None: every head holds the same rows)."""
    q_pos = None if k_pos is None else torch.zeros(1, dtype=k_pos.dtype, device=k_pos.device) + (PAD - 1)
    p = attention_probs(q_last[:, :, -1:], k, scaling, q_pos, k_pos)[:, :, :, 0]  # [B, H, r, T]
    hq = p.shape[1] * p.shape[2]
    if k_pos is None:
        return p.sum(dim=(1, 2), keepdim=False).div(hq).unsqueeze(1).expand(-1, k.shape[1], -1)
    valid = k_pos != PAD
    per_head = p.sum(dim=2).masked_fill(~valid, 0.0)  # [B, H, T]
    idx = torch.where(valid, k_pos.long(), torch.zeros_like(k_pos, dtype=torch.long)).flatten(1)
    by_pos = torch.zeros(p.shape[0], int(idx.max()) + 1, dtype=per_head.dtype, device=p.device)
    by_pos.scatter_add_(1, idx, per_head.flatten(1))
    return by_pos.gather(1, idx).view_as(per_head) / hq


@register
class TOVA(Score):
    name = "tova"
    reference = "TOVA (Oren et al. 2024), kvpress TOVAPress"

    def score(self, x: ScoreInput) -> torch.Tensor:
        return tova(x.query, x.keys, x.scaling, x.positions if x.ragged else None)
