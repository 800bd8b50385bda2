"""Verify policies teacher-forced on a text the allocator did not see: the frontier (bits, KL, top-1, ppl).

A ``FrontierPoint`` is one policy measured on one held-out text: its exact bits per element at the stated
context (``estimate_kv``), the bits its own cache report gives after a real prefill of that context, and the
teacher-forced quality (``validate.quality.teacher_forced``: KL(exact || candidate), top-1 agreement,
perplexity of the real next tokens). ``frontier`` measures many policies against one dense baseline.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from tqbench.engine.allocate.texts import text_ids
from tqbench.engine.cache.estimate import estimate_kv
from tqbench.engine.events import CancelFlag, OnEvent, Progress, emit, raise_if_cancelled
from tqbench.engine.policy.files import parse_policy
from tqbench.engine.policy.spec import Policy
from tqbench.engine.validate.quality import dense_logprobs, per_sequence, teacher_forced_batch

JOB = "verify"


@dataclass(frozen=True)
class FrontierPoint:
    kv_policy: str
    text: str  # "corpus:<name>"
    context_tokens: int
    bits_per_element: float  # estimate_kv at context_tokens (what the budget is stated in)
    report_bits_per_element: float  # the policy's own cache report after prefilling context_tokens
    report_bytes: int
    prefill_tokens: int
    steps: int
    kl_mean: float
    kl_max: float
    top1_agreement: float
    ppl_baseline: float
    ppl_candidate: float

    @property
    def ppl_delta(self) -> float:
        return self.ppl_candidate - self.ppl_baseline

    def to_dict(self) -> dict:
        return asdict(self) | {"ppl_delta": self.ppl_delta}

    @classmethod
    def from_dict(cls, data: dict) -> FrontierPoint:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})


def report_at_context(engine, policy: Policy, ids: torch.Tensor, context: int):
    """The policy's own ``CacheReport`` after prefilling ``context`` tokens of ``ids`` (compressed mode)."""
    cache = engine.make_cache(policy, "compressed")
    device = next(engine.model.parameters()).device
    with torch.inference_mode():
        engine.model(input_ids=ids[:, :context].to(device), cache=cache, use_cache=True)
    return cache.report()


def frontier(engine, policies: list, *, text: str = "rivers", prefill: int = 1024, steps: int = 256,
             context: int = 1024, cache_mode: str = "simulate", on_event: OnEvent | None = None,
             cancel: CancelFlag | None = None) -> list[FrontierPoint]:
    """One ``FrontierPoint`` per policy on ``text`` (a shipped corpus name, ``heldout:NAME`` or a file); one dense
    baseline for all."""
    return frontier_texts(engine, policies, texts=[text], prefill=prefill, steps=steps, context=context,
                          cache_mode=cache_mode, on_event=on_event, cancel=cancel)[text]


def frontier_texts(engine, policies: list, *, texts: list[str], prefill: int = 1024, steps: int = 256,
                   context: int = 1024, cache_mode: str = "simulate", on_event: OnEvent | None = None,
                   cancel: CancelFlag | None = None) -> dict[str, list[FrontierPoint]]:
    """``frontier`` on several texts at once: ``{text: [FrontierPoint per policy]}``, the texts as one batch of
    sequences of equal length (one dense baseline forward for all, one candidate cache per policy whose every
    single-token step feeds every text: the same numbers as one text at a time, in about 1/len(texts) of the
    decode steps). The cache report at ``context`` is the candidate's own after its prefill when
    ``context == prefill`` (one sequence's share, ``quality.per_sequence``), else an extra compressed prefill per
    text (``report_at_context``)."""
    if not texts or len(set(texts)) != len(texts):
        raise ValueError(f"texts {texts!r}: give one or more distinct texts")
    pols = [parse_policy(p) for p in policies]
    n = max(prefill + steps + 1, context)
    pairs = [text_ids(engine.tokenizer, t, n) for t in texts]
    labels = [label for _, label in pairs]
    full = torch.cat([ids for ids, _ in pairs])
    ids = full[:, : prefill + steps + 1]
    raise_if_cancelled(cancel, JOB)
    base = dense_logprobs(engine, ids, prefill, on_event, cancel=cancel)
    out: dict[str, list[FrontierPoint]] = {t: [] for t in texts}
    for i, pol in enumerate(pols):
        raise_if_cancelled(cancel, JOB)
        emit(on_event, Progress("verify", i, len(pols), f"{pol.label} on {', '.join(labels)}"))
        seen: list = []
        own = context == prefill
        results = teacher_forced_batch(engine, ids, prefill, pol, cache_mode, baseline=base, on_event=on_event,
                                       cancel=cancel, after_prefill=(lambda c, seen=seen: seen.append(c.report()))
                                       if own else None)
        est = estimate_kv(pol, engine.geometry, context)
        for b, (t, r) in enumerate(zip(texts, results)):
            rep = per_sequence(seen[0], len(texts)) if own else \
                per_sequence(report_at_context(engine, pol, full[b:b + 1], context), 1)
            out[t].append(FrontierPoint(pol.label, labels[b], context, est.bits_per_element, rep["bits_per_element"],
                                        rep["compressed_storage_bytes"], prefill, r.steps, r.kl_mean, r.kl_max,
                                        r.top1_agreement, r.ppl_baseline, r.ppl_candidate))
    emit(on_event, Progress("verify", len(pols), len(pols), "done"))
    return out
