"""Wrappers over any score. ``Chunked`` (the policy's ``chunk=N``; ChunkKV, Liu et al. 2025): the inner score
averaged over the held rows of each aligned chunk of N positions, so rows are kept or evicted a chunk at a time
(a multi-token value, such as a number's digits, stays whole). Unlike ChunkKV the chunk's mean, not its sum,
ranks (the same order for full chunks; a chunk that lost rows to an earlier eviction is not penalized for it),
and the kept indices are not shared between layers.

(Per-head budgets, ``heads=ada``, a per-head keep list and ``budget=global``, act on the ranking any score gives:
``evict.budgets``; the demote tier takes whatever rows a budget drops: ``evict.demote.DemoteTier``.)"""

from __future__ import annotations

import torch

from tqbench.engine.cache.evict.scores.base import Score, ScoreInput


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


class Chunked(Score):
    """``inner`` averaged per aligned chunk of ``chunk`` positions."""

    def __init__(self, inner: Score, chunk: int) -> None:
        self.inner, self.chunk = inner, chunk
        self.name = inner.name
        self.reads_window, self.accumulates = inner.reads_window, inner.accumulates
        self.context_pass, self.reference = inner.context_pass, inner.reference

    def score(self, x: ScoreInput) -> torch.Tensor:
        return chunked(self.inner.score(x), x.positions, self.chunk)
