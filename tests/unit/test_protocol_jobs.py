"""One progress protocol and one cancel protocol: every long job of validate/ and scan/ takes ``on_event=`` and
``cancel=``, passes event dataclasses to the callback, and raises ``Cancelled`` (returning nothing) once the flag
is set; generation itself ends with a partial result (``stopped_by="cancelled"``)."""

from __future__ import annotations

import dataclasses

import pytest

from tqbench.engine import events as E
from tqbench.engine.events import Cancelled, TeacherForcedStep
from tqbench.engine.scan import capture_qkv, scan
from tqbench.engine.validate import (
    baseline_logprobs,
    compare_policies,
    corpus_ids,
    needle_in_haystack,
    self_test,
    teacher_forced,
    teacher_forced_quality,
    validate,
)

PROMPT = "The lighthouse keeper wrote"
TEXT = "The river rose in the night and the ferry stayed on the far bank until the water fell again. " * 2


def _ids(engine):
    return corpus_ids(engine.tokenizer, "bread", 24)


JOBS = {
    "validate": lambda e, **kw: validate(e, PROMPT, "fp16", "turbo2", max_new_tokens=4, **kw),
    "self_test": lambda e, **kw: self_test(e, PROMPT, max_new_tokens=4, **kw),
    "compare_policies": lambda e, **kw: compare_policies(e, ["turbo2"], [PROMPT], max_new_tokens=4, **kw),
    "teacher_forced_quality": lambda e, **kw: teacher_forced_quality(e, "turbo2", corpus="bread", context_tokens=16,
                                                                     eval_tokens=4, **kw),
    "teacher_forced_quality(prompt)": lambda e, **kw: teacher_forced_quality(e, "turbo2", prompt=PROMPT,
                                                                             max_new_tokens=4, **kw),
    "baseline_logprobs": lambda e, **kw: baseline_logprobs(e, _ids(e), 16, **kw),
    "teacher_forced": lambda e, **kw: teacher_forced(e, _ids(e), 16, "turbo2", **kw),
    "needle_in_haystack": lambda e, **kw: needle_in_haystack(e, ["turbo2"], [32], [0.5], max_new_tokens=2, **kw),
    "scan": lambda e, **kw: scan(e, TEXT, layers="0,-1", codecs=["int8", "turbo2"], max_prompt_tokens=32, **kw),
    "capture_qkv": lambda e, **kw: capture_qkv(e, TEXT, layers=[0], max_prompt_tokens=24, generated_tokens=2, **kw),
}
#: what each job returns, the events it passes on before it sees a cancel set after its first event, and the
#: message of its ``Cancelled`` (validate's two generations each end, partial, before validation raises)
RESULTS = {"validate": "ValidationReport", "self_test": "ValidationReport", "compare_policies": "CompareResult",
           "teacher_forced_quality": "TeacherForcedReport", "teacher_forced_quality(prompt)": "TeacherForcedReport",
           "baseline_logprobs": "list", "teacher_forced": "TeacherForcedResult", "needle_in_haystack": "NiahResult",
           "scan": "ScanResult", "capture_qkv": "Capture"}
_GEN = ["GenerationStarted", "PrefillDone", "GenerationFinished"]
BEFORE_CANCEL = {"validate": (_GEN * 2, "validation cancelled"), "self_test": (_GEN * 2, "validation cancelled"),
                 "compare_policies": (["Progress"], "compare-policies cancelled"),
                 "teacher_forced_quality": (["TeacherForcedStep"], "teacher-forced quality cancelled"),
                 "teacher_forced_quality(prompt)": (["TeacherForcedStep"], "teacher-forced quality cancelled"),
                 "baseline_logprobs": (["TeacherForcedStep"], "teacher-forced quality cancelled"),
                 "teacher_forced": (["TeacherForcedStep"], "teacher-forced quality cancelled"),
                 "needle_in_haystack": (["Progress"], "niah cancelled"),
                 "scan": (["Progress"], "capture cancelled")}
EVENT_TYPES = tuple(v for v in vars(E).values() if isinstance(v, type) and dataclasses.is_dataclass(v))


@pytest.mark.parametrize("job", list(JOBS))
def test_every_long_job_takes_on_event_and_cancel(tiny_engine, job):
    events = []
    result = JOBS[job](tiny_engine, on_event=events.append, cancel=lambda: False)
    assert type(result).__name__ == RESULTS[job]
    assert events and all(isinstance(ev, EVENT_TYPES) for ev in events), events[:3]
    with pytest.raises(Cancelled, match="cancelled"):
        JOBS[job](tiny_engine, on_event=events.append, cancel=lambda: True)


@pytest.mark.parametrize("job", [j for j in JOBS if j != "capture_qkv"])  # capture emits only when done
def test_a_job_cancelled_after_its_first_event_raises(tiny_engine, job):
    events = []
    kinds, message = BEFORE_CANCEL[job]
    with pytest.raises(Cancelled, match=message):
        JOBS[job](tiny_engine, on_event=events.append, cancel=lambda: bool(events))
    assert [type(ev).__name__ for ev in events] == kinds
    finished = [ev.result.stopped_by for ev in events if isinstance(ev, E.GenerationFinished)]
    assert finished == ["cancelled"] * len(finished)


@pytest.mark.parametrize("after", [1, 3, 6])
def test_teacher_forced_quality_cancels_mid_way(tiny_engine, after):
    steps = []

    def on_event(ev):
        if isinstance(ev, TeacherForcedStep):
            steps.append(ev)

    got = None
    with pytest.raises(Cancelled, match="teacher-forced quality cancelled"):
        got = teacher_forced_quality(tiny_engine, ["fp16", "turbo2"], corpus="bread", context_tokens=16,
                                     eval_tokens=4, on_event=on_event, cancel=lambda: len(steps) >= after)
    assert got is None and len(steps) == after
    # baseline first (4 steps), then the first candidate: the cancel stops the run it lands in
    assert [s.task for s in steps] == (["baseline"] * 4 + ["candidate"] * 4)[:after]
    assert steps[-1].done == (after - 1) % 4 + 1 and steps[-1].total == 4
    assert steps[0].kv_policy == "dynamic-cache" and isinstance(steps[0], E.Progress)  # a progress bar draws it


def test_generation_returns_partial_when_cancelled(tiny_engine):
    calls = {"n": 0}

    def cancel():
        calls["n"] += 1
        return calls["n"] > 3

    r = tiny_engine.generate(PROMPT, "turbo2", max_new_tokens=20, stop_at_eos=False, cancel=cancel)
    assert r.stopped_by == "cancelled" and len(r.token_ids) == 3
