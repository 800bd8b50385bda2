"""Softmax attention of queries over held keys, the building block of the attention-based scores (GQA: a KV
head's query heads grouped beside it)."""

from __future__ import annotations

import torch

_CHUNK = 256  # queries per block when accumulating mass (bounds the [queries x rows] matrix)


def grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, Hq, L, D] -> [B, H, n_rep, L, D]."""
    b, hq, n, d = q.shape
    return q.reshape(b, kv_heads, hq // kv_heads, n, d)


def attention_probs(q: torch.Tensor, k: torch.Tensor, scaling: float, q_pos: torch.Tensor | None,
                    k_pos: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention [B, H, n_rep, L, T] of queries ``q`` [B, Hq, L, D] over keys ``k`` [B, H, T, D]
    (float32); with positions (``q_pos`` [L], ``k_pos`` [B, H, T]) a key after a query is masked."""
    qg = grouped(q.float(), k.shape[1])
    logits = torch.einsum("bhrld,bhtd->bhrlt", qg, k.float()) * scaling
    if q_pos is not None and k_pos is not None:
        future = k_pos[:, :, None, None, :] > q_pos.view(1, 1, 1, -1, 1).to(k_pos.device)
        logits = logits.masked_fill(future, float("-inf"))
    return torch.softmax(logits, dim=-1)


def mass(q, k, scaling, q_pos, k_pos) -> torch.Tensor:
    """The attention mass [B, H, T] that queries ``q`` give each key (causally, by positions), summed over the
    queries and the query heads of each KV head."""
    out = None
    for s in range(0, q.shape[2], _CHUNK):
        p = attention_probs(q[:, :, s : s + _CHUNK], k, scaling, q_pos[s : s + _CHUNK], k_pos).sum(dim=(2, 3))
        out = p if out is None else out + p
    return out
