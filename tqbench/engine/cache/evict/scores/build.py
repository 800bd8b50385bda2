"""``get_score``: a policy's ranking, the registered score by name, wrapped as the policy asks."""

from __future__ import annotations

from tqbench.engine.cache.evict.scores.base import REGISTRY, Score
from tqbench.engine.cache.evict.scores.wrappers import Chunked


def get_score(name: str, chunk: int = 1) -> Score:
    """The score registered as ``name``, wrapped by ``Chunked`` when ``chunk`` > 1."""
    cls = REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"score={name!r} is invalid: valid scores are {', '.join(sorted(REGISTRY))}")
    inner = cls()
    return Chunked(inner, chunk) if chunk > 1 else inner
