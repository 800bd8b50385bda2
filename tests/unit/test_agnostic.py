"""The query-agnostic protocol: ``Engine.compress`` (a context compressed once, before any question), questions
appended to copies of it, and ``tasks --protocol``; the 95% interval beside each task score."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tqbench.cli.group import main
from tqbench.engine.tasks import TASKS, build_samples, check_protocols, interval95, run_tasks
from tqbench.engine.tasks.generate import question_start

PROMPT = "the quick brown fox jumps over the lazy dog and keeps running far away " * 3


def test_compress_once_answer_many_and_evict_only_at_the_context_end(tiny_engine64):
    e = tiny_engine64
    ids = e.encode_prompt(PROMPT, chat=False)
    ctx_ids, q1, q2 = ids[:, :150], ids[:, 150:160], ids[:, 160:]
    ctx = e.compress(ctx_ids, "turbo4,keep=0.5,score=snapkv,window=8", "fused")
    before = ctx.report()
    calls = {"n": 0}
    hook = e.model.register_forward_pre_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
    try:
        a = ctx.generate(q1, max_new_tokens=6, stop_at_eos=False)
        b = ctx.generate(q2, max_new_tokens=6, stop_at_eos=False)
        a2 = ctx.generate(q1, max_new_tokens=6, stop_at_eos=False)
    finally:
        hook.remove()
    assert calls["n"] == 3 * 6  # the question's call + 5 decode calls each: the context is never prefilled again
    assert a.token_ids == a2.token_ids and a.token_ids != b.token_ids
    assert ctx.report().tokens == before.tokens == 150  # the compressed context is untouched by its questions
    for la in ctx.cache.layers:  # one eviction, at the end of the context
        assert la.evictor.points == 1 and int(la.evictor.positions.view().max()) == 149
    # the question and answer rows are appended to the compressed context, never evicted
    rep = a.cache_report
    assert rep.tokens == 150 + 10 + 5
    assert rep.fused_impl == {"native-cpu": rep.fused_calls}
    # no eviction: the agnostic split changes nothing (float64: the same tokens as one prefill)
    plain = e.compress(ctx_ids, "turbo4", "compressed").generate(q1, max_new_tokens=6, stop_at_eos=False)
    assert plain.token_ids == e.generate(ids[:, :160], "turbo4", "compressed", max_new_tokens=6,
                                         stop_at_eos=False, prefill_chunk=150).token_ids


def test_agnostic_scores_differ_from_aware_when_the_question_matters(tiny_engine):
    """The aware run's eviction sees the question's queries; the agnostic one does not (different kept rows)."""
    ids = tiny_engine.encode_prompt(PROMPT, chat=False)
    aware_cache_rows = tiny_engine.generate(ids, "turbo4,keep=0.3,score=snapkv,window=8", max_new_tokens=1,
                                            track_kept=True, stop_at_eos=False)
    ctx = tiny_engine.compress(ids[:, :150], "turbo4,keep=0.3,score=snapkv,window=8")
    agn = ctx.generate(ids[:, 150:], max_new_tokens=1, stop_at_eos=False)
    assert agn.cache_report.tokens == aware_cache_rows.cache_report.tokens
    assert agn.cache_report.compressed_storage_bytes > aware_cache_rows.cache_report.compressed_storage_bytes


def test_question_start_splits_before_the_asking_line(tiny_engine):
    for s in build_samples(tiny_engine, [TASKS[n] for n in ("niah_single", "variable_tracking")], 1024, 1, 0):
        cut = question_start(tiny_engine, s)
        head = tiny_engine.tokenizer.decode(s.ids[0, :cut])
        tail = tiny_engine.tokenizer.decode(s.ids[0, cut:])
        asked = s.text[s.text.rfind("\n") + 1 :]
        assert asked not in head and asked in tail and tail.endswith(s.answer_prefix)
        assert len(tail) < len(asked) + len(s.answer_prefix) + 80  # only the asking line and the template's turn


def test_protocols_and_interval_rules():
    assert check_protocols("both") == ("agnostic", "aware") == check_protocols("aware,agnostic")
    assert check_protocols(["aware"]) == ("aware",)
    with pytest.raises(ValueError, match="give agnostic .* aware .* or both"):
        check_protocols("blind")
    assert interval95([1, 1, 1]) == (43.85, 100.0)
    assert interval95([0] * 3) == (0.0, 56.15)
    lo, hi = interval95([1] * 50 + [0] * 50)
    assert (lo, hi) == (40.38, 59.62)
    assert interval95([]) == (0.0, 100.0)


def test_run_tasks_both_protocols_rows_name_theirs(tiny_engine, tmp_path):
    res = run_tasks(tiny_engine, "turbo4,keep=0.5", 1024, tasks=["niah_single"], samples=1, cache_folder=tmp_path,
                    protocols=("agnostic", "aware"))
    d = res.to_dict()
    assert d["protocols"] == ["agnostic", "aware"]
    assert [(t["task"], t["protocol"]) for t in d["tasks"]] == [("niah_single", "agnostic"), ("niah_single", "aware")]
    assert {r["protocol"] for r in d["leaderboard"]} == {"agnostic", "aware"} and len(d["leaderboard"]) == 8
    assert all(len(r["ci95"]) == 2 for r in d["leaderboard"])
    agn, aw = d["samples"]
    assert agn["protocol"] == "agnostic" and agn["context_tokens"] < aw["context_tokens"] == aw["prompt_tokens"]
    assert agn["baseline_answer"] == aw["baseline_answer"]  # one baseline answer per sample


def test_cli_must_show_shape_on_the_tiny_model(tmp_path, monkeypatch):
    """``tasks --protocol agnostic --candidate turbo4,keep=0.5,score=kvzip --json``: exit 0, every row's protocol."""
    monkeypatch.setenv("TQBENCH_CACHE_DIR", str(tmp_path))
    r = CliRunner().invoke(main, ["--headless", "tasks", "--model", "tiny", "--context", "1024", "--tasks",
                                  "niah_single", "--samples", "1", "--protocol", "agnostic", "--candidate",
                                  "turbo4,keep=0.5,score=kvzip", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output[r.output.index("{"):])
    assert d["protocols"] == ["agnostic"]
    assert all(row["protocol"] == "agnostic" for row in [*d["tasks"], *d["leaderboard"], d["overall"]])
    assert d["samples"][0]["candidate_context_pass_seconds"] > 0
    # the docs' table script reads it back: one row, the protocol's
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "tasks_protocols_table.py"
    spec = importlib.util.spec_from_file_location("tasks_protocols_table", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    (tmp_path / "r.json").write_text(r.output)
    (row,) = mod.rows_of(tmp_path / "r.json")
    assert row["protocol"] == "agnostic" and row["samples"] == 1 and row["context_pass_seconds_mean"] >= 0
