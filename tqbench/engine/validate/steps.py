"""Per-step records of a baseline/candidate pair, built in one place, and what validate and compare report
from them (step agreement, same-context logit comparison, the policy summary, argument checks)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tqbench.engine.events import TokenGenerated
from tqbench.engine.metrics import DEFAULT_QUALITY_THRESHOLD, logit_stats, match_ratio, same_context_kl
from tqbench.engine.request import check_max_new_tokens, check_quality_threshold


@dataclass
class StepRecord:
    step: int
    baseline_token: int | None
    candidate_token: int | None
    baseline_top1: int | None
    candidate_top1: int | None
    baseline_text: str = ""
    candidate_text: str = ""
    kl: float | None = None
    max_abs_logit_delta: float | None = None
    baseline_seconds: float | None = None
    candidate_seconds: float | None = None

    @property
    def same_token(self) -> bool:
        return self.baseline_token is not None and self.baseline_token == self.candidate_token

    @property
    def same_top1(self) -> bool:
        return self.baseline_top1 is not None and self.baseline_top1 == self.candidate_top1

    def to_dict(self) -> dict:
        d = asdict(self)
        d["same_token"] = self.same_token
        d["same_top1"] = self.same_top1
        return d


def step_record(step: int, b: TokenGenerated | None, c: TokenGenerated | None) -> StepRecord:
    """The record of one step from the two runs' token events (either may have finished: None); KL and the
    largest logit delta when both carry logits."""
    rec = StepRecord(
        step,
        b.token_id if b else None, c.token_id if c else None,
        b.top1_id if b else None, c.top1_id if c else None,
        b.text_delta if b else "", c.text_delta if c else "",
        baseline_seconds=b.step_seconds if b else None, candidate_seconds=c.step_seconds if c else None,
    )
    if b is not None and c is not None and b.logits is not None and c.logits is not None:
        rec.kl, rec.max_abs_logit_delta = logit_stats(b.logits, c.logits)
    return rec


@dataclass(frozen=True)
class StepComparison:
    """Per-step agreement of a pair over the steps both runs produced."""

    steps: int
    paired_steps: int
    top1_match_ratio: float
    same_token_ratio: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class LogitComparison:
    """KL and logit deltas over the steps where both runs saw the same context (``metrics.same_context_kl``)."""

    steps_compared: int
    kl_mean: float
    kl_max: float
    max_abs_logit_delta: float
    after_divergence_steps: int
    after_divergence_kl_mean: float | None
    metric: str = "KL(baseline || candidate) in nats, softmax of the step's logits"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PolicySummary:
    """Memory and throughput of a candidate run next to its baseline."""

    memory_saved_pct: float
    compression_ratio: float
    bits_per_element: float
    compressed_storage_bytes: int | None
    dense_fp16_bytes: int | None
    active_decode_memory_saved_pct: float
    baseline_decode_tokens_per_second: float
    candidate_decode_tokens_per_second: float
    throughput_ratio: float | None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SidePair:
    """One value per run of a pair (its text, its token ids)."""

    baseline: object
    candidate: object

    def of(self, run: str):
        """The ``"baseline"`` or ``"candidate"`` run's value."""
        if run not in ("baseline", "candidate"):
            raise KeyError(run)
        return getattr(self, run)

    def to_dict(self) -> dict:
        return {"baseline": self.baseline, "candidate": self.candidate}


def step_comparison(steps: list[StepRecord]) -> StepComparison:
    paired = [s for s in steps if s.baseline_token is not None and s.candidate_token is not None]
    return StepComparison(len(steps), len(paired), match_ratio([s.same_top1 for s in paired]),
                          match_ratio([s.same_token for s in paired]))


def logit_comparison(steps: list[StepRecord], first_divergence: int | None) -> LogitComparison | None:
    """KL and logit deltas over the steps where both runs saw the same context (``metrics.same_context_kl``);
    later steps compare different histories and are reported separately."""
    if not any(s.kl is not None for s in steps):
        return None
    k = same_context_kl([s.kl for s in steps], first_divergence)
    last = len(steps) - 1 if first_divergence is None else first_divergence
    deltas = [s.max_abs_logit_delta for s in steps if s.kl is not None and s.step <= last]
    return LogitComparison(k.steps_compared, k.kl_mean or 0.0, k.kl_max or 0.0, max(deltas, default=0.0),
                           k.after_divergence_steps, k.after_divergence_kl_mean)


def policy_summary(base_result, cand_result) -> PolicySummary:
    """Memory and throughput of a candidate run next to its baseline (``GenerationResult``s)."""
    rep = cand_result.cache_report
    b_tps, c_tps = base_result.decode_tokens_per_second, cand_result.decode_tokens_per_second
    return PolicySummary(
        memory_saved_pct=rep.memory_saved_pct if rep else 0.0,
        compression_ratio=round(rep.dense_fp16_bytes / rep.compressed_storage_bytes, 4)
        if rep and rep.compressed_storage_bytes else 1.0,
        bits_per_element=rep.bits_per_element if rep else 16.0,
        compressed_storage_bytes=rep.compressed_storage_bytes if rep else None,
        dense_fp16_bytes=rep.dense_fp16_bytes if rep else None,
        active_decode_memory_saved_pct=rep.active_decode_memory_saved_pct if rep else 0.0,
        baseline_decode_tokens_per_second=round(b_tps, 3),
        candidate_decode_tokens_per_second=round(c_tps, 3),
        throughput_ratio=round(c_tps / b_tps, 4) if b_tps > 0 else None,
    )


def check_generation_args(max_new_tokens: int, quality_threshold: float = DEFAULT_QUALITY_THRESHOLD) -> None:
    check_max_new_tokens(max_new_tokens)
    check_quality_threshold(quality_threshold)
