"""Sweeps on the tiny model: spec errors, the in-process run (cells, arrays, report), a raising cell, resume
after a killed sweep, and the CLI (report, exit codes, --ray without Ray)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from tqbench.cli import main
from tqbench.engine.sweep import (
    SpecError,
    SweepCellFinished,
    SweepCellStarted,
    SweepDir,
    expand,
    load_spec,
    numbers,
    parse_spec,
    run_sweep,
)

ROOT = Path(__file__).resolve().parents[2]
TINY_SPEC = """
name = "tiny"
models = ["tiny"]
policies = ["turbo4", "turbo2", "q8k-q8v"]
threads = 1
[[texts]]
name = "capital"
prompt = "What is the capital of France?"
[[texts]]
name = "rivers"
corpus = "rivers"
[validate]
max_new_tokens = 8
[teacher_forced]
max_new_tokens = 8
context_tokens = 32
eval_tokens = 8
[bytes]
tokens = [1024]
"""


def write_spec(tmp_path: Path, text: str = TINY_SPEC, name: str = "spec.toml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text), encoding="utf-8")
    return p


# ---- the spec ---------------------------------------------------------------------------------------------
BASE = {"models": ["tiny"], "policies": ["turbo4"], "texts": [{"name": "a", "prompt": "hi"}]}


@pytest.mark.parametrize("change,text", [
    ({"modles": ["tiny"]}, "unknown key modles: the keys allowed at the top level are"),
    ({"models": []}, "models = [] is empty"),
    ({"models": [{"dtype": "float32"}]}, "models[0] has no `spec`"),
    ({"models": [{"spec": "tiny", "dtyp": "x"}]}, "unknown key models[0].dtyp"),
    ({"policies": ["turbo4", "turbo9"]}, "policies[1]: unknown policy preset 'turbo9'"),
    ({"policies": ["turbo4", "turbo4"]}, "policies[1] ('turbo4') is listed twice"),
    ({"policies": ["fp16"]}, "policies[0] ('fp16') is the baseline"),
    ({"policies": [{"allocate": {"bits": 3.0}}]}, "policies[0]: an `allocate` budget needs the `tqbench allocate`"),
    ({"policies": [{"file": "nope.toml"}]}, "policies[0].file:"),
    ({"texts": [{"name": "a"}]}, "texts[0] must have exactly one of prompt, prompt_file, corpus, niah, tasks (it has none)"),
    ({"texts": [{"name": "a", "corpus": "moon"}]}, "texts[0].corpus = 'moon' is unknown: shipped texts are"),
    ({"texts": [{"name": "a", "niah": {"length": 256, "depth": 1.5}}]}, "texts[0].niah.depth = 1.5 is invalid"),
    ({"texts": [{"name": "a", "prompt": "x"}, {"name": "a", "prompt": "y"}]}, "texts[1].name = 'a' is used twice"),
    ({"measure": ["validate", "vibes"]}, "measure[1] = 'vibes' is unknown: choose from validate, teacher_forced"),
    ({"measure": ["niah"]}, "texts[0] ('a') is a prompt text and `measure` has nothing for it"),
    ({"cache_mode": "zip"}, "cache_mode = 'zip' is unknown"),
    ({"validate": {"max_new_tokens": 0}}, "validate.max_new_tokens = 0 is invalid"),
    ({"threads": 0}, "threads = 0 is invalid"),
    ({"bytes": {"tokens": [1024, -1]}}, "bytes.tokens[1] = -1 is invalid"),
])
def test_spec_errors_name_the_key(change, text):
    with pytest.raises(SpecError) as exc:
        parse_spec({**BASE, **change})
    assert text in str(exc.value)


def test_spec_file_errors(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        load_spec(tmp_path / "missing.toml")
    with pytest.raises(SpecError, match="not valid TOML"):
        load_spec(write_spec(tmp_path, "models = [", "bad.toml"))


def test_expand_cells_and_policy_file(tmp_path):
    (tmp_path / "pol.toml").write_text('k = "int8"\nv = "turbo4"\n', encoding="utf-8")
    spec = parse_spec({**BASE, "policies": ["turbo4", {"file": "pol.toml"}]}, base_dir=tmp_path)
    cells = expand(spec)
    assert [(c.policy.label, c.text.name) for c in cells] == [("turbo4", "a"), (spec.policies[1].label, "a")]
    assert spec.policies[1].source.startswith("file:") and "v=turbo4" in spec.policies[1].policy_string
    assert len({c.cell_id for c in cells}) == 2
    assert cells[0].measure == ("validate", "teacher_forced", "speed", "bytes")


# ---- running ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def local_sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    spec = load_spec(write_spec(tmp))
    events = []
    report = run_sweep(spec, tmp / "out", on_event=events.append)
    return spec, tmp / "out", report, events


def test_in_process_sweep_writes_every_cell_and_ranks(local_sweep):
    spec, out, report, events = local_sweep
    cells = expand(spec)
    assert len(cells) == 6 and not report.missing and not report.failed
    store = SweepDir(out)
    for c in cells:
        doc = store.read_cell(c.cell_id)
        assert doc["status"] == "ok" and doc["cell"] == c.key(spec)
        assert doc["model_name"] == "tiny-random"
        res = doc["results"]
        if c.text.kind == "prompt":
            assert set(res) == {"validate", "teacher_forced", "speed", "bytes"}
            arrays = store.read_arrays(c.cell_id)
            assert arrays["validate.same_token"].shape == (8,)
            assert arrays["validate.step_kl"].shape == (8,)
            assert res["validate"]["baseline_tokens"] == 8
        else:
            assert set(res) == {"teacher_forced", "bytes"}
            assert res["teacher_forced"]["steps"] == 8 and res["teacher_forced"]["source"] == "corpus:rivers"
        est = res["bytes"]["estimates"][0]
        assert est["seq_len"] == 1024 and est["total_bytes"] > 0
    started = [e.cell_id for e in events if isinstance(e, SweepCellStarted)]
    assert started == [c.cell_id for c in cells]
    m = report.models[0]
    assert [r["rank"] for r in m["rows"]] == [1, 2, 3]
    bits = [r["est_bits_per_element"] for r in m["rows"]]
    assert bits == sorted(bits)
    # the estimate is the engine's own exact byte count
    from tqbench.engine import Engine, estimate_kv
    geo = Engine.tiny().geometry
    for r in m["rows"]:
        assert r["estimated_bytes"][0]["total_bytes"] == estimate_kv(r["policy_string"], geo, 1024).total_bytes
    rec = m["recommendation"]
    assert rec["rule"].startswith("the exact-match compressed policy with the highest saving")
    assert rec["recommended_policy"] in [r["policy"] for r in m["rows"]] + ["fp16"]
    saved = json.loads((out / "report.json").read_text())
    assert saved["models"] == report.models


def test_two_entries_of_one_model_at_two_dtypes(tmp_path):
    spec = parse_spec({"models": ["tiny", {"spec": "tiny", "dtype": "float64"}], "policies": ["turbo4"],
                       "texts": [{"name": "a", "prompt": "hello"}], "measure": ["validate", "bytes"],
                       "validate": {"max_new_tokens": 4}, "threads": 1})
    report = run_sweep(spec, tmp_path / "out")
    assert [m["model"] for m in report.models] == ["tiny", "tiny (float64)"]
    assert [c["dtype"] for c in report.cells] == ["float32", "float64"]
    assert [c["cell_id"].split("--")[0] for c in report.cells] == ["tiny", "tiny-float64"]
    assert all(len(m["rows"]) == 1 and m["rows"][0]["cells"] == 1 for m in report.models)
    with pytest.raises(SpecError, match=r"models\[1\] \('tiny'\) is listed twice"):
        parse_spec({**BASE, "models": ["tiny", "tiny"]})


def test_sweep_refuses_a_used_folder_without_resume(local_sweep):
    spec, out, _, _ = local_sweep
    with pytest.raises(ValueError, match="already holds 6 cell result"):
        run_sweep(spec, out)


def test_resume_of_a_finished_sweep_runs_nothing(local_sweep):
    spec, out, report, _ = local_sweep
    events = []
    again = run_sweep(spec, out, resume=True, on_event=events.append)
    assert not [e for e in events if isinstance(e, SweepCellStarted)]
    assert again.models == report.models


def test_a_raising_cell_is_recorded_and_the_rest_complete(tmp_path):
    spec = load_spec(write_spec(tmp_path, TINY_SPEC + '[[texts]]\nname = "too-long"\nniah = {length = 5000}\n'))
    events = []
    report = run_sweep(spec, tmp_path / "out", on_event=events.append)
    failed = [c for c in report.cells if c["status"] != "ok"]
    assert len(report.cells) == 9 and len(failed) == 3
    assert {c["cell"]["text"]["name"] for c in failed} == {"too-long"}
    for c in failed:
        assert c["error"]["type"] == "PromptTooLongError"
        assert "tiny-random has a context of 4096 tokens" in c["error"]["message"] and "Traceback" in c["error"]["traceback"]
    done = [e for e in events if isinstance(e, SweepCellFinished)]
    assert [e.status for e in done].count("ok") == 6 and done[-1].done == 9
    rec = report.models[0]["recommendation"]
    assert sorted(rec["failed_policies"]) == ["q8k-q8v", "turbo2", "turbo4"]
    assert rec["status"] == "no-verdicts"


def test_a_model_that_does_not_load_fails_its_cells_and_the_other_model_runs(tmp_path):
    spec = parse_spec({"models": [str(tmp_path / "no-such-model"), "tiny"], "policies": ["turbo4"],
                       "texts": [{"name": "a", "prompt": "hello"}], "measure": ["validate"],
                       "validate": {"max_new_tokens": 4}, "threads": 1})
    report = run_sweep(spec, tmp_path / "out")
    bad, good = report.cells
    assert bad["status"] == "error" and "did not load" in bad["error"]["message"]
    assert good["status"] == "ok" and good["results"]["validate"]["baseline_tokens"] == 4
    assert report.models[0]["recommendation"]["failed_policies"] == ["turbo4"]


KILLED = """
import sys, threading
from pathlib import Path
from tqbench.engine.sweep import SweepCellStarted, load_spec, run_sweep

spec_path, out, ready = sys.argv[1:4]
started = []

def on_event(ev):
    if isinstance(ev, SweepCellStarted):
        started.append(ev.cell_id)
        if len(started) == 4:  # cells 1-3 are on disk, cell 4 is running: say so, then hang until killed
            Path(ready).write_text(ev.cell_id)
            threading.Event().wait()

run_sweep(load_spec(spec_path), out, on_event=on_event)
"""


def test_resume_after_a_killed_sweep_reruns_only_the_unfinished_cells(tmp_path):
    spec_path = write_spec(tmp_path)
    script, ready, out = tmp_path / "killed.py", tmp_path / "ready", tmp_path / "out"
    script.write_text(KILLED, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, str(script), str(spec_path), str(out), str(ready)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 600  # a generous ceiling: the test waits on the file, not on a duration
        while not ready.exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the sweep never reached its fourth cell"
            time.sleep(0.05)
        proc.kill()  # mid-sweep: three cells written, the fourth running
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    spec = load_spec(spec_path)
    cells = expand(spec)
    assert ready.read_text() == cells[3].cell_id
    store = SweepDir(out)
    on_disk = sorted(p.stem for p in store.cells.glob("*.json"))
    assert on_disk == sorted(c.cell_id for c in cells[:3])  # the killed cell left no file
    before = {c.cell_id: (store.cells / f"{c.cell_id}.json").read_bytes() for c in cells[:3]}
    events = []
    report = run_sweep(spec, out, resume=True, on_event=events.append)
    assert [e.cell_id for e in events if isinstance(e, SweepCellStarted)] == [c.cell_id for c in cells[3:]]
    assert {k: (store.cells / f"{k}.json").read_bytes() for k in before} == before
    assert len(report.cells) == 6 and not report.failed and not report.missing


# ---- Ray -----------------------------------------------------------------------------------------------------
def test_ray_gives_the_same_results_as_in_process(local_sweep, tmp_path):
    import ray

    spec, out, report, _ = local_sweep
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # a new cluster
    try:
        events = []
        ray_report = run_sweep(spec, tmp_path / "ray", ray=True, on_event=events.append)
        # resume on Ray: two cells removed, only they run again, with the same numbers
        gone = [ray_report.cells[1]["cell_id"], ray_report.cells[4]["cell_id"]]
        for cell_id in gone:
            (tmp_path / "ray" / "cells" / f"{cell_id}.json").unlink()
        again = []
        resumed = run_sweep(spec, tmp_path / "ray", ray=True, resume=True, on_event=again.append)
        assert sorted(e.cell_id for e in again if isinstance(e, SweepCellStarted)) == sorted(gone)
        assert [numbers(c) for c in resumed.cells] == [numbers(c) for c in ray_report.cells]
        nothing = []
        run_sweep(spec, tmp_path / "ray", ray=True, resume=True, on_event=nothing.append)
        assert [e.runner for e in nothing if type(e).__name__ == "SweepPlanned"] == ["ray (nothing to run)"]
    finally:
        ray.shutdown()
    planned = [e for e in events if type(e).__name__ == "SweepPlanned"]
    assert planned[0].runner == "ray (2 shards)"  # 2 CPUs, 1 thread per task
    wheres = {c["where"] for c in ray_report.cells}
    assert all(w.startswith("ray node ") for w in wheres)
    local_docs = {c["cell_id"]: numbers(c) for c in report.cells}
    ray_docs = {c["cell_id"]: numbers(c) for c in ray_report.cells}
    assert ray_docs == local_docs
    import numpy as np

    for c in report.cells:  # the per-step arrays too (timings aside)
        x, y = SweepDir(out).read_arrays(c["cell_id"]), SweepDir(tmp_path / "ray").read_arrays(c["cell_id"])
        assert sorted(x) == sorted(y)
        for k in x:
            if not k.startswith("speed."):
                assert np.array_equal(x[k], y[k], equal_nan=True), k
    strip = [{**r, "throughput_ratio": None} for m in report.models for r in m["rows"]]
    ray_strip = [{**r, "throughput_ratio": None} for m in ray_report.models for r in m["rows"]]
    assert sorted(ray_strip, key=lambda r: r["policy"]) == sorted(strip, key=lambda r: r["policy"])
    assert ray_report.models[0]["recommendation"] == report.models[0]["recommendation"]


def test_ray_task_options_one_gpu_per_task_on_gpu_nodes():
    from tqbench.engine.sweep.ray_runner import task_options

    assert task_options({"CPU": 64.0, "GPU": 8.0}, None) == ({"num_gpus": 1, "num_cpus": 1}, 8)
    assert task_options({"CPU": 64.0, "GPU": 8.0}, 4) == ({"num_gpus": 1, "num_cpus": 4}, 8)
    assert task_options({"CPU": 16.0, "GPU": 1.0}, 32) == ({"num_gpus": 1, "num_cpus": 16}, 1)
    assert task_options({"CPU": 2.0}, None) == ({"num_cpus": 1}, 2)
    assert task_options({"CPU": 16.0}, 4) == ({"num_cpus": 4}, 4)
    with pytest.raises(ValueError, match="threads=4 is invalid: the Ray cluster has 2 CPUs and no GPUs"):
        task_options({"CPU": 2.0}, 4)  # never schedulable: an error, not a hang


# ---- the CLI -------------------------------------------------------------------------------------------------
def run_cli(*args):
    return CliRunner().invoke(main, ["--headless", "sweep", *args])


def test_cli_sweep_report_json_markdown_and_used_folder(tmp_path):
    spec = write_spec(tmp_path)
    out = tmp_path / "out"
    r = run_cli(str(spec), "--out", str(out), "--json", "--report-md", str(tmp_path / "r.md"))
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["name"] == "tiny" and len(d["cells"]) == 6 and d["models"][0]["model_name"] == "tiny-random"
    md = (tmp_path / "r.md").read_text()
    assert md == (out / "report.md").read_text() and "# Sweep tiny (vs fp16, compressed)" in md
    assert "| rank | policy | bits/el @1024 |" in md
    r = run_cli(str(spec), "--out", str(out))
    assert r.exit_code == 2 and f"--out={str(out)!r} is invalid: it already holds 6 cell result(s)" in r.stderr
    r = run_cli(str(spec), "--out", str(out), "--resume")
    assert r.exit_code == 0, r.output
    assert "6 cells, 6 reused, 0 to run (in-process)" in r.stderr
    assert "recommended:" in r.stdout


def test_cli_failed_cells_exit_1_and_bad_spec_exit_2(tmp_path):
    spec = write_spec(tmp_path, TINY_SPEC.replace('policies = ["turbo4", "turbo2", "q8k-q8v"]', 'policies = ["turbo4"]')
                      + '[[texts]]\nname = "too-long"\nniah = {length = 5000}\n')
    r = run_cli(str(spec), "--out", str(tmp_path / "out"))
    assert r.exit_code == 1, r.output
    assert "gate failed: 1 of 3 cells failed (tiny--too-long--turbo4-" in r.stderr
    assert "cell failed" in r.stderr and "has a context of 4096 tokens" in r.stderr
    bad = write_spec(tmp_path, 'models = ["tiny"]\npolicies = ["turbo9"]\n[[texts]]\nprompt = "x"\n', "bad.toml")
    r = run_cli(str(bad))
    assert r.exit_code == 2 and r.stderr.startswith("error: policies[0]: unknown policy preset 'turbo9'")


def test_cli_ray_without_ray_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    r = run_cli(str(write_spec(tmp_path)), "--out", str(tmp_path / "out"), "--ray")
    assert r.exit_code == 2
    assert "a sweep on Ray needs Ray, which is not installed: pip install 'tqbench[ray]'" in r.stderr
    assert not (tmp_path / "out").exists()  # nothing ran


def test_benchmark_script_on_a_tiny_spec(tmp_path):
    spec = write_spec(tmp_path, TINY_SPEC.replace('policies = ["turbo4", "turbo2", "q8k-q8v"]', 'policies = ["turbo4"]'))
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sweep.py"), "--spec", str(spec), "--json",
                           str(out), "--keep", str(tmp_path / "runs")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["cells"] == 2 and data["cells_with_equal_numbers"] == 2 and data["cells_that_differ"] == []
    assert data["runs"]["ray"]["runner"] in ("ray (1 shard)", "ray (2 shards)") and data["loadavg_before"]
    assert "cells with equal numbers" in proc.stdout


def test_example_spec_parses():
    spec = load_spec(ROOT / "examples" / "sweep.toml")
    assert [m.spec for m in spec.models] == ["default"] and len(spec.policies) == 3
    assert [t.kind for t in spec.texts] == ["prompt", "corpus", "niah"]
