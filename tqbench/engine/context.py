"""``CompressedContext``: a context prefilled and compressed once (the query-agnostic protocol), then read by many
questions.

``Engine.compress(context, policy)`` prefills the context into the policy's cache; an evicting policy applies its
keep at the end of the context (no question exists yet: the scores see only the context), and the cache is then
frozen (``TQCache.freeze_eviction``): rows appended later (a question, the answer) are never evicted at a prefill
point. Each ``stream``/``generate`` works on its own copy of the compressed cache (``fork``), so every question reads
the same compressed context and the context is never prefilled or scored again. This is the setting of prefix
caching, multi-turn chat and RAG, and of kvpress's query-agnostic leaderboard.

    ctx = engine.compress(context_ids, "turbo4,keep=0.5,score=kvzip")
    for q in questions:
        print(ctx.generate(q, max_new_tokens=32).text)   # q: token ids [1, n] or text (tokenized as is)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from tqbench.engine.generate import GenerationResult, prefill


@dataclass
class CompressedContext:
    engine: object  # the Engine that compressed it
    ids: torch.Tensor  # the context's token ids [1, N]
    cache: object  # the compressed cache after the context (never decoded into: ``fork`` copies it)
    policy: object  # the CheckedPolicy, or a dense baseline's name (``fp16``, ``dense-fp16`` ...)
    label: str
    cache_mode: str  # the policy's cache mode ("dynamic" for a dense baseline)
    prefill_seconds: float
    context_pass_seconds: float = 0.0  # a context-pass score's (kvzip) scoring pass, before the prefill

    @property
    def tokens(self) -> int:
        return int(self.ids.shape[1])

    def report(self):
        """The compressed context's ``CacheReport`` (a dense baseline: None)."""
        rep = getattr(self.cache, "report", None)
        return rep() if callable(rep) else None

    def fork(self):
        """A copy of the compressed cache a question can be appended to (this context stays as compressed)."""
        return copy.deepcopy(self.cache)

    def stream(self, question, **kwargs):
        """``Engine.stream`` of ``question`` (ids ``[1, n]``, or text tokenized without special tokens) after the
        compressed context; same keywords as ``Engine.stream`` (its policy and cache mode are this context's)."""
        return self.engine.stream(question, context=self, **kwargs)

    def generate(self, question, **kwargs) -> GenerationResult:
        return self.engine.generate(question, context=self, **kwargs)


def compress(engine, context, policy, cache_mode: str = "compressed", *, prefill_chunk: int | None = None):
    """``Engine.compress``: prefill ``context`` once under ``policy`` (its context pass first, for kvzip), freeze
    the cache's eviction, and return the ``CompressedContext``."""
    import time

    from tqbench.constants import auto_prefill_chunk
    from tqbench.engine.cache.dense_baseline import is_dense_baseline
    from tqbench.engine.cache.tqcache import TQCache
    from tqbench.engine.request import check_context

    ids = context if isinstance(context, torch.Tensor) else engine.tokenizer(context, return_tensors="pt")["input_ids"]
    check_context(int(ids.shape[1]), 1, engine.max_context, engine.name)
    dense = policy is None or is_dense_baseline(policy)
    pol = None if dense else engine.check_policy(policy)
    cache = engine.make_cache(policy if dense else pol, cache_mode)
    pass_seconds = engine._context_pass(cache, ids)
    mode = cache_mode if pol is not None else "dynamic"
    t0 = time.perf_counter()
    prefill(engine.model, ids.to(next(engine.model.parameters()).device), cache,
            chunk=auto_prefill_chunk(int(ids.shape[1]), mode, prefill_chunk))
    seconds = time.perf_counter() - t0
    if isinstance(cache, TQCache):
        cache.freeze_eviction()
    label = pol.label if pol is not None else (policy or "dynamic-cache")
    return CompressedContext(engine, ids, cache, pol if pol is not None else policy, label, mode, seconds,
                             pass_seconds)
