"""Scores that rank a layer's held rows for eviction, per KV head (higher: keep). Every score reads exact
queries (the call's, after rotary) and the held keys as attention reads them; GQA: a KV head's score is the
mean over the query heads that read it.

- ``snapkv`` (SnapKV, Li et al. 2024): softmax attention of the last ``window`` queries over the rows, averaged
  over the window, smoothed by average pooling over 5 neighbouring rows (kvpress ``SnapKVPress``).
- ``tova`` (TOVA, Oren et al. 2024): the softmax attention of the last query alone.
- ``h2o`` (H2O, Zhang et al. 2023): the attention mass each row received from every query so far (prefill
  queries, causally; with ``every``, each decoded query too), accumulated.
- ``keynorm`` (kvpress ``KnormPress``, Devoto et al. 2024): minus the key's L2 norm (low-norm keys draw attention).
- ``expected`` (Expected Attention, kvpress ``ExpectedAttentionPress``): the attention a future query drawn from
  the Gaussian fitted to the last ``window`` queries (mean mu, covariance S) expects, softmax over rows of
  ``s mu.k + s^2 k'Sk / 2``, times the value's norm. Unlike kvpress, the queries' statistics are not rotated
  to future positions (the mean over the next positions' rotary phases is not applied).

``chunked`` (the policy's ``chunk=N``; ChunkKV, Liu et al. 2025): any of these scores averaged over the held rows
of each aligned chunk of N positions, so rows are kept or evicted a chunk at a time (a multi-token value, such as
a number's digits, stays whole). Unlike ChunkKV the chunk's mean, not its sum, ranks (the same order for full
chunks; a chunk that lost rows to an earlier eviction is not penalized for it), and the kept indices are not
shared between layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: a ragged layer's padding position (``ragged.PAD_POSITION``): after every query, so masked as a future key
PAD = torch.iinfo(torch.int32).max
_CHUNK = 256  # queries per block when accumulating H2O's prefill mass (bounds the [queries x rows] matrix)


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, Hq, L, D] -> [B, H, n_rep, L, D]."""
    b, hq, n, d = q.shape
    return q.reshape(b, kv_heads, hq // kv_heads, n, d)


def attention_probs(q: torch.Tensor, k: torch.Tensor, scaling: float, q_pos: torch.Tensor | None,
                    k_pos: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention [B, H, n_rep, L, T] of queries ``q`` [B, Hq, L, D] over keys ``k`` [B, H, T, D]
    (float32); with positions (``q_pos`` [L], ``k_pos`` [B, H, T]) a key after a query is masked."""
    qg = _grouped(q.float(), k.shape[1])
    logits = torch.einsum("bhrld,bhtd->bhrlt", qg, k.float()) * scaling
    if q_pos is not None and k_pos is not None:
        future = k_pos[:, :, None, None, :] > q_pos.view(1, 1, 1, -1, 1).to(k_pos.device)
        logits = logits.masked_fill(future, float("-inf"))
    return torch.softmax(logits, dim=-1)


def snapkv(q_window, k, scaling, q_pos, k_pos, pool: int = 5) -> torch.Tensor:
    p = attention_probs(q_window, k, scaling, q_pos, k_pos).mean(dim=(2, 3))  # [B, H, T]
    b, h, t = p.shape
    if pool > 1 and t > 1:
        p = F.avg_pool1d(p.reshape(b * h, 1, t), pool, stride=1, padding=pool // 2, count_include_pad=False)
        p = p.reshape(b, h, t)
    return p


def tova(q_last, k, scaling, k_pos=None) -> torch.Tensor:
    """(``k_pos``: a ragged layer's padded positions, its padding masked; None: every key read)"""
    q_pos = None if k_pos is None else torch.zeros(1, dtype=k_pos.dtype, device=k_pos.device) + (PAD - 1)
    return attention_probs(q_last[:, :, -1:], k, scaling, q_pos, k_pos).mean(dim=(2, 3))


def keynorm(k) -> torch.Tensor:
    return -k.float().norm(dim=-1)


def expected(q_window, k, v, scaling, k_pos=None) -> torch.Tensor:
    qg = _grouped(q_window.float(), k.shape[1])  # [B, H, r, L, D]
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


def h2o_mass(q, k, scaling, q_pos, k_pos) -> torch.Tensor:
    """The attention mass [B, H, T] that queries ``q`` give each key (causally, by positions), summed over the
    queries and the query heads of each KV head."""
    out = None
    for s in range(0, q.shape[2], _CHUNK):
        p = attention_probs(q[:, :, s : s + _CHUNK], k, scaling, q_pos[s : s + _CHUNK], k_pos).sum(dim=(2, 3))
        out = p if out is None else out + p
    return out


def chunked(score: torch.Tensor, positions: torch.Tensor, chunk: int) -> torch.Tensor:
    """``score`` [B, H, T] with each row's value replaced by the mean over the rows of its chunk (the held rows
    whose positions [B, H, T], ascending along T, fall in the same ``position // chunk``)."""
    if chunk <= 1 or score.shape[-1] == 0:
        return score
    ids = torch.div(positions.long(), chunk, rounding_mode="floor")
    seg = torch.zeros_like(ids)
    seg[..., 1:] = (ids[..., 1:] != ids[..., :-1]).long().cumsum(-1)  # 0, 0, 1, 1, 1, 2, ... per (B, H)
    s = score.float()
    finite = torch.isfinite(s)
    total = torch.zeros_like(s).scatter_add_(-1, seg, torch.where(finite, s, torch.zeros_like(s)))
    count = torch.zeros_like(s).scatter_add_(-1, seg, finite.float())
    mean = total.gather(-1, seg) / count.gather(-1, seg).clamp(min=1)
    return torch.where(finite, mean, s)
