"""Validation: does a candidate KV policy change what the model says, and what does it save?

``validate`` runs a baseline and a candidate side by side (``Engine.lockstep``), compares their greedy
token sequences, per-step top-1 choices and (optionally) their logits, and returns a ``ValidationReport``
with a verdict and a recommendation. ``self_test`` runs the baseline against itself through the same loop
(it must be ``exact-match``). ``teacher_forced_quality`` feeds the same tokens through both caches so one
early flip cannot cascade: perplexity of both, KL(baseline || candidate), top-1 agreement.

The verdict rules and every metric live in ``tqbench.engine.metrics`` (one definition each).

A report from ``dense-shadow`` mode (attention reads exact K/V) carries ``storage_only: true``: its verdict
says nothing about quality, and its recommendation says so.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from tqbench.engine.events import GenerationFinished, PairStep, ValidationDone
from tqbench.engine.generate import GREEDY, Cancelled, Sampling
from tqbench.engine.metrics import (
    DEFAULT_QUALITY_THRESHOLD,
    TokenComparison,
    compare_tokens,
    decide_verdict,
    logit_stats,
    same_context_kl,
)
from tqbench.engine.policy.spec import PRESETS, Policy, parse_policy

STATUS = {
    "exact-match": "safe",
    "near-stable": "usable-with-care",
    "prefix-stable-then-diverged": "risky",
    "diverged": "unsafe",
}


# ---- step records shared by validate and compare ----------------------------------------------------
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


def step_comparison(steps: list[StepRecord]) -> dict:
    paired = [s for s in steps if s.baseline_token is not None and s.candidate_token is not None]
    n = len(paired)
    return {
        "steps": len(steps),
        "paired_steps": n,
        "top1_match_ratio": sum(s.same_top1 for s in paired) / n if n else 1.0,
        "same_token_ratio": sum(s.same_token for s in paired) / n if n else 1.0,
    }


def logit_comparison(steps: list[StepRecord], first_divergence: int | None) -> dict | None:
    """KL and logit deltas over the steps where both runs saw the same context (``metrics.same_context_kl``);
    later steps compare different histories and are reported separately."""
    if not any(s.kl is not None for s in steps):
        return None
    k = same_context_kl([s.kl for s in steps], first_divergence)
    last = len(steps) - 1 if first_divergence is None else first_divergence
    deltas = [s.max_abs_logit_delta for s in steps if s.kl is not None and s.step <= last]
    return {
        "metric": "KL(baseline || candidate) in nats, softmax of the step's logits",
        "steps_compared": k.steps_compared,
        "kl_mean": k.kl_mean or 0.0,
        "kl_max": k.kl_max or 0.0,
        "max_abs_logit_delta": max(deltas, default=0.0),
        "after_divergence_steps": k.after_divergence_steps,
        "after_divergence_kl_mean": k.after_divergence_kl_mean,
    }


# ---- recommendation ------------------------------------------------------------------------------
def spec_bits(spec: str) -> float:
    """Nominal bits of a codec spec (``turbo2.5`` -> 2.5, ``int8`` -> 8, ``fp16`` -> 16)."""
    m = re.match(r"^(?:turbo|int|fp|bf)(\d+(?:\.\d+)?)", spec)
    return float(m.group(1)) if m else 16.0


def _codec_bits(preset: str) -> tuple[float, float]:
    pol = parse_policy(preset)
    return spec_bits(pol.k), spec_bits(pol.v)


@functools.lru_cache(maxsize=8)
def _ladder(geometry) -> list[tuple[float, str]]:
    from tqbench.engine.cache.estimate import estimate_kv

    return sorted((estimate_kv(name, geometry, 1024).bits_per_element, name) for name in PRESETS)


def recommend(verdict: str, policy: Policy, geometry=None, storage_only: bool = False) -> dict:
    """Status, a cause hint and the next policy to try, for one candidate's verdict.

    The next policy comes from the preset ladder ordered by estimated bits per element at 1024 tokens of
    ``geometry``: the next cheaper preset after an exact-match, the next dearer one otherwise."""
    if storage_only:
        return {
            "status": "storage-only",
            "cause_hint": "dense-shadow mode: attention read exact K/V, so the tokens say nothing about quality",
            "next_policy": policy.label,
            "next_step": "rerun with --cache-mode compressed (or simulate / fused) for a quality verdict",
        }
    status = STATUS[verdict]
    kb, vb = spec_bits(policy.k), spec_bits(policy.v)
    low = min(kb, vb)
    if verdict == "exact-match":
        hint = "no token changed; a more aggressive policy may hold too"
    elif kb < vb:
        hint = f"keys are the lower-precision side ({policy.k}): key error moves attention scores; raise key bits first"
    elif vb < kb:
        hint = f"values are the lower-precision side ({policy.v}): raise value bits, or keep the last layers' values int8"
    elif low <= 2:
        hint = f"{policy.k} keys and values: 2 bits is past the edge on most models; try 3 bits or an outlier split"
    elif low >= 16:
        hint = "the policy keeps fp16 everywhere: a difference here means the comparison itself is not deterministic"
    else:
        hint = (f"uniform {low:g}-bit K and V: each bit removed costs 2-3x in KL; a longer recent window "
                "(recent=32) or per-layer protection from `scan` helps")
    nxt = None
    if geometry is not None:
        from tqbench.engine.cache.estimate import estimate_kv

        # rank on the same footing as the presets: estimated bits at 1024 tokens of this model's geometry
        bits_per_element = estimate_kv(policy, geometry, 1024).bits_per_element
        ladder = _ladder(geometry)
        qjl = "qjl" in policy.k or "qjl" in policy.v
        if verdict == "exact-match":  # the gentlest step down: fewer bits, neither K nor V more precise
            lower = [name for bits, name in ladder if bits < bits_per_element - 1e-6
                     and _codec_bits(name)[0] <= kb and _codec_bits(name)[1] <= vb]
            nxt = lower[-1] if lower else None
        else:  # the cheapest step up: more bits, neither K nor V less precise, no QJL unless already QJL
            higher = [name for bits, name in ladder if bits > bits_per_element + 1e-6
                      and _codec_bits(name)[0] >= kb and _codec_bits(name)[1] >= vb
                      and (qjl or "qjl" not in name)]
            nxt = higher[0] if higher else "fp16"
    step = {
        "safe": "use it; try the next more aggressive policy to find the edge",
        "usable-with-care": "use it where small late wording changes are acceptable; check with --teacher-forced",
        "risky": "not for exact reproduction; try the next safer policy",
        "unsafe": "do not use; try the next safer policy",
    }[status]
    return {"status": status, "cause_hint": hint, "next_policy": nxt, "next_step": step}


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
    step_comparison: dict
    logit_comparison: dict | None
    policy_summary: dict
    policy_recommendation: dict
    texts: dict
    token_ids: dict
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
            "step_comparison": self.step_comparison,
            "logit_comparison": self.logit_comparison,
            "policy_summary": self.policy_summary,
            "policy_recommendation": self.policy_recommendation,
            "texts": self.texts,
            "token_ids": self.token_ids,
            "baseline_cache_report": _rep(self.baseline_cache_report),
            "candidate_cache_report": _rep(self.candidate_cache_report),
            "per_step": [s.to_dict() for s in self.per_step] if self.per_step is not None else None,
        }


def _rep(rep) -> dict | None:
    return rep.to_dict() if rep is not None else None


def policy_summary(base_result, cand_result) -> dict:
    rep = cand_result.cache_report
    b_tps, c_tps = base_result.decode_tokens_per_second, cand_result.decode_tokens_per_second
    return {
        "memory_saved_pct": rep.memory_saved_pct if rep else 0.0,
        "compression_ratio": round(rep.dense_fp16_bytes / rep.compressed_storage_bytes, 4)
        if rep and rep.compressed_storage_bytes else 1.0,
        "bits_per_element": rep.bits_per_element if rep else 16.0,
        "compressed_storage_bytes": rep.compressed_storage_bytes if rep else None,
        "dense_fp16_bytes": rep.dense_fp16_bytes if rep else None,
        "active_decode_memory_saved_pct": rep.active_decode_memory_saved_pct if rep else 0.0,
        "baseline_decode_tokens_per_second": round(b_tps, 3),
        "candidate_decode_tokens_per_second": round(c_tps, 3),
        "throughput_ratio": round(c_tps / b_tps, 4) if b_tps > 0 else None,
    }


def check_generation_args(max_new_tokens: int, quality_threshold: float = DEFAULT_QUALITY_THRESHOLD) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} is invalid: ask for at least 1 token")
    if not 0 < quality_threshold <= 1:
        raise ValueError(f"quality threshold {quality_threshold} is invalid: use a number in (0, 1]")


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
    on_event: Callable[[object], None] | None = None,
    cancel: Callable[[], bool] | None = None,
    _self_test: bool = False,
) -> ValidationReport:
    """Baseline vs candidate through ``Engine.lockstep``; ``on_event`` gets every event (``PairStep`` too)
    and finally ``ValidationDone``. Raises ``Cancelled`` when ``cancel()`` turns true."""
    check_generation_args(max_new_tokens, quality_threshold)
    base_pol, cand_pol = parse_policy(baseline), parse_policy(candidate)
    steps: list[StepRecord] = []
    results: dict[str, object] = {}
    for ev in engine.lockstep(prompt, base_pol, cand_pol, baseline_mode=baseline_mode, candidate_mode=cache_mode,
                              chat=chat, max_new_tokens=max_new_tokens, sampling=sampling,
                              collect_logits=collect_logits, cancel=cancel):
        if on_event is not None:
            on_event(ev)
        if isinstance(ev, PairStep):
            b, c = ev.baseline, ev.candidate
            rec = StepRecord(
                ev.step,
                b.token_id if b else None, c.token_id if c else None,
                b.top1_id if b else None, c.top1_id if c else None,
                b.text_delta if b else "", c.text_delta if c else "",
                baseline_seconds=b.step_seconds if b else None, candidate_seconds=c.step_seconds if c else None,
            )
            if b is not None and c is not None and b.logits is not None and c.logits is not None:
                rec.kl, rec.max_abs_logit_delta = logit_stats(b.logits, c.logits)
            steps.append(rec)
        elif isinstance(ev, GenerationFinished):
            results[ev.run] = ev.result
    if cancel is not None and cancel():
        raise Cancelled("validation cancelled")
    report = build_report(engine, prompt, base_pol, cand_pol, results["baseline"], results["candidate"], steps,
                          cache_mode=cache_mode, baseline_mode=baseline_mode, chat=chat,
                          max_new_tokens=max_new_tokens, sampling=sampling, per_step=per_step,
                          quality_threshold=quality_threshold, self_test=_self_test)
    if on_event is not None:
        on_event(ValidationDone(report))
    return report


def build_report(engine, prompt, base_pol: Policy, cand_pol: Policy, base_res, cand_res, steps, *, cache_mode,
                 baseline_mode, chat, max_new_tokens, sampling, per_step, quality_threshold,
                 self_test=False) -> ValidationReport:
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
        ok = verdict == "exact-match"
        rec = {"status": "self-test-passed" if ok else "self-test-failed",
               "cause_hint": "the baseline against itself through the same loop" + (
                   "" if ok else ": tokens differ, so the generation loop or cache is not deterministic"),
               "next_policy": None,
               "next_step": "validate a candidate policy" if ok else "report a bug: comparisons cannot be trusted"}
    else:
        rec = recommend(verdict, cand_pol, geometry, storage_only)
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
        texts={"baseline": base_res.text, "candidate": cand_res.text},
        token_ids={"baseline": list(base_res.token_ids), "candidate": list(cand_res.token_ids)},
        baseline_cache_report=base_res.cache_report,
        candidate_cache_report=cand_res.cache_report,
        per_step=steps if per_step else None,
        sampling=asdict(sampling),
        prompt=prompt if isinstance(prompt, (str, list)) else None,
    )


def self_test(engine, prompt, policy: Policy | str = "fp16", *, cache_mode: str = "compressed",
              **kwargs) -> ValidationReport:
    """The baseline against itself through the same lockstep loop: anything but exact-match is a bug."""
    return validate(engine, prompt, policy, policy, cache_mode=cache_mode, baseline_mode=cache_mode,
                    _self_test=True, **kwargs)


# ---- teacher-forced quality ------------------------------------------------------------------------------
@dataclass
class TeacherForcedReport:
    model: str
    source: str  # "corpus:<name>" or "prompt+baseline-continuation"
    cache_mode: str
    prefill_tokens: int
    steps: int
    results: list = field(default_factory=list)  # quality.TeacherForcedResult, one per candidate

    def to_dict(self) -> dict:
        return {
            "model": self.model, "source": self.source, "cache_mode": self.cache_mode,
            "prefill_tokens": self.prefill_tokens, "steps": self.steps,
            "baseline": "dense DynamicCache (fp16-equivalent, exact K/V)",
            "results": [r.to_dict() for r in self.results],
        }


def teacher_forced_quality(
    engine,
    candidates: list[Policy | str] | Policy | str,
    *,
    prompt=None,
    corpus: str | None = None,
    context_tokens: int = 256,
    eval_tokens: int = 128,
    cache_mode: str = "compressed",
    chat: bool = True,
    max_new_tokens: int = 64,
    on_event: Callable[[object], None] | None = None,
) -> TeacherForcedReport:
    """Teacher-forced quality of each candidate against a dense baseline.

    With ``corpus``: prefill ``context_tokens`` of a shipped text, then feed its next ``eval_tokens`` tokens.
    With ``prompt``: prefill the prompt, then feed the baseline's own greedy continuation
    (``max_new_tokens``) through both caches.
    """
    from tqbench.engine.validate.quality import baseline_logprobs, corpus_ids, teacher_forced

    if isinstance(candidates, (str, Policy)):
        candidates = [candidates]
    pols = [parse_policy(c) for c in candidates]
    if corpus is not None:
        if context_tokens < 1 or eval_tokens < 1:
            raise ValueError("--tf-context and --tf-tokens must be at least 1")
        ids = corpus_ids(engine.tokenizer, corpus, context_tokens + eval_tokens + 1)
        prefill = context_tokens
        source = f"corpus:{corpus}"
    else:
        if prompt is None:
            raise ValueError("teacher-forced quality needs a prompt or a corpus name")
        check_generation_args(max_new_tokens)
        ids = engine.encode_prompt(prompt, chat, max_new_tokens)
        cont = engine.generate(ids, None, max_new_tokens=max_new_tokens + 1, stop_at_eos=False).token_ids
        ids = torch.cat([ids, torch.tensor([cont], dtype=ids.dtype)], dim=1)
        prefill = int(ids.shape[1]) - len(cont)
        source = "prompt+baseline-continuation"
    base = baseline_logprobs(engine, ids, prefill, on_event)
    results = [teacher_forced(engine, ids, prefill, p, cache_mode, baseline=base, on_event=on_event) for p in pols]
    for r, p in zip(results, pols):
        object.__setattr__(r, "kv_policy", p.label)
    return TeacherForcedReport(engine.name, source, cache_mode, prefill, len(base), results)
