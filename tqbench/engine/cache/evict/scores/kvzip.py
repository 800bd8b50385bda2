"""KVzip (Kim et al. 2025; kvpress ``KVzipPress``): a row's score is the most attention it receives while the model
re-reads its own context after a repeat prompt ("Repeat the previous context exactly."), the max over the
reconstruction's queries and the query heads of its KV head. Query-agnostic by construction: no question is read.

The scores come from a pass over the context before its prefill (``evict.reconstruct.context_scores``: exact
attention, its own dense cache, chunks of 2048 context tokens as kvpress's); the ``Evictor`` reads them at the
eviction point by each held row's position, in every cache mode (the fused decode reads the packed store)."""

from __future__ import annotations

import torch

from tqbench.engine.cache.evict.compact import EvictionError
from tqbench.engine.cache.evict.scores.base import PAD, Score, ScoreInput, register

NO_PASS = ("score=kvzip ranks rows by a context-reconstruction pass run before the prefill, and none ran for "
           "this cache: generate through Engine.stream/generate/compress (they run it), or call "
           "cache.set_context_scores(evict.reconstruct.context_scores(model, tokenizer, ids)) before the prefill")


@register
class KVzip(Score):
    name = "kvzip"
    context_pass = True
    reference = "KVzip (Kim et al. 2025), kvpress KVzipPress"

    def score(self, x: ScoreInput) -> torch.Tensor:
        if x.rows is None:
            raise EvictionError(NO_PASS)
        rows = x.rows.to(x.positions.device).float()
        n = rows.shape[-1]
        pos = x.positions.long()
        # a row past the scored context (the question, decoded tokens) ranks above every context row
        past = (pos >= n) & (pos != PAD)
        got = rows.gather(-1, pos.clamp(max=n - 1).expand(rows.shape[0], -1, -1))
        return torch.where(past, torch.full_like(got, float("inf")), got)
