"""Serve soak: N requests against one ``tqbench serve``, sampling the server's RSS throughout; nothing may grow.

``python benchmarks/serve_soak.py [--model default] [--requests 1000] [--threads 1]`` starts
``python -m tqbench serve`` on a free loopback port with ``--kv-policy`` (default: a saved allocate artifact for
the default model, the shipped ``smollm2-alloc-3.5bit``) and sends requests one after another, cycling through
a mix: cache modes (``--modes``, default compressed and fused, sent as the ``cache_mode`` extension), policies
(the server's default = the artifact, a preset, a compact string, and ``--extra-policy`` values), stream and
non-stream, and every ``--disconnect-every``-th streamed request is dropped by the client after its first
content chunk. After each request it reads the server's RSS from ``/proc/<pid>/status`` (VmRSS).
``--shared-prefix WORDS`` starts every request with a system message of that many words, named as the shared
prefix (``cache_prefix: true``: compressed once, read by the others), cycling through ``--prefixes`` different
ones under the server's ``--prefix-cache`` cap (a cap below their total evicts); the prefix cache's entries,
bytes, hits and evictions from ``/health`` are reported at the end.

Reports: RSS after the warm-up (``--warmup`` requests), at the end, the growth over the run, and the least-squares
slope in MB per request after the warm-up; writes JSON (default ``benchmarks/results/serve_soak.json``) with every
sample. ``--max-slope-mb`` makes it exit 1 when the slope is above the bound (the test runs it so).
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

from _common import cpu_model, write_json

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Say hello.", "Name three colours.", "What is a KV cache?", "Count to five.",
           "Describe the sea in one sentence.", "Why do leaves fall?"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=20, help="requests before the RSS baseline")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-policy", default="smollm2-alloc-3.5bit",
                   help="the server's default policy: a saved allocate artifact (name or .toml path)")
    p.add_argument("--modes", default="compressed,fused", help="cache modes to cycle through (comma list)")
    p.add_argument("--policies", default="default;turbo4;k=turbo3,v=turbo4,recent=8",
                   help="policies to cycle through, separated by ';' (compact policies hold commas); 'default' "
                        "sends none (the server's --kv-policy)")
    p.add_argument("--disconnect-every", type=int, default=7, help="drop every N-th streamed request mid-stream")
    p.add_argument("--max-slope-mb", type=float, default=None, help="exit 1 when the MB/request slope is above")
    p.add_argument("--shared-prefix", type=int, default=0, help="words of a shared system prefix (0: none)")
    p.add_argument("--prefixes", type=int, default=1, help="different shared prefixes to cycle through")
    p.add_argument("--prefix-cache", default="256MiB", help="the server's --prefix-cache")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "serve_soak.json"))
    a = p.parse_args(argv)
    a.mode_list = [m for m in a.modes.split(",") if m]
    a.policy_list = [x.strip() for x in a.policies.split(";") if x.strip()]
    if a.requests < a.warmup + 10 or not a.mode_list or not a.policy_list:
        p.error("need --requests >= --warmup + 10, a --modes list and a --policies list")
    return a


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(a) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = [sys.executable, "-m", "tqbench", "serve", "--model", a.model, "--kv-policy", a.kv_policy,
           "--cache-mode", a.mode_list[0], "--threads", str(a.threads), "--port", str(port),
           "--max-new-tokens", str(a.max_tokens), "--log-level", "warning", "--prefix-cache", a.prefix_cache]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + a.start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, port
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not answer /health in time")


def one_request(port: int, i: int, a) -> dict:
    """Request ``i`` of the mix; returns what happened (status, mode, policy, stream, dropped)."""
    mode = a.mode_list[i % len(a.mode_list)]
    policy = a.policy_list[(i // len(a.mode_list)) % len(a.policy_list)]
    stream = (i // (len(a.mode_list) * len(a.policy_list))) % 2 == 1
    drop = stream and a.disconnect_every > 0 and i % a.disconnect_every == 0
    body = {"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "max_tokens": a.max_tokens,
            "cache_mode": mode, "ignore_eos": True, "stream": stream}
    if a.shared_prefix:
        words = " ".join(f"fact{(i % a.prefixes) * 7 + k}" for k in range(a.shared_prefix))
        body["messages"].insert(0, {"role": "system", "content": f"Context {i % a.prefixes}: {words}"})
        body["cache_prefix"] = True
    if policy != "default":
        body["kv_policy"] = policy
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=a.request_timeout)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        status = resp.status
        if drop and status == 200:
            while True:  # read until the first content chunk, then hang up
                line = resp.fp.readline()
                if not line or b'"content"' in line and b'"content": ""' not in line:
                    break
            conn.sock.close()
        else:
            raw = resp.read()
            if status != 200:
                raise RuntimeError(f"request {i} ({mode}, {policy}, stream={stream}) got {status}: {raw[:300]!r}")
    finally:
        conn.close()
    return {"i": i, "mode": mode, "policy": policy, "stream": stream, "dropped": drop, "status": status}


def slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def main(argv=None) -> int:
    a = parse_args(argv)
    load_before = os.getloadavg()
    proc, port = spawn(a)
    samples: list[tuple[int, float]] = []
    rows = []
    t0 = time.perf_counter()
    try:
        samples.append((0, rss_mb(proc.pid)))
        for i in range(a.requests):
            rows.append(one_request(port, i, a))
            samples.append((i + 1, rss_mb(proc.pid)))
            if (i + 1) % 50 == 0:
                print(f"{i + 1:5d} requests  RSS {samples[-1][1]:8.1f} MB", flush=True)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("GET", "/health")
        prefix = json.loads(conn.getresponse().read()).get("prefix_cache") or {}
        prefix.pop("prefixes", None)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
    seconds = time.perf_counter() - t0
    after = [(n, r) for n, r in samples if n >= a.warmup]
    base, end = after[0][1], after[-1][1]
    per_request = slope([n for n, _ in after], [r for _, r in after])
    peak = max(r for _, r in samples)
    out = {
        "benchmark": "serve_soak", "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "model": a.model, "requests": a.requests, "warmup": a.warmup, "max_tokens": a.max_tokens,
        "threads": a.threads, "kv_policy": a.kv_policy, "modes": a.mode_list, "policies": a.policy_list,
        "disconnect_every": a.disconnect_every, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "cpu": cpu_model(), "python": platform.python_version(), "seconds": round(seconds, 1),
        "rss_after_warmup_mb": round(base, 1), "rss_end_mb": round(end, 1), "rss_peak_mb": round(peak, 1),
        "rss_growth_after_warmup_mb": round(end - base, 1), "slope_mb_per_request": round(per_request, 4),
        "dropped": sum(r["dropped"] for r in rows), "streamed": sum(r["stream"] for r in rows),
        "shared_prefix_words": a.shared_prefix, "prefixes": a.prefixes, "prefix_cache": prefix,
        "samples": samples,
    }
    print(f"{'requests':>9} {'warm-up':>8} {'RSS@warm MB':>12} {'RSS end MB':>11} {'growth MB':>10} "
          f"{'MB/request':>11} {'dropped':>8} {'threads':>8} {'load':>6}")
    print(f"{a.requests:>9} {a.warmup:>8} {base:>12.1f} {end:>11.1f} {end - base:>10.1f} {per_request:>11.4f} "
          f"{out['dropped']:>8} {a.threads:>8} {load_before[0]:>6.2f}")
    if a.shared_prefix:
        print(f"prefix cache: {prefix.get('entries')} entries, {prefix.get('bytes')} of {prefix.get('cap_bytes')} "
              f"bytes; {prefix.get('hits')} hits, {prefix.get('misses')} misses, {prefix.get('evicted')} evicted")
    write_json(a.json, out)
    if a.max_slope_mb is not None and per_request > a.max_slope_mb:
        print(f"FAIL: RSS grows {per_request:.3f} MB per request after the warm-up (bound {a.max_slope_mb})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
