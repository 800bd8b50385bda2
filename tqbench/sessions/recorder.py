"""Records from the engine: a ``RunRecord`` from the events of a run (any front end), from a typed
``ValidationReport``, and the per-token texts a version-1 session lacks, rebuilt with the model's tokenizer.

The engine's modules that import torch are imported inside the functions that need them, so importing
``tqbench.sessions`` stays light (the workbench paints before torch has loaded).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tqbench.engine.events import (
    CacheBytes,
    GenerationFinished,
    GenerationStarted,
    PairStep,
    PrefillDone,
    TokenGenerated,
)
from tqbench.sessions.schema import RunRecord, RunSide

if TYPE_CHECKING:
    from tqbench.engine.validate import ValidationReport


class RunRecorder:
    """Builds a ``RunRecord`` from the events of ``Engine.lockstep`` / ``Engine.stream`` (any front end)."""

    def __init__(self, prompt: str, chat: bool, max_new_tokens: int, sampling: dict, kind: str = "lockstep") -> None:
        self.record = RunRecord(prompt, chat, max_new_tokens, dict(sampling), candidate=RunSide("", "", ""), kind=kind)
        self._sides: dict[str, RunSide] = {}

    def side(self, run: str) -> RunSide | None:
        return self._sides.get(run)

    def __call__(self, ev: object) -> None:
        rec = self.record
        if isinstance(ev, GenerationStarted):
            side = RunSide(ev.kv_policy, _compact_form(ev.kv_policy), ev.cache_mode, ev.input_tokens)
            self._sides[ev.run] = side
            if ev.run == "baseline":
                rec.baseline = side
            else:
                rec.candidate = side
        elif isinstance(ev, PrefillDone):
            self._sides[ev.run].prefill_seconds = ev.seconds
        elif isinstance(ev, PairStep):
            for tok in (ev.baseline, ev.candidate):
                if tok is not None:
                    self._token(tok)
            rec.same_token.append(bool(ev.same_token))
            rec.same_top1.append(bool(ev.same_top1))
            rec.kl.append(None if ev.kl is None else float(ev.kl))
        elif isinstance(ev, CacheBytes):
            side = self._sides[ev.run]
            side.resident_bytes.append(ev.resident_bytes)
            side.storage_bytes.append(ev.storage_bytes)
        elif isinstance(ev, GenerationFinished):
            self._finished(self._sides[ev.run], ev.result)
        elif isinstance(ev, TokenGenerated):  # a single stream (no PairStep)
            self._token(ev)

    def _token(self, tok: TokenGenerated) -> None:
        side = self._sides[tok.run]
        if len(side.step_seconds) <= tok.step:
            side.token_ids.append(tok.token_id)
            side.token_texts.append(tok.text_delta)
            side.step_seconds.append(float(tok.step_seconds))

    @staticmethod
    def _finished(side: RunSide, result) -> None:
        side.text = result.text
        side.stopped_by = result.stopped_by
        side.token_ids = list(result.token_ids)
        if not side.has_token_texts:  # the streamed pieces do not cover the result: rebuilt when opened
            side.token_texts = []
        side.cache_report = result.cache_report.to_dict() if result.cache_report is not None else None


def _compact_form(policy: str) -> str:
    from tqbench.engine.policy import parse_policy

    try:
        return parse_policy(policy).to_string()
    except ValueError:
        return policy


def record_from_validation(report: ValidationReport) -> RunRecord | None:
    """The lockstep run of a ``ValidationReport`` as a ``RunRecord`` (None for a teacher-forced report)."""
    from tqbench.engine.validate import ValidationReport

    if not isinstance(report, ValidationReport):
        return None
    steps = report.per_step or []

    def side(name: str, label: str, pstr: str, mode: str, cache_report) -> RunSide:
        ids = list(report.token_ids.of(name))
        texts = [getattr(s, f"{name}_text") for s in steps if getattr(s, f"{name}_token") is not None]
        return RunSide(label, pstr, mode, token_ids=ids, text=report.texts.of(name), stopped_by="",
                       cache_report=cache_report.to_dict() if cache_report is not None else None,
                       step_seconds=[float(getattr(s, f"{name}_seconds") or 0.0) for s in steps],
                       token_texts=texts if len(texts) == len(ids) else [])

    prompt = report.prompt
    if isinstance(prompt, list):
        prompt = "\n".join(str(m.get("content", "")) for m in prompt)
    rec = RunRecord(
        prompt or "", bool(report.chat), int(report.max_new_tokens), dict(report.sampling or {}),
        candidate=side("candidate", report.candidate, report.candidate_policy, report.cache_mode,
                       report.candidate_cache_report),
        baseline=side("baseline", report.baseline, report.baseline_policy, report.baseline_mode,
                      report.baseline_cache_report),
        kind="validate",
    )
    if steps:
        rec.same_token = [s.same_token for s in steps]
        rec.same_top1 = [s.same_top1 for s in steps]
        rec.kl = [s.kl for s in steps]
    else:
        b, c = rec.baseline.token_ids, rec.candidate.token_ids
        rec.same_token = [i < len(c) and b[i] == c[i] for i in range(len(b))]
        rec.same_top1 = list(rec.same_token)
        rec.kl = [None] * len(b)
    return rec


def restore_token_texts(runs: list[RunRecord], tokenizer) -> int:
    """Give every side without per-token texts (a version-1 session) the pieces the engine's streaming
    detokenizer produces for its ids; returns how many sides were rebuilt."""
    from tqbench.engine.generate import TextStreamer

    rebuilt = 0
    for rec in runs:
        for side in rec.sides:
            if side.has_token_texts:
                continue
            st, ids = TextStreamer(tokenizer), side.token_ids
            side.token_texts = [st.push(t, final=(k == len(ids) - 1)) for k, t in enumerate(ids)]
            rebuilt += 1
    return rebuilt
