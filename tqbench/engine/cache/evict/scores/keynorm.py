"""Key norm (Devoto et al. 2024; kvpress ``KnormPress``): minus the key's L2 norm (low-norm keys draw attention)."""

from __future__ import annotations

import torch

from tqbench.engine.cache.evict.scores.base import Score, ScoreInput, register


def keynorm(k) -> torch.Tensor:
    return -k.float().norm(dim=-1)


@register
class KeyNorm(Score):
    name = "keynorm"
    reference = "KnormPress (Devoto et al. 2024)"

    def score(self, x: ScoreInput) -> torch.Tensor:
        return keynorm(x.keys)
