"""H2O (Zhang et al. 2023): the attention mass each row received from every query so far (prefill queries,
causally; with ``every``, each decoded query too), accumulated by the ``Evictor`` (``attention.mass``)."""

from __future__ import annotations

import torch

from tqbench.engine.cache.evict.scores.attention import mass
from tqbench.engine.cache.evict.scores.base import Score, ScoreInput, register

h2o_mass = mass


@register
class H2O(Score):
    name = "h2o"
    accumulates = True
    reference = "H2O (Zhang et al. 2023)"

    def score(self, x: ScoreInput) -> torch.Tensor:
        return x.mass
