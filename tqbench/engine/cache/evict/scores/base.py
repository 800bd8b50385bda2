"""The score object: one class per score (``score()`` ranks a layer's held rows, higher: keep), found by name in
``REGISTRY`` (as kvpress's presses are); ``ScoreInput`` is everything a score may read at an eviction point.

A new score is one module in this folder that defines a ``Score`` subclass with a ``name`` and decorates it with
``@register`` (plus its name in ``policy.keep.SCORES``, the torch-free list the policy grammar checks), and its
test. The cache's ``Evictor``, the allocator's keep cells and the byte estimate all build scores here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

#: a ragged layer's padding position (``ragged.PAD_POSITION``): after every query, so masked as a future key
PAD = torch.iinfo(torch.int32).max


@dataclass
class ScoreInput:
    """What a score reads at an eviction point of one layer (B batch, Hq query heads, H KV heads, T held rows)."""

    query: torch.Tensor  # the call's queries [B, Hq, t, D] (after rotary)
    keys: torch.Tensor  # the held keys [B, H, T, D], as attention reads them
    values: Callable[[], torch.Tensor]  # the held values [B, H, T, Dv] (dequantized on demand)
    scaling: float
    seen: int  # tokens seen, the call's included (its queries sit at positions seen - t .. seen - 1)
    positions: torch.Tensor  # [B, H, T] each held row's position (ragged: padding at ``PAD``)
    ragged: bool = False  # each KV head holds its own rows (padding masked by its position)
    window: torch.Tensor | None = None  # the last ``window`` queries [B, Hq, w, D] (``reads_window`` scores)
    mass: torch.Tensor | None = None  # [B, H, T] accumulated attention mass (``accumulates`` scores)
    rows: torch.Tensor | None = None  # [B, H, N] a score per position from a pass before the prefill (kvzip)


class Score:
    """One way to rank rows. Class flags say what the ``Evictor`` keeps for it between calls."""

    name: ClassVar[str] = ""
    #: keeps the last ``window`` queries across calls (``ScoreInput.window``)
    reads_window: ClassVar[bool] = False
    #: accumulates each held row's attention mass from every query (a float per row: bookkeeping bytes)
    accumulates: ClassVar[bool] = False
    #: reads per-position scores computed by a pass over the context before its prefill (``ScoreInput.rows``)
    context_pass: ClassVar[bool] = False
    #: what this score follows (docs and errors)
    reference: ClassVar[str] = ""

    def score(self, x: ScoreInput) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def __call__(self, x: ScoreInput) -> torch.Tensor:
        return self.score(x)


REGISTRY: dict[str, type[Score]] = {}


def register(cls: type[Score]) -> type[Score]:
    if not cls.name or cls.name in REGISTRY:
        raise ValueError(f"score class {cls.__name__} needs a unique name (got {cls.name!r})")
    REGISTRY[cls.name] = cls
    return cls


def unwrap(score: Score) -> Score:
    """The registered score under any wrappers."""
    while hasattr(score, "inner"):
        score = score.inner
    return score


def score_class(name: str) -> type[Score]:
    if name not in REGISTRY:
        raise ValueError(f"score={name!r} is invalid: valid scores are {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]
