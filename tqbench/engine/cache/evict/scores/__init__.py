"""Scores that rank a layer's held rows for eviction, per KV head (higher: keep), one module per score, each a
``Score`` class found by name in ``REGISTRY`` (kvpress's layout): ``snapkv``, ``tova``, ``h2o``, ``keynorm``,
``expected``, ``kvzip``. Every attention score reads exact queries (the call's, after rotary) and the held keys
as attention reads them. ``wrappers.Chunked`` (the policy's ``chunk=N``) wraps any of them.

Modules in this folder are imported on first import of the package, so a new score is one file (and its name
in ``policy.keep.SCORES``)."""

from __future__ import annotations

import importlib
import pkgutil

from tqbench.engine.cache.evict.scores.attention import attention_probs
from tqbench.engine.cache.evict.scores.attention import mass as h2o_mass
from tqbench.engine.cache.evict.scores.base import (
    PAD,
    REGISTRY,
    Score,
    ScoreInput,
    register,
    score_class,
    unwrap,
)
from tqbench.engine.cache.evict.scores.build import get_score
from tqbench.engine.cache.evict.scores.wrappers import Chunked, chunked

_INFRA = {"attention", "base", "build", "wrappers"}
for _m in pkgutil.iter_modules(__path__):
    if _m.name not in _INFRA:
        importlib.import_module(f"{__name__}.{_m.name}")

from tqbench.engine.cache.evict.scores.expected import expected  # noqa: E402
from tqbench.engine.cache.evict.scores.keynorm import keynorm  # noqa: E402
from tqbench.engine.cache.evict.scores.snapkv import snapkv  # noqa: E402
from tqbench.engine.cache.evict.scores.tova import tova  # noqa: E402

__all__ = ["PAD", "REGISTRY", "Chunked", "Score", "ScoreInput", "attention_probs", "chunked", "expected",
           "get_score", "h2o_mass", "keynorm", "register", "score_class", "snapkv", "tova", "unwrap"]
