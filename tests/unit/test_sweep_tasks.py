"""The task suite as a sweep measurement (tiny model): a ``tasks`` text, scored by ``engine.tasks`` itself (the same
answers as ``run_tasks``), the baseline answered once per sweep, (dataset, model, method, compression_ratio, score)
rows in the report, and nothing kept per cell (the soak rule)."""

from __future__ import annotations

import json
import tracemalloc
from collections import Counter

import pytest

from tqbench.engine.sweep import SpecError, SweepDir, expand, parse_spec, run_sweep
from tqbench.engine.sweep.measure import CellRunner
from tqbench.engine.tasks import SUITE_VERSION, run_tasks

TASKS_TEXT = {"name": "ruler", "tasks": {"context": 1024, "samples": 1, "names": ["niah_single"]}}
SPEC = {"models": ["tiny"], "policies": ["turbo4", "turbo2,keep=0.5"], "texts": [TASKS_TEXT],
        "measure": ["tasks", "bytes"], "bytes": {"tokens": [1024]}, "threads": 1}


@pytest.mark.parametrize("text,message", [
    ({"context": 400}, "texts[0].tasks.context=400 is invalid: too short for niah_single, niah_multikey"),
    ({"context": 2048, "names": ["niah_single", "nope"]},
     "texts[0].tasks.names='niah_single,nope' is invalid: unknown task nope: choose from"),
    ({"context": 2048, "samples": 0}, "texts[0].tasks.samples=0 is invalid: give 1 to 64 samples per task"),
    ({"samples": 2}, "texts[0].tasks has no `context`: give the suite's context in tokens"),
    ({"context": 2048, "depth": 1}, "unknown key texts[0].tasks.depth: the keys allowed in texts[0].tasks are"),
    ({"context": "4k"}, "texts[0].tasks.context = '4k' is invalid: give a whole number of tokens"),
])
def test_tasks_text_errors_name_the_key(text, message):
    with pytest.raises(SpecError) as exc:
        parse_spec({**SPEC, "texts": [{"name": "ruler", "tasks": text}]})
    assert message in str(exc.value)


def test_a_tasks_text_needs_the_tasks_measurement_and_settings_are_checked():
    with pytest.raises(SpecError, match=r"texts\[0\] \('ruler'\) is a tasks text and `measure` has nothing for "
                                        r"it: add one of bytes, tasks"):
        parse_spec({**SPEC, "measure": ["validate"]})
    with pytest.raises(SpecError, match="unknown key tasks.samples: the keys allowed in tasks are cache, seed"):
        parse_spec({**SPEC, "tasks": {"samples": 3}})
    spec = parse_spec({**SPEC, "tasks": {"seed": 3, "cache": False}})
    cell = expand(spec)[0]
    assert cell.measure == ("tasks", "bytes")
    key = cell.key(spec)
    assert key["settings"]["tasks"] == {"seed": 3, "cache": False, "suite_version": SUITE_VERSION}
    assert key["text"] == {"name": "ruler", "kind": "tasks", "tasks_context": 1024, "tasks_samples": 1,
                           "tasks_names": ["niah_single"]}  # as JSON gives it back, so --resume matches


def _count_streams(engine, monkeypatch) -> Counter:
    calls = Counter()
    stream = engine.stream

    def counted(ids, policy, *a, **k):
        calls[engine.check_policy(policy).label] += 1
        return stream(ids, policy, *a, **k)

    monkeypatch.setattr(engine, "stream", counted)
    return calls


def test_sweep_scores_every_cell_with_the_suite_and_answers_the_baseline_once(tiny_engine, tmp_path, monkeypatch):
    monkeypatch.setenv("TQBENCH_CACHE_DIR", str(tmp_path / "cache"))
    spec = parse_spec({**SPEC, "texts": [TASKS_TEXT, {**TASKS_TEXT, "name": "ruler2",
                                                      "tasks": {**TASKS_TEXT["tasks"], "names": ["niah_multikey"]}}]})
    with monkeypatch.context() as m:
        calls = _count_streams(tiny_engine, m)
        report = run_sweep(spec, tmp_path / "out", engines={"tiny": tiny_engine})
    assert not report.failed and not report.missing and len(report.cells) == 4
    # one baseline answer per sample of each text (2), whatever the number of cells; one per cell for candidates
    assert calls == Counter({"fp16": 2, "turbo4": 2, "k=turbo2,v=turbo2,sink=4,recent=16,keep=0.5": 2})
    store = SweepDir(tmp_path / "out")
    for c in expand(spec):
        t = store.read_cell(c.cell_id)["results"]["tasks"]
        # the engine's own suite: the same answers and scores as `tqbench --headless tasks`
        alone = run_tasks(tiny_engine, c.policy.policy, 1024, tasks=list(c.text.tasks_names), samples=1,
                          cache=False).to_dict()
        assert t["samples"] == alone["samples"] and t["tasks"] == alone["tasks"]
        assert t["dataset"] == "tqbench-ruler-1024" and t["candidate"] == c.policy.label
        assert store.read_cell(c.cell_id)["results"]["bytes"]["estimates"][0]["seq_len"] == 1024
    # the report: (dataset, model, method, compression_ratio, score) rows, the baseline's once per task
    board = report.leaderboard
    assert all({"dataset", "model", "method", "compression_ratio", "score", "task", "samples"} <= set(r)
               for r in board)
    assert Counter((r["task"], r["method"]) for r in board)[("overall", "fp16")] == 1
    assert sorted(r["method"] for r in board if r["task"] == "niah_single") == [
        "fp16", "k=turbo2,v=turbo2,sink=4,recent=16,keep=0.5", "turbo4"]
    cand = [r for r in board if r["method"] == "turbo4" and r["task"] == "overall"]
    assert len(cand) == 2 and all(0.6 < r["compression_ratio"] < 0.75 and r["cell_id"] for r in cand)
    rows = {r["policy"]: r for r in report.models[0]["rows"]}
    cells = [store.read_cell(c.cell_id)["results"]["tasks"] for c in expand(spec) if c.policy.label == "turbo4"]
    assert rows["turbo4"]["tasks_score"] == pytest.approx(sum(t["overall"]["candidate_score"] for t in cells) / 2)
    assert rows["turbo4"]["tasks_delta"] == pytest.approx(sum(t["overall"]["delta"] for t in cells) / 2)
    assert json.loads((tmp_path / "out" / "report.json").read_text())["leaderboard"] == board
    # the baseline's answers are in the suite's cache: a second sweep (another folder) answers no baseline
    with monkeypatch.context() as m:
        calls = _count_streams(tiny_engine, m)
        again = run_sweep(spec, tmp_path / "again", engines={"tiny": tiny_engine})
    assert calls["fp16"] == 0 and all(c["results"]["tasks"]["baseline_cached"] == 1 for c in again.cells)


def test_soak_nothing_grows_with_the_number_of_cells(tiny_engine, tmp_path, monkeypatch):
    """Many cells through one runner, as a long sweep runs them: no cell's result outlives the cell (weak references
    to every ``TasksResult`` are dead after it), the heap the sweep and suite code allocate themselves (tracemalloc,
    by allocating line) is the same after the last cell as after the warm-up, the runner keeps one prepared suite
    for the text, and the baseline's cache holds one answer per sample, not per cell."""
    import gc
    import weakref

    import tqbench.engine.tasks as tasks_pkg

    monkeypatch.setenv("TQBENCH_CACHE_DIR", str(tmp_path / "cache"))
    spec = parse_spec({**SPEC, "measure": ["tasks"]})
    cells = expand(spec)
    calls = _count_streams(tiny_engine, monkeypatch)
    results = []
    score = tasks_pkg.score_candidate

    def kept(*a, **k):
        res = score(*a, **k)
        results.append(weakref.ref(res))
        return res

    monkeypatch.setattr(tasks_pkg, "score_candidate", kept)
    runner = CellRunner(tiny_engine, spec)
    ours = [tracemalloc.Filter(True, f"*/tqbench/engine/{room}/*") for room in ("sweep", "tasks")]
    n, warmup = 12, 4
    tracemalloc.start()
    try:
        sizes = []
        for i in range(n):
            runner.run(cells[i % 2])
            if i in (warmup, n - 1):
                gc.collect()
                sizes.append(sum(t.size for t in tracemalloc.take_snapshot().filter_traces(ours).traces))
    finally:
        tracemalloc.stop()
    assert len(results) == n and all(r() is None for r in results)
    assert sizes[1] <= sizes[0], sizes
    assert list(runner._tasks) == ["ruler"] and calls["fp16"] == 1
    cache = list((tmp_path / "cache" / "tasks").iterdir())
    assert len(cache) == 1 and len(json.loads(cache[0].read_text())) == 1
