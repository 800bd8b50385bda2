"""``benchmarks/gpu_check.sh`` dry-runs on CPU at tiny sizes (Triton interpreter), so it cannot rot before a GPU
is lent: every step runs, every file it promises is written, and the Triton rows agree with the torch reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed: gpu_check.sh's dry run needs its interpreter "
                                     "(`pip install triton`)")

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_writes_every_file(tmp_path):
    env = os.environ | {"GPU_CHECK_DRY_RUN": "1", "GPU_CHECK_OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    steps = [line.split("\t") for line in (tmp_path / "gpu-steps.tsv").read_text().splitlines()]
    assert [(s[0], s[1]) for s in steps] == [("kernel-tests", "0"), ("attention", "0"), ("decode", "0")]

    suite = ET.parse(tmp_path / "gpu-kernel-tests.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert int(suite.get("tests")) >= 4 and int(suite.get("failures")) == int(suite.get("errors")) == 0
    assert int(suite.get("skipped")) == 0

    att = json.loads((tmp_path / "gpu-attention-llama3-8b.json").read_text())
    assert att["impls"] == ["torch-reference", "triton"] and att["copy_bandwidth_gbs"] > 0
    rows = {(r["codec"], r["queries"], r["impl"]): r for r in att["rows"]}
    assert len(rows) == 2 * 2 * 2
    for codec in ("turbo4:turbo4", "turbo2:turbo2"):
        for q in (1, 4):
            tri, ref = rows[codec, q, "triton"], rows[codec, q, "torch-reference"]
            # same codes, same math: the interpreted kernel's error against SDPA is the reference's
            assert tri["rel_err_vs_sdpa"] == pytest.approx(ref["rel_err_vs_sdpa"], abs=1e-4)
            assert tri["fused_ms"] > 0 and tri["packed_bytes"] == ref["packed_bytes"] > 0
            frac = tri["packed_bytes"] / tri["fused_ms"] * 1e-6 / att["copy_bandwidth_gbs"]
            assert tri["fused_frac_copy_bw"] == pytest.approx(frac, abs=2e-3)

    dec = json.loads((tmp_path / "gpu-decode-default.json").read_text())
    (res,) = dec["results"]
    assert res["baseline"]["mode"] == "dynamic" and [r["mode"] for r in res["rows"]] == ["fused"]
    assert res["rows"][0]["decode_tok_s"] > 0

    md = (tmp_path / "gpu-check.md").read_text()
    assert md.startswith(f"# gpu_check on {att['device_name']} (DRY RUN")
    assert "| kernel-tests | 0 |" in md and "| attention | 0 |" in md and "| decode | 0 |" in md
    assert f"{suite.get('tests')} tests, 0 failures, 0 errors" in md
    assert "| 1 | 256 | 4 | turbo2:turbo2 | triton |" in md
    summary = json.loads((tmp_path / "gpu-check.json").read_text())
    assert summary["dry_run"] is True and summary["attention_rows"] == 8
