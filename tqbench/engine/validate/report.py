"""``ValidationReport``: what ``validate`` and ``self_test`` return, and ``build_report``, which fills it from
a finished baseline/candidate pair (verdict rules and metrics from ``tqbench.engine.metrics``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from tqbench.engine.metrics import TokenComparison, compare_tokens, decide_verdict
from tqbench.engine.policy.spec import Policy
from tqbench.engine.validate.evidence import evidence
from tqbench.engine.validate.recommendation import Recommendation, recommend, self_test_recommendation
from tqbench.engine.validate.steps import (
    LogitComparison,
    PolicySummary,
    SidePair,
    StepComparison,
    StepRecord,
    logit_comparison,
    policy_summary,
    step_comparison,
)


# ---- the report ---------------------------------------------------------------------------------------
@dataclass
class ValidationReport:
    model: str
    baseline: str
    candidate: str
    baseline_policy: str
    candidate_policy: str
    cache_mode: str
    baseline_mode: str
    chat: bool
    max_new_tokens: int
    quality_threshold: float
    storage_only: bool
    self_test: bool
    quality_verdict: str
    comparison: TokenComparison
    step_comparison: StepComparison
    logit_comparison: LogitComparison | None
    policy_summary: PolicySummary
    policy_recommendation: Recommendation
    texts: SidePair  # each run's text
    token_ids: SidePair  # each run's generated token ids
    baseline_cache_report: object | None = None
    candidate_cache_report: object | None = None
    per_step: list[StepRecord] | None = None
    sampling: dict = field(default_factory=dict)
    prompt: object = None

    @property
    def passed(self) -> bool:
        """The gate: exact-match for a self-test; otherwise exact-match or near-stable (never storage-only)."""
        if self.self_test:
            return self.quality_verdict == "exact-match"
        return not self.storage_only and self.quality_verdict in ("exact-match", "near-stable")

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "prompt": self.prompt,
            "baseline": self.baseline,
            "candidate": self.candidate,
            "baseline_policy": self.baseline_policy,
            "candidate_policy": self.candidate_policy,
            "cache_mode": self.cache_mode,
            "baseline_mode": self.baseline_mode,
            "chat": self.chat,
            "max_new_tokens": self.max_new_tokens,
            "sampling": self.sampling,
            "quality_threshold": self.quality_threshold,
            "storage_only": self.storage_only,
            "self_test": self.self_test,
            "quality_verdict": self.quality_verdict,
            "passed": self.passed,
            "comparison": self.comparison.to_dict(),
            "step_comparison": self.step_comparison.to_dict(),
            "logit_comparison": self.logit_comparison.to_dict() if self.logit_comparison is not None else None,
            "policy_summary": self.policy_summary.to_dict(),
            "policy_recommendation": self.policy_recommendation.to_dict(),
            "texts": self.texts.to_dict(),
            "token_ids": self.token_ids.to_dict(),
            "baseline_cache_report": _rep(self.baseline_cache_report),
            "candidate_cache_report": _rep(self.candidate_cache_report),
            "per_step": [s.to_dict() for s in self.per_step] if self.per_step is not None else None,
        }


def _rep(rep) -> dict | None:
    return rep.to_dict() if rep is not None else None


def stored_tokens(result) -> int:
    """The tokens a run's cache held at its end (its report's count; else prompt + generated tokens)."""
    rep = result.cache_report
    return rep.tokens if rep is not None else result.input_tokens + len(result.token_ids)


def candidate_savings(engine, policy: Policy, baseline: Policy, result, geometry=None):
    """``Engine.savings`` of ``policy`` against ``baseline`` at the length ``result``'s cache held (None when the
    model's ``geometry`` is unknown)."""
    return None if geometry is None else engine.savings(policy, baseline, stored_tokens(result))


def build_report(engine, prompt, base_pol: Policy, cand_pol: Policy, base_res, cand_res, steps, *, cache_mode,
                 baseline_mode, chat, max_new_tokens, sampling, per_step, quality_threshold,
                 self_test=False) -> ValidationReport:
    """The report of one finished lockstep run: verdict, comparisons, summary and recommendation."""
    from tqbench.engine.cache.estimate import KVGeometry

    comp = compare_tokens(base_res.token_ids, cand_res.token_ids)
    verdict = decide_verdict(comp, quality_threshold)
    storage_only = "dense-shadow" in (cache_mode, baseline_mode) and not self_test
    summary = policy_summary(base_res, cand_res)
    try:
        geometry = KVGeometry.from_config(engine.config)
    except Exception:  # noqa: BLE001 - a config without the usual fields: no ladder, said in the report
        geometry = None
    if self_test:
        rec = self_test_recommendation(verdict)
    else:
        ev = evidence([max(comp.baseline_tokens, comp.candidate_tokens)])
        rec = recommend(verdict, cand_pol, geometry, storage_only,
                        candidate_savings(engine, cand_pol, base_pol, cand_res, geometry), ev,
                        prompt_tokens=cand_res.input_tokens)
    return ValidationReport(
        model=engine.name,
        baseline=base_pol.label,
        candidate=cand_pol.label,
        baseline_policy=base_pol.to_string(),
        candidate_policy=cand_pol.to_string(),
        cache_mode=cache_mode,
        baseline_mode=baseline_mode,
        chat=chat,
        max_new_tokens=max_new_tokens,
        quality_threshold=quality_threshold,
        storage_only=storage_only,
        self_test=self_test,
        quality_verdict=verdict,
        comparison=comp,
        step_comparison=step_comparison(steps),
        logit_comparison=logit_comparison(steps, comp.first_divergence_index),
        policy_summary=summary,
        policy_recommendation=rec,
        texts=SidePair(base_res.text, cand_res.text),
        token_ids=SidePair(list(base_res.token_ids), list(cand_res.token_ids)),
        baseline_cache_report=base_res.cache_report,
        candidate_cache_report=cand_res.cache_report,
        per_step=steps if per_step else None,
        sampling=asdict(sampling),
        prompt=prompt if isinstance(prompt, (str, list)) else None,
    )
