"""Validation: does a candidate KV policy change what the model says, and what does it save?

``validate`` runs a baseline and a candidate side by side (``Engine.lockstep``), compares their greedy
token sequences, per-step top-1 choices and (optionally) their logits, and returns a ``ValidationReport``
(``report.py``) with a verdict and a recommendation (``recommendation.py``). ``self_test`` runs the baseline
against itself through the same loop (it must be ``exact-match``). Teacher-forced quality, where one early
flip cannot cascade, lives in ``quality.py``.

The verdict rules and every metric live in ``tqbench.engine.metrics`` (one definition each).

A report from ``dense-shadow`` mode (attention reads exact K/V) carries ``storage_only: true``: its verdict
says nothing about quality, and its recommendation says so.
"""

from __future__ import annotations

from tqbench.engine.events import (
    CancelFlag,
    GenerationFinished,
    OnEvent,
    PairStep,
    ValidationDone,
    emit,
    raise_if_cancelled,
)
from tqbench.engine.generate import GREEDY, Sampling
from tqbench.engine.metrics import DEFAULT_QUALITY_THRESHOLD
from tqbench.engine.policy.spec import Policy
from tqbench.engine.validate.report import ValidationReport, build_report
from tqbench.engine.validate.steps import StepRecord, check_generation_args, step_record

__all__ = ["self_test", "validate"]


def validate(
    engine,
    prompt,
    baseline: Policy | str = "fp16",
    candidate: Policy | str = "turbo4",
    *,
    cache_mode: str = "compressed",
    baseline_mode: str = "compressed",
    chat: bool = True,
    max_new_tokens: int = 64,
    sampling: Sampling = GREEDY,
    collect_logits: bool = False,
    per_step: bool = True,
    quality_threshold: float = DEFAULT_QUALITY_THRESHOLD,
    on_event: OnEvent | None = None,
    cancel: CancelFlag | None = None,
    _self_test: bool = False,
    prefill_chunk: int | None = None,
) -> ValidationReport:
    """Baseline vs candidate through ``Engine.lockstep``; ``on_event`` gets every event (``PairStep`` too)
    and finally ``ValidationDone``. Raises ``Cancelled`` when ``cancel()`` turns true."""
    check_generation_args(max_new_tokens, quality_threshold)
    base_chk, cand_chk = engine.check_policy(baseline), engine.check_policy(candidate)  # once, for both runs
    base_pol, cand_pol = base_chk.policy, cand_chk.policy
    steps: list[StepRecord] = []
    results: dict[str, object] = {}
    for ev in engine.lockstep(prompt, base_chk, cand_chk, baseline_mode=baseline_mode, candidate_mode=cache_mode,
                              chat=chat, max_new_tokens=max_new_tokens, sampling=sampling,
                              collect_logits=collect_logits, cancel=cancel, prefill_chunk=prefill_chunk):
        emit(on_event, ev)
        if isinstance(ev, PairStep):
            steps.append(step_record(ev.step, ev.baseline, ev.candidate))
        elif isinstance(ev, GenerationFinished):
            results[ev.run] = ev.result
    raise_if_cancelled(cancel, "validation")
    report = build_report(engine, prompt, base_pol, cand_pol, results["baseline"], results["candidate"], steps,
                          cache_mode=cache_mode, baseline_mode=baseline_mode, chat=chat,
                          max_new_tokens=max_new_tokens, sampling=sampling, per_step=per_step,
                          quality_threshold=quality_threshold, self_test=_self_test)
    emit(on_event, ValidationDone(report))
    return report


def self_test(engine, prompt, policy: Policy | str = "fp16", *, cache_mode: str = "compressed",
              **kwargs) -> ValidationReport:
    """The baseline against itself through the same lockstep loop: anything but exact-match is a bug.
    Takes ``validate``'s keywords (``on_event``, ``cancel`` among them)."""
    return validate(engine, prompt, policy, policy, cache_mode=cache_mode, baseline_mode=cache_mode,
                    _self_test=True, **kwargs)
