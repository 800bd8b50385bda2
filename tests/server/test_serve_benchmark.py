"""benchmarks/serve.py end to end: it spawns ``tqbench serve --model tiny``, runs, stops it, writes JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.server
ROOT = Path(__file__).resolve().parents[2]


def test_serve_benchmark_spawns_tiny_server(tmp_path):
    out = tmp_path / "serve.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--model", "tiny", "--requests", "6",
           "--concurrency", "3", "--max-tokens", "5", "--threads", "1", "--json", str(out),
           "--request-timeout", "600", "--time-limit", "3600"]  # ceilings for a slow machine, not limits
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["spawned"] and data["server"]["model"] == "tiny-random"
    assert (data["requests"], data["concurrency"], data["max_tokens"]) == (6, 3, 5)
    assert data["sent"] == data["completed"] == 6 and data["errors"] == {}
    assert all(r["completion_tokens"] == 5 and r["status"] == 200 for r in data["rows"])
    assert data["ttft_ms_p50"] > 0 and data["tpot_ms_p50"] > 0 and data["requests_per_s"] > 0
    assert "TTFT p50 ms" in proc.stdout and "wrote" in proc.stdout
