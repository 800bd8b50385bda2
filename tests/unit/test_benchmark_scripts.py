"""The benchmark scripts run end to end on the tiny model (a smoke test: they are never part of a score)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODES = ("dense-shadow", "simulate", "compressed", "fused")


def test_decode_benchmark_quick_on_tiny(tmp_path):
    out = tmp_path / "decode.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--model", "tiny", "--quick",
           "--policies", "turbo4,q8k-int4v", "--threads", "1", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert (data["contexts"], data["new_tokens"], data["repeats"], data["threads"]) == ([256], 8, 1, 1)
    assert data["model"] == "tiny-random" and data["command"][-1] == str(out)
    for key in ("torch", "transformers", "cpu", "timestamp", "loadavg_before", "loadavg_after"):
        assert data[key], key
    (res,) = data["results"]
    assert res["context"] == 256
    assert res["baseline"]["decode_tok_s"] > 0 and res["baseline"]["ratio_vs_dense"] == 1.0
    rows = {(r["policy"], r["mode"]): r for r in res["rows"]}
    assert len(rows) == len(res["rows"]) == 8
    assert set(rows) == {(p, m) for p in ("turbo4", "q8k-int4v") for m in MODES}
    for key, row in rows.items():
        assert row["decode_tok_s"] > 0 and len(row["decode_tok_s_runs"]) == 1, key
        assert row["ratio_vs_dense"] > 0 and row["prefill_s"] > 0, key
        assert row["resident_decode_bytes"] > 0 and 0 < row["bits_per_element"] < 16, key
    assert rows["turbo4", "fused"]["resident_decode_bytes"] < rows["turbo4", "simulate"]["resident_decode_bytes"]
    assert "vs dense" in proc.stdout and "fused" in proc.stdout
    assert list(rows["turbo4", "fused"]["fused_impl"]) == ["native-cpu"]
    summ = {s["policy"]: s for s in data["summary"]}
    assert set(summ) == {"turbo4", "q8k-int4v"} and all(s["context"] == 256 for s in summ.values())
    assert summ["turbo4"]["fused_vs_dense"] == rows["turbo4", "fused"]["ratio_vs_dense"]
    assert summ["turbo4"]["fused_vs_compressed"] > 0 and "fused / compressed" in proc.stdout


def test_frontier_benchmark_on_tiny_reuses_an_artifacts_verified_point(tmp_path):
    from tqbench.engine.allocate import allocate_policy, save_policy_artifact
    from tqbench.engine.engine import Engine

    engine = Engine.tiny()
    rep = allocate_policy(engine, 4.5, calibration="bread", calib_prefill=48, calib_steps=8, verify_prefill=48,
                          verify_steps=6, context=96, base="sink=2,recent=4", codecs=["turbo1", "turbo4"])
    art = save_policy_artifact(rep.to_artifact(engine.geometry), tmp_path / "a.toml")
    out = tmp_path / "frontier.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "frontier.py"), "--model", "tiny", "--allocated", str(art),
           "--uniform", "turbo4,turbo2", "--prefill", "48", "--steps", "6", "--context", "96", "--threads", "1",
           "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {r["kv_policy"]: r for r in data["results"]["rivers"]}
    assert set(rows) == {"alloc-4.5bit", "turbo4", "turbo2"} and data["threads"] == 1 and data["loadavg_before"]
    alloc = rows["alloc-4.5bit"]
    assert alloc["source"].endswith("[verified]") and alloc["kl_mean"] == rep.verified.kl_mean
    assert rows["turbo4"]["source"] == "measured" and rows["turbo4"]["report_bits_per_element"] > 0
    # at 96 tokens both uniform presets (sink 4 + recent 16 fp16 rows) cost more bytes than the allocation
    assert min(rows["turbo4"]["bits_per_element"], rows["turbo2"]["bits_per_element"]) > alloc["bits_per_element"]
    assert "best_uniform_no_more_bytes" not in alloc
