"""The validation suite's CLI on the tiny model: JSON and Markdown reports, gates and one-line bad-input errors."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tqbench.cli import main


def run(*args):
    return CliRunner().invoke(main, ["--headless", *args])


def one_line_error(r, text: str) -> None:
    assert r.exit_code == 2, (r.exit_code, r.output)
    lines = [x for x in r.stderr.splitlines() if x.strip() and "loaded in" not in x
             and not x.startswith("[transformers]")]  # the tokenizer's own length warning
    assert lines == [lines[0]] and lines[0].startswith("error: ") and text in lines[0], r.stderr
    assert "Traceback" not in r.output


@pytest.mark.parametrize("args,text", [
    (["validate", "--candidate", "turbo9"], "unknown policy preset 'turbo9': valid presets are"),
    (["validate", "--max-new-tokens", "0"], "--max-new-tokens=0 is invalid: ask for at least 1 token"),
    (["validate", "--prompt-file", "/nonexistent/p.txt"], "prompt file '/nonexistent/p.txt' does not exist"),
    (["validate", "--self-test", "--candidate", "turbo4"], "--self-test compares the baseline with itself"),
    (["validate", "--prompt", "x", "--prompt-file", "y"], "give either --prompt or --prompt-file, not both"),
    (["validate", "--corpus", "bread"], "--corpus only applies to --teacher-forced"),
    (["validate", "--prompt", "word " * 5000], "tiny-random has a context of 4096 tokens: no room is left for new tokens"),
    (["scan", "--layers", "0,9"], "layer index 9 is out of range for a model with 4 layers"),
    (["scan", "--codecs", "int8,int3"], "unknown codec 'int3': valid codecs are"),
    (["compare-policies", "--policies", "turbo4,bogus"], "unknown policy preset 'bogus'"),
    (["niah", "--depths", "0.5,2"], "--depths '0.5,2' is invalid"),
    (["niah", "--policies", "fp16"], "policy 'fp16' is the baseline"),
    (["kv-estimate", "--model", "gpt-9"], "unknown model 'gpt-9' for kv-estimate"),
    (["kv-estimate", "--layers", "32"], "needs all three of --layers, --kv-heads and --head-dim"),
    (["kv-estimate", "--model", "default", "--layers", "2", "--kv-heads", "1", "--head-dim", "8"],
     "give either --model or --layers/--kv-heads/--head-dim"),
    (["kv-estimate", "--memory-budget", "lots"], "memory budget 'lots' is invalid"),
])
def test_bad_input_is_one_line_exit_2(args, text):
    if args[0] not in ("kv-estimate",):
        args = [*args, "--model", "tiny"]
    one_line_error(run(*args), text)


def test_validate_self_test_json_and_markdown(tmp_path):
    md, js = tmp_path / "v.md", tmp_path / "v.json"
    r = run("validate", "--model", "tiny", "--self-test", "--max-new-tokens", "5", "--prompt", "hello",
            "--report-json", str(js), "--report-md", str(md), "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d == json.loads(js.read_text())
    assert d["quality_verdict"] == "exact-match" and d["passed"]
    assert "# Validation self-test" in md.read_text() and "**verdict: exact-match**" in md.read_text()


@pytest.mark.parametrize("candidate,verdict,code", [
    ("fp16", "exact-match", 0),  # the baseline against itself: identical tokens, the gate passes
    ("turbo2", "prefix-stable-then-diverged", 1),  # 2-bit K/V on the tiny model: diverges within 12 tokens
])
def test_validate_gate_exit_code_follows_the_verdict(candidate, verdict, code):
    r = run("validate", "--model", "tiny", "--candidate", candidate, "--max-new-tokens", "12", "--prompt",
            "The lighthouse", "--json", "--no-per-step")
    d = json.loads(r.stdout)
    assert d["per_step"] is None
    assert (d["quality_verdict"], d["passed"], r.exit_code) == (verdict, code == 0, code), r.stderr
    gate = f"gate failed: verdict {verdict} (needs exact-match or near-stable at --quality-threshold 0.9)"
    assert (gate in r.stderr) == (code == 1), r.stderr


def test_teacher_forced_and_compare_and_scan_cli(tmp_path):
    r = run("validate", "--model", "tiny", "--teacher-forced", "--corpus", "rivers", "--tf-context", "32",
            "--tf-tokens", "8", "--candidate", "turbo4", "--json", "--max-kl", "100")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["steps"] == 8 and d["results"][0]["kv_policy"] == "turbo4"
    r = run("validate", "--model", "tiny", "--teacher-forced", "--corpus", "rivers", "--tf-context", "32",
            "--tf-tokens", "8", "--max-kl", "0")
    assert r.exit_code == 1 and "gate failed: teacher-forced mean KL" in r.stderr
    r = run("compare-policies", "--model", "tiny", "--policies", "q8k-q8v", "--prompt", "hi", "--max-new-tokens",
            "4", "--summary-only")
    assert r.exit_code == 0, r.output
    assert "recommended on too little evidence: q8k-q8v (" in r.stdout and "verdict" not in r.stdout
    assert "caveat: evidence: 1 prompt x 4 tokens; too little to call it safe" in r.stdout
    js = tmp_path / "scan.json"
    r = run("scan", "--model", "tiny", "--layers", "-1", "--codecs", "int8,turbo3", "--max-prompt-tokens", "32",
            "--report-json", str(js), "--summary-table")
    assert r.exit_code == 0, r.output
    d = json.loads(js.read_text())
    assert d["layers"] == [3] and set(d["metrics"]["softmax_kl"]) == {"int8", "turbo3"}
    assert "suggested policy:" in r.stdout


def test_kv_estimate_cli_exact_bytes_and_budget_gate():
    r = run("kv-estimate", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--seq-len", "32768",
            "--kv-policy", "fp16,turbo4", "--json")
    assert r.exit_code == 0, r.output
    rows = {x["kv_policy"]: x for x in json.loads(r.stdout)["rows"]}
    assert rows["fp16"]["total_bytes"] == 4_294_967_296 and rows["turbo4"]["total_bytes"] == 1_109_438_528
    r = run("kv-estimate", "--model", "Llama-3.1-8B", "--seq-len", "131072", "--kv-policy", "fp16,turbo3",
            "--memory-budget", "8GiB")
    assert r.exit_code == 1 and "gate failed: fp16 do(es) not fit 8GiB at 131072 tokens" in r.stderr
    assert "turbo3" in r.stdout


def test_validation_benchmark_quick_on_tiny(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, str(root / "benchmarks" / "validation.py"), "--model", "tiny", "--quick", "--threads", "1",
           "--policies", "turbo4;q8k-q8v", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cmp = json.loads((tmp_path / "validation-compare.json").read_text())
    tf = json.loads((tmp_path / "validation-teacher-forced.json").read_text())
    assert [r["policy"] for r in cmp["rows"]] == ["turbo4", "q8k-q8v"] and cmp["threads"] == 1
    assert [r["kv_policy"] for r in tf["results"]] == ["turbo4", "q8k-q8v"] and tf["steps"] == 16
    for key in ("command", "loadavg_before", "torch", "seconds"):
        assert cmp[key] and tf[key], key
    assert (tmp_path / "validation-compare.md").read_text().startswith("# compare-policies")
