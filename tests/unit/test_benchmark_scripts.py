"""The benchmark scripts run end to end on the tiny model (a smoke test: they are never part of a score)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODES = ("dense-shadow", "simulate", "compressed", "fused")


@pytest.fixture
def script(monkeypatch, capsys):
    """``script(cmd)``: a benchmark command line (``[sys.executable, benchmarks/NAME.py, *args]``) run in this process
    through the script's ``main(argv)``, as a subprocess would give it: exit code (``sys.exit("message")``: 1, the
    message on stderr), stdout, stderr. No interpreter or torch start per run; runs whose point is a fresh
    process's environment (``TQBENCH_NATIVE=0``, ``TQBENCH_FUSED_IMPL``) stay subprocesses."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # the scripts import their _common
    monkeypatch.chdir(ROOT)

    def run(cmd: list[str]):
        path, argv = Path(cmd[1]), [str(a) for a in cmd[2:]]
        spec = importlib.util.spec_from_file_location(f"benchmark_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        capsys.readouterr()
        try:
            code = module.main(argv)
        except SystemExit as exc:
            code = exc.code
        out = capsys.readouterr()
        err = out.err
        if isinstance(code, str):
            err, code = err + code + "\n", 1
        return types.SimpleNamespace(returncode=code or 0, stdout=out.out, stderr=err)

    return run


def test_decode_cpu_benchmark_on_tiny_names_its_baseline_and_refuses_a_reference_run(tmp_path, script):
    out = tmp_path / "dc.json"
    base = [sys.executable, str(ROOT / "benchmarks" / "decode_cpu.py"), "--model", "tiny", "--contexts", "48",
            "--steps", "2", "--rounds", "1", "--json", str(out)]
    proc = script(base + ["--policies", "turbo4;k=turbo4|turbo2,v=turbo3"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["baseline"] == "dense" and data["threads"] == 1
    assert data["baseline_label"] == "dense (float32 K/V; attention: the model's attention)"
    assert data["baseline_kv_dtype"] == "float32"
    assert [r["policy"] for r in data["rows"]] == ["dense", "turbo4", "k=turbo4|turbo2,v=turbo3"]
    assert all(r["cpu_ms_per_step"] > 0 for r in data["rows"]) and data["rows"][0]["cpu_ratio_vs_dense"] == 1.0
    # a run that is not all native kernel is not a kernel figure: refused, saying what ran
    proc = subprocess.run(base + ["--policies", "turbo4"], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "TQBENCH_FUSED_IMPL": "torch"})
    assert proc.returncode != 0 and "did not run only the native kernel" in proc.stderr

def test_decode_benchmark_quick_on_tiny(tmp_path, script):
    out = tmp_path / "decode.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--model", "tiny", "--quick",
           "--policies", "turbo4,q8k-int4v", "--threads", "1", "--json", str(out)]
    proc = script(cmd)
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


def test_decode_benchmarks_take_a_16_bit_dense_baseline_and_name_its_kv_dtype(tmp_path, script):
    out = tmp_path / "decode.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--model", "tiny", "--quick", "--policies", "turbo4",
           "--modes", "fused", "--threads", "1", "--baseline", "dense-fp16", "--json", str(out)]
    proc = script(cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert (data["baseline"], data["baseline_kv_dtype"], data["dtype"]) == ("dense-fp16", "float16", "float32")
    (res,) = data["results"]
    assert res["baseline"]["policy"] == "dense-fp16" and res["baseline"]["kv_dtype"] == "float16"
    assert "vs dense-fp16" in proc.stdout and "float16 K/V" in proc.stdout
    out = tmp_path / "dc.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "decode_cpu.py"), "--model", "tiny", "--contexts", "48",
           "--steps", "2", "--rounds", "1", "--policies", "turbo4", "--baseline", "dense-bf16", "--json", str(out)]
    proc = script(cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["baseline"] == "dense-bf16" and data["baseline_kv_dtype"] == "bfloat16"
    assert data["baseline_label"].startswith("dense-bf16 (bfloat16 K/V; attention: the model's attention on the rows")
    assert [r["policy"] for r in data["rows"]] == ["dense-bf16", "turbo4"]


def test_decode_cpu_times_the_kernel_baseline_beside_the_others_in_one_process(tmp_path, script):
    out = tmp_path / "dc.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "decode_cpu.py"), "--model", "tiny", "--contexts", "48",
           "--steps", "2", "--rounds", "1", "--policies", "turbo4", "--baseline", "dense-fp16-kernel",
           "--compare-baselines", "dense,dense-fp16,dense-fp16-kernel", "--json", str(out)]
    proc = script(cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [r["policy"] for r in data["rows"]] == ["dense-fp16-kernel", "dense", "dense-fp16", "turbo4"]
    assert data["baselines"]["dense-fp16-kernel"]["kv_dtype"] == "float16"
    assert "native CPU kernel reading the 16-bit rows as stored" in data["baseline_label"]
    assert "x dense-fp16-kernel (wall)" in proc.stdout
    # where the kernel cannot run, the kernel baseline is refused with the reason (no silent fallback)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env={**os.environ,
                          "TQBENCH_NATIVE": "0"})
    assert proc.returncode == 2
    assert "the dense-fp16-kernel baseline needs tqbench's native CPU kernel, which cannot run here: " \
           "TQBENCH_NATIVE=0" in proc.stderr


def test_engines_benchmark_on_tiny_times_tqbench_and_skips_llamacpp_with_its_reason(tmp_path, script):
    out = tmp_path / "engines.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "engines.py"), "--model", "tiny", "--contexts", "64",
           "--threads", "1", "--steps", "2", "--rounds", "1", "--policies", "turbo4", "--json", str(out)]
    proc = script(cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    reason = "tiny-random is not a GGUF model: llama-bench runs GGUF files (pass the default model or a .gguf)"
    assert data["llamacpp_skipped"] == reason and f"llama.cpp skipped: {reason}" in proc.stdout
    rows = {r["cache"]: r for r in data["rows"]}
    assert list(rows) == ["dense", "dense-fp16", "dense-fp16-kernel", "turbo4 fused"]
    assert {r["system"] for r in data["rows"]} == {"tqbench"}
    assert (rows["dense"]["kv_dtype"], rows["dense-fp16"]["kv_dtype"]) == ("float32", "float16")
    assert (rows["dense"]["bits_per_element"], rows["dense-fp16-kernel"]["bits_per_element"]) == (32.0, 16.0)
    assert rows["dense-fp16-kernel"]["vs_own_16bit"] == 1.0 and 0 < rows["turbo4 fused"]["bits_per_element"] < 16
    assert list(rows["turbo4 fused"]["fused_impl"]) == ["native-cpu"]
    summ = data["summary"]["64"]
    assert summ["own_16bit"] == data["baselines"]["own_16bit"] == "dense-fp16-kernel"
    assert summ["turbo4_vs_own_16bit"] == rows["turbo4 fused"]["vs_own_16bit"]
    assert {"turbo4_vs_dense_fp16", "turbo4_vs_dense_fp32"} <= set(summ)
    assert data["threads"] == 1 and data["loadavg_per_context"]["64"]["before"]
    assert "vs own 16-bit" in proc.stdout and "turbo4 fused" in proc.stdout


def test_frontier_benchmark_on_tiny_reuses_an_artifacts_verified_point(tmp_path):
    from tqbench.engine.allocate import allocate_policy
    from tqbench.engine.engine import Engine
    from tqbench.engine.policy import save_policy_artifact

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


def test_frontier_benchmark_puts_joint_eviction_and_quantization_side_by_side(tmp_path):
    from tqbench.engine.allocate import allocate_policy
    from tqbench.engine.engine import Engine
    from tqbench.engine.policy import save_policy_artifact

    engine = Engine.tiny()
    rep = allocate_policy(engine, 3.5, calibration="bread", calib_prefill=48, calib_steps=8, verify_prefill=48,
                          verify_steps=6, context=96, base="sink=2,recent=4,window=4", codecs=["turbo4"],
                          k_codecs=["turbo4"], axes="bits,tokens", max_measurements=1, protections=[])
    art = save_policy_artifact(rep.to_artifact(engine.geometry), tmp_path / "j.toml")
    out = tmp_path / "frontier.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "frontier.py"), "--model", "tiny", "--allocated", str(art),
           "--uniform", "turbo2", "--eviction", "fp16,sink=2,recent=4,window=4,keep=0.25", "--prefill", "48",
           "--steps", "6", "--context", "96", "--threads", "1", "--texts", "rivers,heldout:technical",
           "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    for text, where in (("rivers", "[verified]"), ("heldout:technical", "[verified.unseen]")):
        rows = {r["axis"]: r for r in data["results"][text]}
        assert set(rows) == {"joint", "bits", "tokens"}
        joint = rows["joint"]
        assert joint["source"].endswith(where) and joint["fitted_kl"] == rep.measured_kl
        assert joint["unseen_over_fitted"] == joint["kl_mean"] / rep.measured_kl
        assert rows["bits"]["kv_policy"] == "turbo2" and rows["tokens"]["kind"] == "eviction"
        if rows["bits"]["bits_per_element"] <= joint["bits_per_element"]:
            assert joint["best_no_eviction_no_more_bytes"] == "turbo2"
    assert "best no-evict" in proc.stdout


def test_attention_benchmark_at_a_shape_preset_reports_ratio_and_copy_bandwidth(tmp_path, script):
    out = tmp_path / "att.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "attention.py"), "--shape", "smollm2", "--contexts", "512",
           "--queries", "1,4", "--codecs", "turbo4:turbo4", "--impls", "native-cpu,torch-reference",
           "--sparsev", "0.001", "--repeats", "1", "--threads", "1", "--json", str(out)]
    proc = script(cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["shape"] == "smollm2" and data["shape_fields"]["num_key_value_heads"] == 3
    assert data["copy_bandwidth_gbs"] > 0 and data["last_level_cache_bytes"] > 0 and data["timing"].startswith("cold")
    rows = {(r["queries"], r["impl"]): r for r in data["rows"]}
    assert set(rows) == {(q, i) for q in (1, 4) for i in ("native-cpu", "torch-reference", "native-cpu sparsev=0.001")}
    for r in rows.values():
        assert (r["kv_heads"], r["q_heads"], r["head_dim"], r["context"]) == (3, 9, 64, 512)
        # speedup is from the unrounded times; the ms columns are rounded to 3 decimals
        assert r["speedup"] == pytest.approx(r["dense_ms"] / r["fused_ms"], rel=0.02) and r["fused_frac_copy_bw"] > 0
        assert r["dense_copies"] >= 2 and r["packed_copies"] >= 2  # cold: rotating copies beyond the L3
    # same packed codes: the native kernel and the torch reference have the same error against SDPA
    for q in (1, 4):
        assert rows[q, "native-cpu"]["rel_err_vs_sdpa"] == pytest.approx(rows[q, "torch-reference"]["rel_err_vs_sdpa"],
                                                                          abs=1e-4)
        assert 0 <= rows[q, "native-cpu sparsev=0.001"]["sparsev_skipped_share"] <= 1
    assert "speedup" in proc.stdout and "fused % copy bw" in proc.stdout and "COLD" in proc.stdout


def test_decode_benchmark_at_a_shape_preset_fills_the_caches(tmp_path, script):
    out = tmp_path / "dec.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--shape", "smollm2", "--layers", "2",
           "--contexts", "300", "--new-tokens", "3", "--repeats", "1", "--policies", "turbo4", "--modes", "fused",
           "--threads", "1", "--json", str(out)]
    proc = script(cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["shape"] == "smollm2" and data["layers"] == 2 and data["intermediate_size"] == 1536
    (res,) = data["results"]
    (row,) = res["rows"]
    assert res["baseline"]["policy"] == "dynamic-cache" and row["mode"] == "fused" and row["fill"] == "random K/V"
    assert list(row["fused_impl"]) == ["native-cpu"] and row["fallbacks"] == {}
    # 2 layers x (K + V) x 3 KV heads x d64 at 300 filled + 1 warm-up + 3 timed tokens, fp16 basis
    assert row["dense_fp16_bytes"] == 2 * 2 * 3 * 64 * 304 * 2
    assert data["summary"][0]["fused_vs_dense"] == row["ratio_vs_dense"] > 0


def test_allocate_table_reads_a_committed_allocate_report():
    """The measured head allocation at 2.5 bits (committed JSON): its row, as docs/allocation.md shows it."""
    report = "benchmarks/results/allocate/i21/head-2.5bit.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "allocate_table.py"), report], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = proc.stdout.splitlines()[2]
    assert row.startswith("| 2.5 | head | 2.500 | 0.0412 | 0.0889 | 2.16 | 0.0331 | 0.80 | 0.0331 | 6/19 | 4/16 |")


def test_attention_dense16_benchmark_times_every_way_a_16_bit_cache_is_read(tmp_path, script):
    out = tmp_path / "att.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "attention_dense16.py"), "--contexts", "32", "--calls", "1",
           "--repeats", "1", "--json", str(out)]
    proc = script(cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [r["way"] for r in data["rows"]] == ["kernel, float16 rows as stored (dense-fp16-kernel)",
                                                "kernel, float32 rows", "upcast to float32 + SDPA (dense-fp16)"]
    assert data["rows"][0]["vs_fp16_kernel"] == 1.0 and data["threads"] == 1 and data["load_before"]


def test_attention_roofline_gives_each_ways_ratio_to_the_fp16_kernel_and_its_bandwidth_fraction(tmp_path):
    out = tmp_path / "roof.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "attention_roofline.py"), "--shapes", "smollm2,gemma3",
           "--contexts", "64", "--threads", "1", "--repeats", "1", "--cold-mib", "1", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    per_token = {(r["shape"], r["way"]): r["bytes_per_token"] for r in data["rows"]}
    # K + V of every KV head, norms included: smollm2 3 x d64, gemma3 1 x d256
    assert per_token[("smollm2", "fp16")] == 3 * 64 * 2 * 2
    assert per_token[("smollm2", "turbo4")] == 3 * (32 + 2) * 2
    assert per_token[("smollm2", "pcaq4")] == 3 * 32 + 3 * (32 + 2)
    assert per_token[("smollm2", "per-head")] == 2 * (34 + 18) + 24 + 26  # heads 0, 2: turbo4/2; head 1: pcaq3/turbo3
    assert per_token[("gemma3", "per-head")] == 130 + 66  # one KV head: the first group alone
    cell = data["summary"]["smollm2"]["64"]["1"]
    assert cell["fp16"]["time_vs_fp16"] == 1.0
    assert cell["turbo4"]["time_vs_fp16"] > 0 and 0 < cell["turbo4"]["frac_copy_bw"]
    assert data["copy_bandwidth_gbs"]["1"] > 0 and data["loadavg_before"] and data["cpu"]
    assert ("smollm2", "turbo4-int8") in per_token or "turbo4-int8" in data["skipped_ways"]
    # pcaq keys scored in 16 bits read the same bytes
    assert per_token.get(("smollm2", "pcaq4-int16")) == 3 * 32 + 3 * (32 + 2) or "pcaq4-int16" in data["skipped_ways"]


def test_step_cost_splits_a_fused_step_into_append_glue_kernel_and_the_rest(tmp_path):
    out = tmp_path / "step.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "step_cost.py"), "--model", "tiny-random", "--contexts", "24",
           "--steps", "2", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row, base = json.loads(out.read_text())["rows"]
    assert row["context"] == 24 and row["fused_impl"] == {"native-cpu": row["fused_impl"]["native-cpu"]}
    assert row["notes"] == []  # the step's new rows were packed in place, natively
    assert base["cache"] == "dense-fp16-kernel" and base["context"] == 24
    assert row["step_time_vs_baseline"] == round(row["total_ms_per_step"] / base["total_ms_per_step"], 3)
    for r in (row, base):
        parts = sum(r[f"{k}_ms_per_step"] for k in ("append", "glue", "kernel", "rest"))
        assert r["kernel_ms_per_step"] > 0 and r["append_ms_per_step"] > 0
        assert abs(parts - r["total_ms_per_step"]) < 0.01 + 0.05 * r["total_ms_per_step"]
