"""``tasks --peer kvpress``: the runner's JSON protocol (in process, a fake kvpress module: kvpress is never
installed in the test venv), the client's subprocess protocol against a fake peer, the merge of the peer's rows
into the same table and leaderboard files, and the one-line error when the peer's environment is absent."""

from __future__ import annotations

import csv
import json
import sys
import types

import pytest
from click.testing import CliRunner

from tqbench.cli.group import main
from tqbench.engine.tasks.peer import (
    PRESSES,
    PeerError,
    PeerMissingError,
    check_presses,
    check_ratios,
    peer_python,
    run_peer,
    score_peer,
    side_by_side,
    write_leaderboard,
)
from tqbench.engine.tasks.peer import kvpress_runner as runner
from tqbench.engine.tasks.peer.rows import LEADERBOARD_COLUMNS, tqbench_samples
from tqbench.engine.tasks.suite import TasksResult


# ---- the runner, in process, over a fake kvpress --------------------------------------------------------------
class _Press:
    def __init__(self, compression_ratio=0.0, **kw):
        self.compression_ratio = compression_ratio


def _fake_kvpress(calls: list) -> types.SimpleNamespace:
    class Pipeline:
        def __init__(self, model, tokenizer):
            pass

        def _forward(self, inputs, max_new_tokens, press, cache):
            ctx, (q,) = inputs["context_ids"], inputs["questions_ids"]
            calls.append((type(press).__name__, getattr(press, "compression_ratio", None), ctx.shape[1], q.shape[1],
                          max_new_tokens, ctx[0, -1].item(), q[0, 0].item()))
            return [f"ctx={ctx.shape[1]} q={q.shape[1]}"]

    names = ("SnapKVPress", "TOVAPress", "KVzipPress", "ExpectedAttentionPress", "KnormPress", "StreamingLLMPress")
    ns = types.SimpleNamespace(KVPressTextGenerationPipeline=Pipeline, **{n: type(n, (_Press,), {}) for n in names})
    ns.ChunkKVPress = lambda press, chunk_length: press
    ns.AdaKVPress = lambda press: press
    return ns


def _request(**kw):
    req = {"version": 1, "model": "/m", "presses": ["none", "snapkv", "tova"], "ratios": [0.5, 0.875],
           "protocols": ["agnostic", "aware"],
           "samples": [{"id": "niah_single#0", "ids": list(range(10, 30)), "cuts": {"agnostic": 12, "aware": 17},
                        "max_new_tokens": 4}]}
    return req | kw


def test_runner_answers_every_job_through_kvpress_pipeline_cut_where_asked(capsys):
    calls = []
    res = runner.run(_request(), _fake_kvpress(calls), lambda path, dtype: (None, None))
    # per protocol: none once (ratio 0), then each press at each ratio
    assert [(a["protocol"], a["press"], a["ratio"]) for a in res["answers"]] == [
        (p, press, r) for p in ("agnostic", "aware") for press, r in
        (("none", 0.0), ("snapkv", 0.5), ("snapkv", 0.875), ("tova", 0.5), ("tova", 0.875))]
    # the context is the ids before the cut (compressed under the press), the rest is appended: 20 ids from 10
    assert calls[0] == ("NoneType", None, 12, 8, 4, 21, 22)
    assert calls[1] == ("SnapKVPress", 0.5, 12, 8, 4, 21, 22) and calls[5] == ("NoneType", None, 17, 3, 4, 26, 27)
    assert res["answers"][6]["text"] == "ctx=17 q=3" and res["answers"][6]["context_tokens"] == 17
    assert res["answers"][0]["cache_rows"] == 12  # the fake pipeline left no cache layers: the context counts
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["event"] for x in lines[:2]] == ["progress", "answer"] and len(lines) == 20
    assert lines[0] == {"event": "progress", "done": 0, "total": 10, "what": "kvpress none 0 (agnostic): niah_single#0"}


@pytest.mark.parametrize("change, message", [
    ({"version": 2}, "request version 2: this runner speaks version 1"),
    ({"presses": ["snapkv", "nope"]}, "unknown press nope: choose from snapkv, tova"),
    ({"ratios": [1.0]}, "compression ratio [1.0]: give fractions removed, 0 <= r < 1"),
    ({"protocols": ["both"]}, "protocol ['both']: give agnostic or aware"),
    ({"samples": [{"id": "s", "ids": [1, 2, 3], "cuts": {"agnostic": 3, "aware": 1}}]},
     "sample 's': cut 3 for agnostic is not inside its 3 tokens"),
])
def test_runner_refuses_a_bad_request_in_one_line(change, message):
    with pytest.raises(ValueError, match="^" + message.replace("[", r"\[").replace("]", r"\]")):
        runner.run(_request(**change), _fake_kvpress([]), lambda *a: pytest.fail("loaded"))


# ---- the client against a fake peer process ----------------------------------------------------------------
def _fake_peer(tmp_path, body: str):
    """An executable that stands for the peer's Python: it ignores ``-I RUNNER`` and runs ``body`` on the request."""
    exe = tmp_path / "fake-python"
    exe.write_text(f"#!{sys.executable}\nimport json, sys\nreq = json.loads(sys.stdin.read())\n{body}\n")
    exe.chmod(0o755)
    return exe


ECHO_CUTS = """
ans = []
for s in req["samples"]:
    for p in req["protocols"]:
        for press in req["presses"]:
            for r in req["ratios"]:
                ans.append({"sample": s["id"], "press": press, "ratio": r, "protocol": p,
                            "text": " " + str(s["cuts"][p]) + " " + press, "context_tokens": s["cuts"][p],
                            "cache_rows": s["cuts"][p] * (1 - r), "seconds": 0.0})
print("a library's stray line")
print(json.dumps({"event": "progress", "done": 0, "total": len(ans), "what": "x"}))
print(json.dumps({"event": "result", "version": 1, "answers": ans, "versions": {"kvpress": "0.5.5"}}))
"""


def test_run_peer_speaks_json_lines_and_reports_progress(tmp_path):
    events = []
    res = run_peer(_request(presses=["snapkv"], ratios=[0.5]), _fake_peer(tmp_path, ECHO_CUTS),
                   on_event=events.append)
    assert [a["text"] for a in res["answers"]] == [" 12 snapkv", " 17 snapkv"] and res["versions"]["kvpress"]
    assert len(events) == 1 and events[0].task == "peer" and events[0].total == 2


def test_run_peer_failure_is_the_peers_own_line(tmp_path):
    exe = _fake_peer(tmp_path, 'print(json.dumps({"event": "error", "message": "ValueError: no"}))\nsys.exit(1)')
    with pytest.raises(PeerError, match=r"the kvpress peer \(.*fake-python\) failed: ValueError: no$"):
        run_peer(_request(), exe)


def test_the_real_runner_without_kvpress_answers_an_error_line():
    """The runner script itself, run by a Python without kvpress (this venv's): its error line becomes the one line
    the client raises."""
    import importlib.util
    from pathlib import Path

    if importlib.util.find_spec("kvpress") is not None:
        pytest.skip("kvpress is importable here: the runner would load the model")
    with pytest.raises(PeerError, match=r"failed: ModuleNotFoundError: No module named 'kvpress'$"):
        run_peer(_request(), Path(sys.executable))


def test_the_absent_peer_is_one_line_naming_the_command_that_creates_it(tmp_path, monkeypatch):
    monkeypatch.delenv("TQBENCH_KVPRESS_PYTHON", raising=False)
    with pytest.raises(PeerMissingError, match=r"^kvpress is not installed beside tqbench \(no .venv-kvpress with "
                                               r"kvpress in .*\): run `make kvpress-env`"):
        peer_python(roots=[tmp_path])
    (tmp_path / ".venv-kvpress" / "bin").mkdir(parents=True)
    (tmp_path / ".venv-kvpress" / "bin" / "python").touch()  # a venv without kvpress in it is not the peer
    with pytest.raises(PeerMissingError):
        peer_python(roots=[tmp_path])
    site = tmp_path / ".venv-kvpress" / "lib" / "python3.11" / "site-packages" / "kvpress"
    site.mkdir(parents=True)
    (site / "__init__.py").touch()
    assert peer_python(roots=[tmp_path]) == tmp_path / ".venv-kvpress" / "bin" / "python"


def test_cli_peer_absent_is_one_line_exit_2_before_the_model_loads(monkeypatch):
    import tqbench.cli.render.console as console

    monkeypatch.setattr(console, "load_engine", lambda *a, **k: pytest.fail("the model loaded"))
    monkeypatch.setenv("TQBENCH_KVPRESS_PYTHON", "/nonexistent/python")
    r = CliRunner().invoke(main, ["--headless", "tasks", "--peer", "kvpress", "--candidate", "fp16,keep=0.5"])
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert "TQBENCH_KVPRESS_PYTHON=/nonexistent/python is not an executable Python: run `make kvpress-env`" in r.output
    monkeypatch.setenv("TQBENCH_KVPRESS_PYTHON", sys.executable)
    r = CliRunner().invoke(main, ["--headless", "tasks", "--peer", "kvpress", "--candidate", "turbo4"])
    assert r.exit_code == 2 and "--peer-ratios is needed" in r.output, r.output
    r = CliRunner().invoke(main, ["--headless", "tasks", "--peer", "kvpress", "--peer-presses", "snapkv,zip"])
    assert r.exit_code == 2 and "--peer-presses='snapkv,zip' is invalid: choose from snapkv, tova" in r.output


def test_the_runner_knows_every_press_the_client_offers():
    """Two lists (the runner cannot import tqbench): kept equal here."""
    assert tuple(runner._press_factories(_fake_kvpress([]))) == PRESSES


def test_press_and_ratio_lists():
    assert check_presses(None) == ("snapkv", "tova", "kvzip", "expected", "knorm", "chunkkv")
    assert check_presses("TOVA, snapkv,tova") == ("tova", "snapkv")
    assert check_ratios("0.25,0.5,0.75,0.875") == (0.25, 0.5, 0.75, 0.875)
    for bad in ("0", "1", "x", ""):
        with pytest.raises(ValueError, match="give compression ratios 0 < r < 1"):
            check_ratios(bad)


# ---- the merge: one table, the leaderboard's files -------------------------------------------------------------
def _sample(task, index, protocol, base, cand, refs, base_answer, cand_answer):
    return {"task": task, "index": index, "protocol": protocol, "prompt_tokens": 100, "references": refs,
            "baseline_answer": base_answer, "candidate_answer": cand_answer, "baseline_score": base,
            "candidate_score": cand, "agree": base_answer.strip() == cand_answer.strip(),
            "baseline_compression_ratio": 0.0, "candidate_compression_ratio": 0.4}


def _result() -> TasksResult:
    res = TasksResult("m", 2048, 0, "fp16", "k=fp16,v=fp16,keep=0.5,chunk=8", "compressed", 2,
                      ["niah_single", "niah_multivalue"], protocols=("agnostic", "aware"))
    for p in ("agnostic", "aware"):
        res.samples += [_sample("niah_single", 0, p, 1.0, 1.0, ["1111"], "1111", "1111"),
                        _sample("niah_single", 1, p, 1.0, 0.0, ["2222"], "2222", "3"),
                        _sample("niah_multivalue", 0, p, 1.0, 0.5, ["5", "6"], "5 6", "5")]
    res.candidate_ratio = 0.5
    return res


def _peer_answers() -> list[dict]:
    text = {("snapkv", "niah_single#0"): "1111", ("snapkv", "niah_single#1"): "2222", ("snapkv", "niah_multivalue#0"):
            "5 and 6", ("knorm", "niah_single#0"): "1111", ("knorm", "niah_single#1"): "no",
            ("knorm", "niah_multivalue#0"): "nothing"}
    return [{"sample": s, "press": press, "ratio": 0.5, "protocol": p, "text": t, "context_tokens": 90,
             "cache_rows": 45.0, "seconds": 1.0} for (press, s), t in text.items() for p in ("agnostic", "aware")]


def test_peer_rows_join_the_candidates_table_and_leaderboard():
    res = _result()
    res.peer = {"name": "kvpress", "presses": ["snapkv", "knorm"], "ratios": [0.5], "versions": {"kvpress": "0.5.5"}}
    res.peer_samples = score_peer(_peer_answers(), {f"{s['task']}#{s['index']}": (s["references"], s["baseline_answer"])
                                                    for s in res.samples})
    d = json.loads(json.dumps(res.to_dict()))
    rows = {(r["method"], r["protocol"]): r for r in d["side_by_side"]["rows"]}
    assert set(rows) == {("fp16 (baseline)", "both"), *((m, p) for p in ("agnostic", "aware") for m in (
        "k=fp16,v=fp16,keep=0.5,chunk=8", "kvpress:snapkv", "kvpress:knorm"))}
    cand, snap, knorm = (rows[m, "agnostic"] for m in ("k=fp16,v=fp16,keep=0.5,chunk=8", "kvpress:snapkv",
                                                        "kvpress:knorm"))
    # task scores are means over samples, overall the mean of the task scores (as the suite's own rows)
    assert cand["scores"] == {"niah_single": 50.0, "niah_multivalue": 50.0} and cand["score"] == 50.0
    assert snap["scores"] == {"niah_single": 100.0, "niah_multivalue": 100.0} and snap["agreement"] == 200 / 3
    assert knorm["score"] == 25.0 and knorm["ratio"] == cand["ratio"] == 0.5 and snap["ci95"] == [43.85, 100.0]
    assert rows["fp16 (baseline)", "both"]["score"] == 100.0 and rows["fp16 (baseline)", "both"]["ratio"] == 0.0
    assert d["side_by_side"]["best"]["0.5|agnostic|kvpress"] == {"method": "kvpress:snapkv", "score": 100.0}
    # the peer's presses are leaderboard rows beside the suite's own, at the press's compression ratio
    board = [r for r in d["leaderboard"] if r["method"].startswith("kvpress:")]
    assert {(r["method"], r["protocol"], r["compression_ratio"], r["score"]) for r in board} == {
        ("kvpress:snapkv", "agnostic", 0.5, 100.0), ("kvpress:snapkv", "aware", 0.5, 100.0),
        ("kvpress:knorm", "agnostic", 0.5, 25.0), ("kvpress:knorm", "aware", 0.5, 25.0)}
    assert d["peer"]["versions"] == {"kvpress": "0.5.5"} and len(d["peer_samples"]) == 12
    # a saved session's result (to_dict -> from_dict) gives the same rows, the peer's included
    back = TasksResult.from_dict(d)
    assert back.protocols == ("agnostic", "aware") and back.tasks == ["niah_single", "niah_multivalue"]
    assert json.loads(json.dumps(back.to_dict())) == d


def test_leaderboard_folders_in_kvpress_schema_and_the_plots(tmp_path):
    from tqbench.cli.render.peer import plot_svg, side_by_side_md

    res = _result()
    res.peer_samples = score_peer(_peer_answers(), {f"{s['task']}#{s['index']}": (s["references"], s["baseline_answer"])
                                                    for s in res.samples})
    sbs = res.side_by_side()
    runs = write_leaderboard(sbs, tmp_path, {"context": 2048})
    assert len(runs) == 7 and all((r / f).is_file() for r in runs for f in ("config.json", "metrics.json",
                                                                            "predictions.csv"))
    with (tmp_path / "leaderboard.csv").open() as fh:
        board = list(csv.DictReader(fh))
    assert tuple(board[0]) == LEADERBOARD_COLUMNS and LEADERBOARD_COLUMNS[:6] == (
        "dataset", "data_dir", "model", "method", "compression_ratio", "score")
    assert {(b["dataset"], b["data_dir"]) for b in board} == {("tqbench-ruler", "2048")}
    snap = next(r for r in runs if "kvpress_snapkv" in r.name and r.name.endswith("agnostic"))
    assert json.loads((snap / "config.json").read_text())["compression_ratio"] == 0.5
    assert json.loads((snap / "metrics.json").read_text())["score"] == 100.0
    with (snap / "predictions.csv").open() as fh:
        preds = list(csv.DictReader(fh))
    assert [(p["task"], p["predicted_answer"], p["score"]) for p in preds] == [
        ("niah_single", "1111", "1.0"), ("niah_single", "2222", "1.0"), ("niah_multivalue", "5 and 6", "1.0")]
    svg = plot_svg(sbs)
    assert svg.startswith("<svg") and svg.count("<polyline") == 6  # 3 methods x 2 protocols, each from fp16 at 0
    # the peer's two presses x 2 protocols dashed, and their two legend keys
    assert sum('stroke-dasharray' in ln for ln in svg.splitlines() if ln.startswith("<polyline")) == 4
    assert svg.count("stroke-dasharray") == 6 and "kvpress:knorm</text>" in svg
    md = side_by_side_md(sbs)
    assert "| kvpress | kvpress:snapkv | 0.5 | agnostic | 100 | 100 | 100.0 [44-100] | 67% | 3 |" in md


def test_tqbench_samples_take_the_nominal_ratio_or_the_measured_one():
    d = _result().to_dict()
    assert {s["ratio"] for s in tqbench_samples(d, 0.5) if s["method"] != "fp16 (baseline)"} == {0.5}
    assert {s["ratio"] for s in tqbench_samples(d) if s["method"] != "fp16 (baseline)"} == {0.4}
    assert side_by_side([], [])["rows"] == []


def test_cli_peer_on_the_tiny_model_with_a_fake_peer(tmp_path, monkeypatch, tiny_engine):
    """The whole path: the suite's own ids go to the peer, cut at the question (agnostic) and at the end of the
    user's turn (aware); the peer's rows come back in the JSON and the leaderboard folder."""
    import tqbench.engine.tasks.peer.client as client
    from tqbench.engine.tasks import build_samples, check_tasks
    from tqbench.engine.tasks.generate import question_start, user_turn_end

    monkeypatch.setenv("TQBENCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TQBENCH_KVPRESS_PYTHON", str(_fake_peer(tmp_path, ECHO_CUTS)))
    monkeypatch.setattr(client, "model_folder", lambda engine: str(tmp_path))
    report, board = tmp_path / "r.json", tmp_path / "board"
    r = CliRunner().invoke(main, ["--headless", "tasks", "--model", "tiny", "--context", "1024", "--tasks",
                                  "niah_single", "--samples", "1", "--candidate", "fp16,keep=0.5", "--peer",
                                  "kvpress", "--peer-presses", "snapkv,tova", "--report-json", str(report),
                                  "--leaderboard", str(board)])
    assert r.exit_code == 0, r.output
    d = json.loads(report.read_text())
    (s,) = build_samples(tiny_engine, check_tasks(["niah_single"], 1024, 1), 1024, 1, 0)
    q, u = question_start(tiny_engine, s), user_turn_end(tiny_engine, s)
    assert q < u < s.prompt_tokens
    assert sorted(x["answer"] for x in d["peer_samples"]) == sorted(
        [f" {q} snapkv", f" {q} tova", f" {u} snapkv", f" {u} tova"])
    assert {(x["method"], x["protocol"], x["ratio"]) for x in d["side_by_side"]["rows"]} >= {
        ("kvpress:snapkv", "agnostic", 0.5), ("kvpress:tova", "aware", 0.5), ("k=fp16,v=fp16,keep=0.5", "aware", 0.5)}
    assert (board / "leaderboard.csv").is_file() and (board / "score-vs-ratio.svg").is_file()
    assert "kvpress:snapkv" in r.output  # the side-by-side table
