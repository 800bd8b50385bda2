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
from tqbench.engine.validate.quality import baseline_logprobs, teacher_forced

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
    pols = [parse_policy(p) for p in policies]
    n = max(prefill + steps + 1, context)
    ids, label = text_ids(engine.tokenizer, text, n)
    raise_if_cancelled(cancel, JOB)
    base = baseline_logprobs(engine, ids[:, : prefill + steps + 1], prefill, on_event, cancel=cancel)
    out = []
    for i, pol in enumerate(pols):
        raise_if_cancelled(cancel, JOB)
        emit(on_event, Progress("verify", i, len(pols), pol.label))
        r = teacher_forced(engine, ids[:, : prefill + steps + 1], prefill, pol, cache_mode, baseline=base,
                           on_event=on_event, cancel=cancel)
        rep = report_at_context(engine, pol, ids, context)
        est = estimate_kv(pol, engine.geometry, context)
        out.append(FrontierPoint(pol.label, label, context, est.bits_per_element, rep.bits_per_element,
                                 rep.compressed_storage_bytes, prefill, r.steps, r.kl_mean, r.kl_max,
                                 r.top1_agreement, r.ppl_baseline, r.ppl_candidate))
    emit(on_event, Progress("verify", len(pols), len(pols), "done"))
    return out
