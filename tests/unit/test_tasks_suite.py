"""The long-context task suite (``engine.tasks``) on the tiny model: samples, scoring, the baseline cache, the CLI's
bad-input messages. The default model's run is in tests/integration/test_tasks_default.py."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from tqbench.cli.group import main
from tqbench.engine.tasks import (
    TASKS,
    build_samples,
    check_tasks,
    run_tasks,
    string_match_all,
    string_match_part,
)
from tqbench.engine.tasks.generate import FIT_SLACK, qa_paragraphs
from tqbench.engine.tasks.suite import TasksResult

NEEDLES = ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking", "common_words")


def test_samples_are_deterministic_fit_the_context_and_hold_their_answers(tiny_engine):
    specs = [TASKS[n] for n in (*NEEDLES, "qa")]
    a = build_samples(tiny_engine, specs, 2048, 2, seed=0)
    b = build_samples(tiny_engine, specs, 2048, 2, seed=0)
    assert [s.ids.tolist() for s in a] == [s.ids.tolist() for s in b]  # same arguments, same tokens
    c = build_samples(tiny_engine, specs[:1], 2048, 1, seed=1)
    assert c[0].references != a[0].references
    for s in a:
        task = TASKS[s.task]
        budget = 2048 - task.max_new_tokens
        assert s.prompt_tokens <= budget, s.task
        # filled to within one filler unit (the tiny tokenizer's tokens are bytes: a corpus sentence is ~150 of
        # them); QA documents are whole paragraphs
        assert s.prompt_tokens >= budget - (1200 if s.task == "qa" else FIT_SLACK + 200), (s.task, s.prompt_tokens)
        decoded = tiny_engine.tokenizer.decode(s.ids[0])
        assert decoded.endswith(s.answer_prefix) and s.answer_prefix not in s.text
        for ref in s.references:
            assert ref.lower() in s.text.lower(), (s.task, ref)
    by = {(s.task, s.index): s for s in a}
    # multi-key: 4 needles, only the first is asked; multi-value: both values under the one key
    assert len(re.findall(r"special magic numbers for \w+ is: \d{7}", by["niah_multikey", 0].text)) == 4
    mv = by["niah_multivalue", 1]
    key = re.search(r"numbers for (\w+) mentioned", mv.answer_prefix).group(1)
    assert re.findall(rf"numbers for {key} is: (\d{{7}})", mv.text) == list(mv.references)
    # variable tracking: a chain of 3, the first holds the value
    vt = by["variable_tracking", 0]
    first, second, third = vt.references
    assert f"VAR {second} = VAR {first}." in vt.text and f"VAR {third} = VAR {second}." in vt.text
    # common words: each answer word 30 times in the list, every other word once
    cw = by["common_words", 0]
    listing = re.findall(r"\d+\. ([a-z]+)", cw.text)
    counts = {w: listing.count(w) for w in set(listing)}
    assert all(counts[w] == 30 for w in cw.references)
    assert sorted(counts.values())[-4] == 1
    # QA: the gold paragraph is one of the documents; the evenly spread depth moves it
    qa0, qa1 = by["qa", 0], by["qa", 1]
    assert qa0.references == ("gluten",) and qa1.references == ("carbon dioxide",)
    assert any(p in qa0.text for p in qa_paragraphs() if "elastic material called gluten" in p)


def test_string_match_metrics_are_rulers():
    assert string_match_all("The numbers are 1234567 and 7654321.", ("1234567", "7654321")) == 1.0
    assert string_match_all("just 7654321", ("1234567", "7654321")) == 0.5
    assert string_match_all("ABCDE", ("abcde",)) == 1.0  # case-insensitive
    assert string_match_part("It is an Oxbow lake", ("oxbow", "billabong")) == 1.0
    assert string_match_part("a lake", ("oxbow", "billabong")) == 0.0


def _sample(task, index, base, cand, refs, base_answer="x", cand_answer="x", base_cr=0.0, cand_cr=0.75):
    return {"task": task, "index": index, "prompt_tokens": 100, "references": refs, "baseline_answer": base_answer,
            "candidate_answer": cand_answer, "baseline_score": base, "candidate_score": cand,
            "agree": base_answer.strip() == cand_answer.strip(), "baseline_compression_ratio": base_cr,
            "candidate_compression_ratio": cand_cr}


def test_scores_of_a_hand_made_answer_set():
    res = TasksResult("m", 2048, 0, "fp16", "turbo4", "compressed", 2, ["niah_single", "niah_multivalue"])
    res.samples = [
        _sample("niah_single", 0, 1.0, 1.0, ["1"], "1", "1"),
        _sample("niah_single", 1, 1.0, 0.0, ["2"], "2", "3", cand_cr=0.5),
        _sample("niah_multivalue", 0, 1.0, 0.5, ["1", "2"], "1 2", "1"),
        _sample("niah_multivalue", 1, 0.5, 0.5, ["3", "4"], "3", "3"),
    ]
    d = json.loads(json.dumps(res.to_dict()))
    single, multi = d["tasks"]
    assert single == {"task": "niah_single", "protocol": "aware", "samples": 2, "chance": 0.0,
                      "baseline_score": 100.0, "candidate_score": 50.0, "agreement": 50.0, "delta": -50.0,
                      "baseline_ci": [34.24, 100.0], "candidate_ci": [9.45, 90.55]}  # Wilson, 95%
    assert multi["baseline_score"] == 75.0 and multi["candidate_score"] == 50.0 and multi["agreement"] == 50.0
    assert d["overall"]["baseline_score"] == 87.5 and d["overall"]["candidate_score"] == 50.0
    assert d["overall"]["delta"] == -37.5 and d["overall"]["samples"] == 4
    board = {(r["task"], r["method"]): r for r in d["leaderboard"]}
    assert board["niah_single", "turbo4"] == {"dataset": "tqbench-ruler-2048", "task": "niah_single",
                                              "protocol": "aware", "model": "m", "method": "turbo4",
                                              "compression_ratio": 0.625, "score": 50.0, "ci95": [9.45, 90.55],
                                              "samples": 2}
    assert board["overall", "fp16"]["score"] == 87.5 and board["overall", "turbo4"]["compression_ratio"] == 0.6875


def test_run_caches_the_baseline_and_scores_both_sides(tiny_engine, tmp_path):
    kw = dict(tasks=["niah_single"], samples=1, cache_folder=tmp_path)
    first = run_tasks(tiny_engine, "turbo2", 1024, **kw)
    second = run_tasks(tiny_engine, "turbo4", 1024, **kw)
    assert first.baseline_cached == 0 and second.baseline_cached == 1
    assert second.samples[0]["baseline_answer"] == first.samples[0]["baseline_answer"]
    assert len(list(tmp_path.iterdir())) == 1
    again = run_tasks(tiny_engine, "turbo4", 1024, cache=False, **{k: v for k, v in kw.items() if k != "cache_folder"})
    assert again.baseline_cached == 0 and again.samples[0]["baseline_answer"] == first.samples[0]["baseline_answer"]
    s = second.samples[0]
    assert s["prompt_tokens"] <= 1024 - TASKS["niah_single"].max_new_tokens
    assert s["baseline_compression_ratio"] < 0.01 < s["candidate_compression_ratio"]  # fp16 stores what it holds
    row = second.to_dict()["leaderboard"][1]
    assert row["method"] == "turbo4" and 0.6 < row["compression_ratio"] < 0.75  # 4-bit codes + fp16 sinks/window


@pytest.mark.parametrize("args, message", [
    (["--tasks", "niah_single,nope"], "--tasks='niah_single,nope' is invalid: unknown task nope: choose from"),
    (["--context", "800", "--tasks", "qa"], "--context=800 is invalid: too short for qa: give at least 1024 tokens"),
    (["--context", "400"], "--context=400 is invalid: too short for niah_single, niah_multikey, niah_multivalue"),
    (["--context", "9000"], "--context=9000 is invalid: above SmolLM2-135M's maximum of 8192 tokens"),
    (["--samples", "0"], "--samples=0 is invalid: give 1 to 64 samples per task"),
    (["--candidate", "nope4"], "unknown policy preset 'nope4'"),
    (["--max-drop", "-1"], "--max-drop -1 is invalid"),
])
def test_bad_input_is_one_line_and_exit_2_before_the_model_loads(monkeypatch, args, message):
    import tqbench.cli.render.console as console

    monkeypatch.setattr(console, "load_engine", lambda *a, **k: pytest.fail("the model loaded"))
    r = CliRunner().invoke(main, ["--headless", "tasks", *args])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and message in r.output, r.output


def test_check_tasks_names_every_rule():
    assert [t.name for t in check_tasks(None, 2048, 4)] == ["niah_single", "niah_multikey", "niah_multivalue"]
    # from 4K the default model is at chance on niah_multikey (docs/validation.md): out of the default set there
    assert [t.name for t in check_tasks(None, 4096, 3)] == ["niah_single", "niah_multivalue"]
    assert [t.name for t in check_tasks(["niah_multikey"], 8192, 1)] == ["niah_multikey"]  # named: it runs
    assert [t.name for t in check_tasks(["qa"], 1024, 1)] == ["qa"]
    with pytest.raises(ValueError, match="too short for niah_single, qa: give at least 1024"):
        check_tasks(["niah_single", "qa"], 256, 1)
    with pytest.raises(ValueError, match="above tiny's maximum of 4096 tokens: give at most 4096"):
        check_tasks(None, 8192, 1, 4096, "tiny")


def test_cli_json_on_the_tiny_model(tmp_path, monkeypatch):
    monkeypatch.setenv("TQBENCH_CACHE_DIR", str(tmp_path))
    report = tmp_path / "r.json"
    r = CliRunner().invoke(main, ["--headless", "tasks", "--model", "tiny", "--context", "1024", "--tasks",
                                  "niah_single,niah_multikey", "--samples", "1", "--candidate",
                                  "k=turbo4,v=turbo3,sink=4,recent=16", "--json", "--report-json", str(report)])
    assert r.exit_code == 0, r.output
    d = json.loads(report.read_text())
    assert d["candidate"] == "k=turbo4,v=turbo3,sink=4,recent=16" or "turbo4" in d["candidate"]
    # both protocols by default, each its rows (agnostic first, as kvpress's leaderboard reports it)
    assert [(t["task"], t["protocol"]) for t in d["tasks"]] == [
        ("niah_single", "agnostic"), ("niah_multikey", "agnostic"), ("niah_single", "aware"),
        ("niah_multikey", "aware")] and d["context"] == 1024
    assert {r["method"] for r in d["leaderboard"]} == {d["baseline"], d["candidate"]}
    assert (tmp_path / "tasks").is_dir()  # the baseline's answers were cached under TQBENCH_CACHE_DIR
