"""Expected Attention (kvpress ``ExpectedAttentionPress``): the attention a future query drawn from the Gaussian
fitted to the last ``window`` queries (mean mu, covariance S) expects, softmax over rows of
``s mu.k + s^2 k'Sk / 2``, times the value's norm. Unlike kvpress, the queries' statistics are not rotated to
future positions (the mean over the next positions' rotary phases is not applied)."""

from __future__ import annotations

import torch

from tqbench.engine.cache.evict.scores.attention import grouped
from tqbench.engine.cache.evict.scores.base import PAD, Score, ScoreInput, register


def expected(q_window, k, v, scaling, k_pos=None) -> torch.Tensor:
    qg = grouped(q_window.float(), k.shape[1])  # [B, H, r, L, D]
    mu = qg.mean(dim=3)  # [B, H, r, D]
    centred = qg - mu.unsqueeze(3)
    cov = torch.einsum("bhrld,bhrle->bhrde", centred, centred) / max(1, qg.shape[3] - 1)
    kf = k.float()
    lin = torch.einsum("bhrd,bhtd->bhrt", mu, kf) * scaling
    kc = torch.einsum("bhtd,bhrde->bhrte", kf, cov)  # (one pairwise product: no [T, D, D] intermediate)
    quad = (kc * kf[:, :, None]).sum(-1) * (scaling * scaling / 2)
    logits = lin + quad
    if k_pos is not None:  # a ragged layer's padding (its position PAD) is no row
        logits = logits.masked_fill((k_pos == PAD)[:, :, None, :], float("-inf"))
    p = torch.softmax(logits, dim=-1).mean(dim=2)  # [B, H, T]
    return p * v.float().norm(dim=-1)


@register
class Expected(Score):
    name = "expected"
    reads_window = True
    reference = "Expected Attention, kvpress ExpectedAttentionPress"

    def score(self, x: ScoreInput) -> torch.Tensor:
        return expected(x.window, x.keys, x.values(), x.scaling, x.positions if x.ragged else None)
