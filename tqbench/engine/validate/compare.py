"""Compare several candidate policies against one baseline on one or more prompts.

The baseline is generated once per prompt (its token ids and logits kept); each (policy, prompt) cell then
generates the candidate and compares it with the stored baseline exactly as ``validate`` does. Per policy
the row aggregates its cells: the worst verdict, mean token match, mean top-1 agreement, mean KL over the
steps where both runs saw the same context, mean saving, bits per element and throughput ratio.

The recommendation (the seed's rule): choose the exact-match compressed policy with the highest saving;
if there is none, keep ``fp16`` and name the ``best_risky_policy`` (best verdict, then token match, then
lowest KL) and the ``unsafe_policies`` (verdict ``diverged``). A policy that stores at least as many bytes as
the baseline on some prompt's length (``cache.savings``: ``CompareRow.saves``) is never recommended: it is
named in ``saves_nothing_policies`` with the length from which it would save. The sample behind the rows
(``CompareResult.evidence``, ``validate.evidence``) carries a caveat when it is too small to call anything safe.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from tqbench.engine.events import (
    CancelFlag,
    CompareCell,
    GenerationFinished,
    OnEvent,
    Progress,
    TokenGenerated,
    emit,
    raise_if_cancelled,
)
from tqbench.engine.metrics import (
    DEFAULT_QUALITY_THRESHOLD,
    VERDICTS,
    compare_tokens,
    decide_verdict,
    worst_verdict,
)
from tqbench.engine.policy.checked import CheckedPolicy
from tqbench.engine.policy.files import parse_policy
from tqbench.engine.policy.presets import PRESETS
from tqbench.engine.policy.spec import Policy
from tqbench.engine.validate.evidence import Evidence, evidence
from tqbench.engine.validate.report import candidate_savings
from tqbench.engine.validate.steps import (
    StepRecord,
    check_generation_args,
    logit_comparison,
    policy_summary,
    step_comparison,
    step_record,
)


def default_policies(baseline: str = "fp16") -> list[str]:
    """Every registered preset except the baseline itself."""
    return [p for p in PRESETS if p != baseline]


#: the fields of a compare row, in its JSON order; a sweep's cell shown as a row has ``_CELL_FIELDS`` instead
_ROW_FIELDS = ("policy", "policy_string", "verdict", "verdicts", "first_divergence_indices", "memory_saved_pct",
               "bits_per_element", "token_match_ratio", "prefix_match_ratio", "top1_match_ratio", "kl_mean", "kl_max",
               "throughput_ratio", "saves", "break_even_tokens", "savings_note")
_CELL_FIELDS = ("policy", "row_key", "policy_string", "sweep_policy", "prompt", "verdict", "memory_saved_pct",
                "bits_per_element", "token_match_ratio", "prefix_match_ratio", "top1_match_ratio", "kl_mean",
                "throughput_ratio")


@dataclass
class CompareRow:
    """One policy of a comparison, its cells aggregated (or, with ``row_key``, one sweep cell shown as a row:
    ``SweepReport.as_compare_result``). ``to_dict()`` is its JSON row."""

    policy: str
    policy_string: str = ""
    verdict: str | None = None  # the worst over the prompts
    verdicts: list = field(default_factory=list)  # per prompt
    first_divergence_indices: list = field(default_factory=list)  # per prompt (None: identical)
    memory_saved_pct: float | None = None
    bits_per_element: float | None = None
    token_match_ratio: float | None = None
    prefix_match_ratio: float | None = None
    top1_match_ratio: float | None = None
    kl_mean: float | None = None
    kl_max: float | None = None
    throughput_ratio: float | None = None
    row_key: str | None = None  # a sweep cell's id (None: a compare row, keyed by its policy)
    sweep_policy: str | None = None  # a sweep cell's policy label
    prompt: str | None = None  # a sweep cell's prompt text
    #: fewer bytes than the baseline on every prompt's length (``cache.savings``); None: not known
    saves: bool | None = None
    break_even_tokens: int | None = None  # the length from which the policy saves (None: never, or not known)
    savings_note: str | None = None  # ``Savings.message`` of the longest prompt where it saves nothing

    @property
    def key(self) -> str:
        """The row's key in a table: the sweep cell's id, else the policy."""
        return self.row_key if self.row_key is not None else self.policy

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in (_ROW_FIELDS if self.row_key is None else _CELL_FIELDS)}

    @classmethod
    def from_dict(cls, d: dict) -> CompareRow:
        """A row from its JSON (a saved session's, or a sweep report's per-model row: other keys are ignored)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class _Run:
    result: object
    tokens: list[TokenGenerated]


@dataclass
class CompareResult:
    model: str
    baseline: str
    cache_mode: str
    baseline_mode: str
    prompts: list
    max_new_tokens: int
    quality_threshold: float
    storage_only: bool
    rows: list[CompareRow] = field(default_factory=list)  # one per policy
    cells: list[dict] = field(default_factory=list)  # one per (policy, prompt)
    recommendation: dict = field(default_factory=dict)
    baseline_texts: list[str] = field(default_factory=list)
    evidence: Evidence | None = None  # the sample behind the rows (prompts x generated tokens)
    threads: int | None = None  # torch's CPU threads, when a front end recorded them (the CLI does)

    def to_dict(self) -> dict:
        d = {
            "model": self.model, "baseline": self.baseline, "cache_mode": self.cache_mode,
            "baseline_mode": self.baseline_mode, "prompts": self.prompts, "max_new_tokens": self.max_new_tokens,
            "quality_threshold": self.quality_threshold, "storage_only": self.storage_only,
            "rows": [r.to_dict() for r in self.rows], "cells": self.cells, "recommendation": self.recommendation,
            "baseline_texts": self.baseline_texts,
            "evidence": self.evidence.to_dict() if self.evidence is not None else None,
        }
        if self.threads is not None:
            d["threads"] = self.threads
        return d

    @classmethod
    def from_dict(cls, d: dict) -> CompareResult:
        """The inverse of ``to_dict()`` (a saved session's comparison); a missing field raises KeyError."""
        return cls(model=d["model"], baseline=d["baseline"], cache_mode=d["cache_mode"],
                   baseline_mode=d["baseline_mode"], prompts=list(d["prompts"]),
                   max_new_tokens=d["max_new_tokens"], quality_threshold=d["quality_threshold"],
                   storage_only=d["storage_only"], rows=[CompareRow.from_dict(r) for r in d["rows"]], cells=list(d["cells"]),
                   recommendation=dict(d["recommendation"]), baseline_texts=list(d["baseline_texts"]),
                   evidence=Evidence.from_dict(d["evidence"]) if d.get("evidence") else None,
                   threads=d.get("threads"))


def _collect(stream, cancel: CancelFlag | None) -> _Run:
    tokens, result = [], None
    for ev in stream:
        if isinstance(ev, TokenGenerated):
            tokens.append(ev)
        elif isinstance(ev, GenerationFinished):
            result = ev.result
    raise_if_cancelled(cancel, "compare-policies")
    return _Run(result, tokens)


def _steps(base: _Run, cand: _Run) -> list[StepRecord]:
    def at(run: _Run, i: int) -> TokenGenerated | None:
        return run.tokens[i] if i < len(run.tokens) else None

    return [step_record(i, at(base, i), at(cand, i)) for i in range(max(len(base.tokens), len(cand.tokens)))]


def _cell(pol: CheckedPolicy, i: int, base: _Run, cand: _Run, quality_threshold: float, savings=None) -> dict:
    """One (policy, prompt) cell: the candidate run compared with the stored baseline, as ``validate`` does;
    ``savings``: its ``cache.savings.Savings`` at this prompt's length, when known."""
    steps = _steps(base, cand)
    comp = compare_tokens(base.result.token_ids, cand.result.token_ids)
    return {
        "policy": pol.label, "prompt_index": i, "verdict": decide_verdict(comp, quality_threshold),
        "comparison": comp.to_dict(), "step_comparison": step_comparison(steps).to_dict(),
        "logit_comparison": _dict_or_none(logit_comparison(steps, comp.first_divergence_index)),
        "policy_summary": policy_summary(base.result, cand.result).to_dict(), "text": cand.result.text,
        "savings": savings.to_dict() if savings is not None else None,
    }


def _parse_policies(policies: list[Policy | str]) -> list[Policy]:
    pols = [parse_policy(p) for p in policies]
    labels = [p.label for p in pols]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise ValueError(f"policy {dupes[0]!r} is listed twice: give each policy once")
    return pols


def recommend_policy(rows: list[CompareRow], baseline: str = "fp16", storage_only: bool = False,
                     evidence: Evidence | None = None) -> dict:
    """The seed's rule over compare rows (see the module docstring)."""
    exact = [r for r in rows if r.verdict == "exact-match" and r.saves is not False and (r.memory_saved_pct or 0) > 0]
    unsafe = [r.policy for r in rows if r.verdict == "diverged"]
    rec = {
        "rule": "the exact-match compressed policy with the highest saving; else keep the baseline",
        "exact_match_policies": [r.policy for r in exact],
        "unsafe_policies": unsafe,
        "storage_only": storage_only,
        "saves_nothing_policies": [{"policy": r.policy, "break_even_tokens": r.break_even_tokens,
                                    "note": r.savings_note} for r in rows if r.saves is False],
        "caveat": evidence.caveat if evidence is not None else None,
    }
    if storage_only:
        rec["note"] = "dense-shadow mode: attention read exact K/V, so verdicts say nothing about quality"
    if exact and not storage_only:
        best = max(exact, key=lambda r: r.memory_saved_pct)
        rec.update(recommended_policy=best.policy, memory_saved_pct=best.memory_saved_pct,
                   best_risky_policy=None, status="compressed-policy")
        return rec
    risky = [r for r in rows if r.verdict != "exact-match" and r.verdict != "diverged"] or \
        [r for r in rows if r.verdict != "exact-match"]
    best_risky = None
    if risky:
        best_risky = min(risky, key=lambda r: (VERDICTS.index(r.verdict), -(r.token_match_ratio or 0.0),
                                               r.kl_mean if r.kl_mean is not None else 0.0,
                                               -(r.memory_saved_pct or 0.0))).policy
    rec.update(recommended_policy=baseline, memory_saved_pct=0.0, best_risky_policy=best_risky,
               status="keep-baseline")
    return rec


def compare_policies(
    engine,
    policies: list[Policy | str],
    prompts: list,
    *,
    baseline: Policy | str = "fp16",
    cache_mode: str = "compressed",
    baseline_mode: str | None = None,
    max_new_tokens: int = 48,
    chat: bool = True,
    quality_threshold: float = DEFAULT_QUALITY_THRESHOLD,
    collect_logits: bool = True,
    on_event: OnEvent | None = None,
    cancel: CancelFlag | None = None,
) -> CompareResult:
    """Rows per policy and a recommendation; emits ``Progress`` per (policy, prompt) cell and ``CompareCell``.
    Raises ``Cancelled`` when ``cancel()`` turns true."""
    check_generation_args(max_new_tokens, quality_threshold)
    if not policies:
        raise ValueError("no policies to compare: give at least one")
    if not prompts:
        raise ValueError("no prompts to compare on: give at least one")
    base_pol = engine.check_policy(baseline)  # checked once: every cell's cache takes it as it is
    pols = [engine.check_policy(p) for p in _parse_policies(policies)]
    baseline_mode = baseline_mode or cache_mode
    ids = [engine.encode_prompt(p, chat, max_new_tokens) for p in prompts]
    try:
        geometry = engine.geometry
    except Exception:  # noqa: BLE001 - a config without the usual fields: savings not known, rows say None
        geometry = None
    total = len(pols) * len(prompts) + len(prompts)
    done = 0

    def progress(msg: str) -> None:
        emit(on_event, Progress("compare-policies", done, total, msg))

    kw = dict(max_new_tokens=max_new_tokens, collect_logits=collect_logits, cancel=cancel)
    bases = []
    for i, x in enumerate(ids):
        progress(f"baseline {base_pol.label} on prompt {i + 1}")
        bases.append(_collect(engine.stream(x, base_pol, baseline_mode, run="baseline", **kw), cancel))
        done += 1
    progress("baseline done")
    storage_only = "dense-shadow" in (cache_mode, baseline_mode)
    result = CompareResult(engine.name, base_pol.label, cache_mode, baseline_mode,
                           [p if isinstance(p, (str, list)) else None for p in prompts], max_new_tokens,
                           quality_threshold, storage_only, baseline_texts=[b.result.text for b in bases],
                           evidence=evidence([len(b.result.token_ids) for b in bases]))
    for pol in pols:
        cells = []
        for i, x in enumerate(ids):
            progress(f"{pol.label} on prompt {i + 1}")
            cand = _collect(engine.stream(x, pol, cache_mode, run="candidate", **kw), cancel)
            cell = _cell(pol, i, bases[i], cand, quality_threshold,
                         candidate_savings(engine, pol, base_pol, cand.result, geometry))
            cells.append(cell)
            done += 1
            logits = cell["logit_comparison"]
            emit(on_event, CompareCell(pol.label, i, cell["verdict"], cell["comparison"]["token_match_ratio"],
                                       logits["kl_mean"] if logits else None))
        result.cells.extend(cells)
        result.rows.append(_row(pol.policy, cells))
    progress("done")
    result.recommendation = recommend_policy(result.rows, base_pol.label, storage_only, result.evidence)
    return result


def _dict_or_none(section):
    return section.to_dict() if section is not None else None


def _row(pol: Policy, cells: list[dict]) -> CompareRow:
    def mean(xs):
        xs = [x for x in xs if x is not None]
        return round(sum(xs) / len(xs), 6) if xs else None

    return CompareRow(
        policy=pol.label,
        policy_string=pol.to_string(),
        verdict=worst_verdict([c["verdict"] for c in cells]),
        verdicts=[c["verdict"] for c in cells],
        first_divergence_indices=[c["comparison"]["first_divergence_index"] for c in cells],
        memory_saved_pct=mean([c["policy_summary"]["memory_saved_pct"] for c in cells]),
        bits_per_element=mean([c["policy_summary"]["bits_per_element"] for c in cells]),
        token_match_ratio=mean([c["comparison"]["token_match_ratio"] for c in cells]),
        prefix_match_ratio=mean([c["comparison"]["prefix_match_ratio"] for c in cells]),
        top1_match_ratio=mean([c["step_comparison"]["top1_match_ratio"] for c in cells]),
        kl_mean=mean([c["logit_comparison"]["kl_mean"] if c["logit_comparison"] else None for c in cells]),
        kl_max=max((c["logit_comparison"]["kl_max"] for c in cells if c["logit_comparison"]), default=None),
        throughput_ratio=mean([c["policy_summary"]["throughput_ratio"] for c in cells]),
        **_row_savings(cells),
    )


def _row_savings(cells: list[dict]) -> dict:
    """A row's ``saves`` (on every prompt), and where it saves nothing on some prompt, the longest such prompt's
    note and break-even (above every length that saved nothing)."""
    known = [c["savings"] for c in cells if c.get("savings")]
    if not known:
        return {}
    nothing = [s for s in sorted(known, key=lambda s: s["seq_len"]) if not s["saves"]]
    worst = nothing[-1] if nothing else known[0]
    return {"saves": not nothing, "break_even_tokens": worst["break_even_tokens"],
            "savings_note": worst["message"] if nothing else None}
