"""SnapKV (Li et al. 2024; kvpress ``SnapKVPress``): the softmax attention of the last ``window`` queries over the
rows, averaged over the window, average-pooled over 5 neighbouring rows, averaged over the query heads of each
KV head."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tqbench.engine.cache.evict.scores.attention import attention_probs
from tqbench.engine.cache.evict.scores.base import Score, ScoreInput, register


def snapkv(q_window, k, scaling, q_pos, k_pos, pool: int = 5) -> torch.Tensor:
    p = attention_probs(q_window, k, scaling, q_pos, k_pos).mean(dim=(2, 3))  # [B, H, T]
    b, h, t = p.shape
    if pool > 1 and t > 1:
        p = F.avg_pool1d(p.reshape(b * h, 1, t), pool, stride=1, padding=pool // 2, count_include_pad=False)
        p = p.reshape(b, h, t)
    return p


@register
class SnapKV(Score):
    name = "snapkv"
    reads_window = True
    reference = "SnapKV (Li et al. 2024), kvpress SnapKVPress"

    def score(self, x: ScoreInput) -> torch.Tensor:
        q = x.window
        q_pos = torch.arange(x.seen - q.shape[2], x.seen, device=q.device)
        return snapkv(q, x.keys, x.scaling, q_pos, x.positions)
