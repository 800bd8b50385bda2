"""benchmarks/serve_soak.py, short: 100 requests on the tiny model mixing cache modes (compressed, fused),
policies (a saved allocate-style artifact as the server's default, a preset, a compact string), stream and
non-stream, and client disconnects mid-stream; the server's RSS slope after the warm-up must stay far below
1 MB per request (a leak of 1 MB per request measured 1.0 MB/request and failed it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.server
ROOT = Path(__file__).resolve().parents[2]
MAX_SLOPE_MB = 0.25  # per request, least squares over requests 20-100

ARTIFACT = """format = "tqbench-policy/1"

[policy]
k = "turbo4"
v = "turbo3"
sink = 2
recent = 4
overrides = [
    { role = "k", layers = "0", codec = "turbo2" },
    { role = "v", layers = "3", codec = "turbo4" },
]
name = "tiny-alloc"

[model]
name = "tiny-random"
num_layers = 4
kv_heads = 2
head_dim = 16
"""


def test_soak_rss_stays_flat(tmp_path):
    artifact = tmp_path / "tiny-alloc.toml"
    artifact.write_text(ARTIFACT)
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve_soak.py"), "--model", "tiny", "--requests", "100",
           "--warmup", "20", "--max-tokens", "4", "--kv-policy", str(artifact), "--json", str(out),
           "--max-slope-mb", str(MAX_SLOPE_MB)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert out.exists(), proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert proc.returncode == 0, f"RSS slope {data['slope_mb_per_request']} MB/request\n{proc.stdout[-2000:]}"
    assert data["requests"] == 100 and len(data["samples"]) == 101
    assert data["modes"] == ["compressed", "fused"] and data["dropped"] >= 5 and data["streamed"] >= 40
    assert data["slope_mb_per_request"] <= MAX_SLOPE_MB
