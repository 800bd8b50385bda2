"""Serve benchmark: N streaming chat requests at concurrency C against a ``tqbench serve`` on loopback.

``python benchmarks/serve.py [--requests 16] [--concurrency 4] [--max-tokens 32] [--threads 1]`` starts
``python -m tqbench serve`` itself on a free loopback port (``--model``, ``--kv-policy``, ``--cache-mode``),
waits for ``/health``, runs, stops it; ``--url http://127.0.0.1:8000`` measures a server that is already
running instead. Bounded: at most ``--requests`` requests, none started after ``--time-limit`` seconds.
Prints requests/s, TTFT (time to the first content chunk) and time per output token (after the first)
p50/p95, and errors by status; writes JSON (default ``benchmarks/results/serve.json``).
``ignore_eos`` is sent so every request generates exactly ``--max-tokens`` tokens.

Sweep: ``--concurrency 1,4,8 --kv-policy fp16,turbo4`` runs every concurrency against one spawned server per
policy (the first concurrency's tokens are each prompt's reference: with concurrency 1 that is the solo run)
and adds, per run, the aggregate decode tokens/s from the server's ``/metrics`` (decode rows per second of
decode forward calls), the mean batch size, the peak resident KV bytes of all running requests (``/metrics``,
polled), each request's resident KV bytes (its cache report), the share of requests whose tokens equal the
reference, and each run's speed-up over the first concurrency.
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
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

from _common import cpu_model, write_json

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "Explain in a few sentences why the sky is blue.",
    "Give me three tips for writing clear code.",
    "What is a KV cache in a transformer?",
    "Describe a quiet morning in a small town.",
]



def stop_server(proc) -> None:
    """Terminate a server this script started (kill it if it does not stop within 15 s)."""
    if proc is None:
        return
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="a running server (default: start one on a free loopback port)")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", default="4", help="one number, or a comma list to sweep (1,4,8)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--time-limit", type=float, default=600.0, help="start no request after this many seconds")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--start-timeout", type=float, default=600.0,
                   help="seconds to wait for the spawned server's /health (a loaded machine loads slowly)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--request-kv-policy", default=None, help="send this kv_policy extension with every request")
    p.add_argument("--model", default="default", help="for the spawned server")
    p.add_argument("--kv-policy", default="turbo4",
                   help="for the spawned server; a comma list sweeps policies; POLICY:MODE picks the cache mode per "
                        "cell (fp16:compressed,turbo4:compressed,turbo4:fused)")
    p.add_argument("--cache-mode", default="compressed", help="for the spawned server")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the spawned server")
    p.add_argument("--max-queue", type=int, default=None, help="spawned server's queue (default: --concurrency)")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "serve.json"))
    p.add_argument("--max-batch", type=int, default=None, help="spawned server's --max-batch (default: its own)")
    p.add_argument("--prefill-chunk", type=int, default=0, help="spawned server's --prefill-chunk")
    p.add_argument("--prompt-tokens", type=int, default=0,
                   help="send prompts of exactly N tokens (corpus text, tokenized by the server's /tokenize) to "
                        "/v1/completions instead of the short chat prompts")
    p.add_argument("--kv-budget", default=None, help="spawned server's --kv-budget (e.g. 256MiB)")
    a = p.parse_args(argv)
    try:
        a.concurrencies = [int(c) for c in str(a.concurrency).split(",")]
    except ValueError:
        p.error(f"--concurrency {a.concurrency!r}: give a number or a comma list such as 1,4,8")
    a.policies = [x for x in a.kv_policy.split(",") if x]
    if a.requests < 1 or min(a.concurrencies) < 1 or a.max_tokens < 2 or not a.policies:
        p.error("need --requests >= 1, --concurrency >= 1, --max-tokens >= 2, a --kv-policy")
    if a.url and len(a.policies) > 1:
        p.error("--url measures one running server: give one --kv-policy (or none)")
    a.concurrency = a.concurrencies[0]
    return a




def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, int(round(q / 100 * len(ordered) + 0.5)) - 1))
    return ordered[k]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(host: str, port: int, path: str, headers: dict, timeout: float = 5.0):
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def cell(spec: str, default_mode: str) -> tuple[str, str]:
    """``POLICY[:MODE]`` -> (policy, mode)."""
    policy, _, mode = spec.partition(":")
    return policy, mode or default_mode


def spawn_server(a, policy: str | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    policy, mode = cell(policy or a.policies[0], a.cache_mode)
    cmd = [sys.executable, "-m", "tqbench", "serve", "--model", a.model, "--kv-policy", policy,
           "--cache-mode", mode, "--threads", str(a.threads), "--port", str(port),
           "--max-new-tokens", str(max(a.max_tokens, 1)),
           "--max-queue", str(a.max_queue or max(a.concurrencies)), "--log-level", "warning"]
    if a.max_batch:
        cmd += ["--max-batch", str(a.max_batch)]
    if getattr(a, "kv_budget", None):
        cmd += ["--kv-budget", a.kv_budget]
    if getattr(a, "prefill_chunk", 0):
        cmd += ["--prefill-chunk", str(a.prefill_chunk)]
    if a.api_key:
        cmd += ["--api-key", a.api_key]
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log, text=True)
    deadline = time.monotonic() + a.start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise SystemExit(f"error: the server exited ({proc.returncode}): {log.read()[-2000:]}")
        try:
            if get_json("127.0.0.1", port, "/health", {})[0] == 200:
                return proc, f"http://127.0.0.1:{port}"
        except OSError:
            pass
        time.sleep(0.25)
    proc.terminate()
    raise SystemExit(f"error: the spawned server did not answer /health within {a.start_timeout:.0f} s")


def one_request(host: str, port: int, i: int, a, headers: dict) -> dict:
    body = {
        "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
        "max_tokens": a.max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    path = "/v1/chat/completions"
    if getattr(a, "token_prompts", None):
        del body["messages"]
        body["prompt"] = a.token_prompts[i % len(a.token_prompts)]
        path = "/v1/completions"
    if a.request_kv_policy:
        body["kv_policy"] = a.request_kv_policy
    row = {"index": i, "prompt": i % len(getattr(a, "token_prompts", None) or PROMPTS), "status": None, "ttft_s": None, "tpot_s": None,
           "queue_s": None, "completion_tokens": 0, "token_ids": None, "resident_kv_bytes": None, "error": None}
    start = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=a.request_timeout)
    try:
        conn.request("POST", path, body=json.dumps(body), headers=headers)
        resp = conn.getresponse()
        row["status"] = resp.status
        if resp.status != 200:
            err = json.loads(resp.read() or b"{}").get("error", {})
            row["error"] = err.get("message", "")
            return row
        first = last = None
        while True:
            line = resp.readline()
            if not line:
                break
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                break
            event = json.loads(payload)
            if "error" in event:
                row["error"] = event["error"].get("message")
                continue
            if event.get("usage"):
                row["completion_tokens"] = event["usage"]["completion_tokens"]
            if event.get("tqbench"):
                row["queue_s"] = event["tqbench"]["queue_seconds"]
                row["token_ids"] = event["tqbench"]["token_ids"]
                report = event["tqbench"].get("cache_report") or {}
                row["resident_kv_bytes"] = report.get("resident_decode_bytes")
            choice = event["choices"][0] if event.get("choices") else {}
            if choice.get("delta", {}).get("content") or choice.get("text"):
                last = time.perf_counter()
                first = first or last
        if first is not None:
            row["ttft_s"] = first - start
            n = row["completion_tokens"]
            if n > 1 and last > first:
                row["tpot_s"] = (last - first) / (n - 1)
    except OSError as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        row["elapsed_s"] = time.perf_counter() - start
        conn.close()
    return row


def scrape(host: str, port: int, headers: dict) -> dict[str, float]:
    """The unlabelled samples of ``/metrics`` (name -> value)."""
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request("GET", "/metrics", headers=headers)
        resp = conn.getresponse()
        text = resp.read().decode()
        if resp.status != 200:
            return {}
    finally:
        conn.close()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            if "{" in name:  # labelled samples (per kv_policy): summed under the bare name
                bare = name.split("{", 1)[0]
                out[bare] = out.get(bare, 0.0) + float(value)
            else:
                out[name] = float(value)
    return out


def rss_mb(pid: int | None) -> float:
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def token_prompts(host: str, port: int, n_tokens: int, count: int, headers: dict) -> list[list[int]]:
    """``count`` different prompts of exactly ``n_tokens`` tokens from the shipped corpus (the server tokenizes)."""
    corpus = ROOT / "tqbench" / "data" / "corpus"
    text = "\n\n".join(p.read_text() for p in sorted(corpus.glob("*.txt")))
    conn = http.client.HTTPConnection(host, port, timeout=120)
    try:
        conn.request("POST", "/tokenize", body=json.dumps({"prompt": text}), headers=headers)
        ids = json.loads(conn.getresponse().read())["tokens"]
    finally:
        conn.close()
    while len(ids) < n_tokens + count * 97:
        ids = ids + ids
    return [ids[k * 97 : k * 97 + n_tokens] for k in range(count)]


def run(a, url: str, concurrency: int | None = None) -> tuple[list[dict], float]:
    parsed = urllib.parse.urlparse(url)
    host, port = parsed.hostname, parsed.port or 80
    headers = {"Content-Type": "application/json"}
    if a.api_key:
        headers["Authorization"] = f"Bearer {a.api_key}"
    rows: list[dict] = []
    counter = iter(range(a.requests))
    lock = threading.Lock()
    start = time.perf_counter()

    def client() -> None:
        while time.perf_counter() - start < a.time_limit:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            row = one_request(host, port, i, a, headers)
            with lock:
                rows.append(row)

    threads = [threading.Thread(target=client) for _ in range(concurrency or a.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(rows, key=lambda r: r["index"]), time.perf_counter() - start


def summarize(rows: list[dict], wall: float) -> dict:
    ok = [r for r in rows if r["status"] == 200 and r["error"] is None and r["ttft_s"] is not None]
    ttft = [r["ttft_s"] for r in ok]
    tpot = [r["tpot_s"] for r in ok if r["tpot_s"] is not None]
    queue = [r["queue_s"] for r in ok if r["queue_s"] is not None]
    errors: dict[str, int] = {}
    for r in rows:
        if r not in ok:
            key = str(r["status"] or "connection")
            errors[key] = errors.get(key, 0) + 1
    out_tokens = sum(r["completion_tokens"] for r in ok)

    def ms(v):
        return None if v is None else round(v * 1000, 1)

    return {
        "sent": len(rows), "completed": len(ok), "errors": errors, "wall_s": round(wall, 3),
        "requests_per_s": round(len(ok) / wall, 4) if wall > 0 else 0.0,
        "output_tokens_per_s": round(out_tokens / wall, 2) if wall > 0 else 0.0,
        "ttft_ms_p50": ms(pct(ttft, 50)), "ttft_ms_p95": ms(pct(ttft, 95)),
        "tpot_ms_p50": ms(pct(tpot, 50)), "tpot_ms_p95": ms(pct(tpot, 95)),
        "queue_ms_p50": ms(pct(queue, 50)),
    }


def sweep_level(a, url: str, concurrency: int, auth: dict, pid: int | None = None) -> dict:
    """One concurrency against a running server: the summary plus the server-side decode figures."""
    parsed = urllib.parse.urlparse(url)
    host, port = parsed.hostname, parsed.port or 80
    before = scrape(host, port, auth)
    peak = {"kv": 0.0, "batch": 0.0, "rss": rss_mb(pid), "running": 0.0}
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(0.25):
            try:
                m = scrape(host, port, auth)
            except OSError:
                continue
            peak["kv"] = max(peak["kv"], m.get("tqbench_kv_resident_bytes", 0.0))
            peak["batch"] = max(peak["batch"], m.get("tqbench_batch_size", 0.0))
            peak["running"] = max(peak["running"], m.get("tqbench:num_requests_running", 0.0))
            peak["rss"] = max(peak["rss"], rss_mb(pid))

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    load_before = os.getloadavg()
    rows, wall = run(a, url, concurrency)
    load_after = os.getloadavg()
    stop.set()
    poller.join()
    after = scrape(host, port, auth)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    rows_decoded, decode_s, steps = delta("tqbench_decode_rows_total"), delta("tqbench_decode_seconds_total"), \
        delta("tqbench_decode_steps_total")
    resident = [r["resident_kv_bytes"] for r in rows if r["resident_kv_bytes"] is not None]
    return {"concurrency": concurrency, **summarize(rows, wall),
            "decode_tokens_per_s": round(rows_decoded / decode_s, 2) if decode_s > 0 else None,
            "mean_batch": round(rows_decoded / steps, 2) if steps else None, "peak_batch": int(peak["batch"]),
            "peak_resident_kv_bytes": int(peak["kv"]), "peak_running": int(peak["running"]),
            "peak_rss_mb": round(peak["rss"], 1),
            "latency_ms_p50": _ms(pct([r["elapsed_s"] for r in rows if r["status"] == 200], 50)),
            "latency_ms_p95": _ms(pct([r["elapsed_s"] for r in rows if r["status"] == 200], 95)),
            "request_resident_kv_bytes_p50": pct(resident, 50),
            "loadavg_before": list(load_before), "loadavg_after": list(load_after), "rows": rows}


def main_sweep(a) -> int:
    auth = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    runs, servers = [], {}
    for policy in a.policies:
        proc, url = (None, a.url) if a.url else spawn_server(a, policy)
        try:
            parsed = urllib.parse.urlparse(url)
            _, health = get_json(parsed.hostname, parsed.port or 80, "/health", auth)
            servers[policy] = health
            if a.prompt_tokens:
                a.token_prompts = token_prompts(parsed.hostname, parsed.port or 80, a.prompt_tokens,
                                                max(a.concurrencies), {"Content-Type": "application/json", **auth})
            reference: dict[int, list] = {}
            for c in a.concurrencies:
                r = sweep_level(a, url, c, auth, proc.pid if proc else None)
                r["kv_policy"] = f"{health.get('kv_policy')}:{health.get('cache_mode')}"
                for row in r["rows"]:
                    if row["token_ids"] is not None:
                        reference.setdefault(row["prompt"], row["token_ids"])
                same = [row["token_ids"] == reference.get(row["prompt"]) for row in r["rows"]
                        if row["token_ids"] is not None]
                r["same_tokens_as_reference"] = f"{sum(same)}/{len(same)}"
                flips = [_first_diff(row["token_ids"], reference[row["prompt"]]) for row in r["rows"]
                         if row["token_ids"] is not None and row["token_ids"] != reference.get(row["prompt"])]
                r["first_divergence_steps"] = flips
                runs.append(r)
                write_json(a.json + ".partial", {"benchmark": "serve-sweep (partial)", "runs": runs})
                print(f"  {policy} c={c}: {r['completed']}/{r['sent']} ok, decode {r['decode_tokens_per_s']} tok/s, "
                      f"mean batch {r['mean_batch']}, same tokens {r['same_tokens_as_reference']}", flush=True)
        finally:
            stop_server(proc)
    base = {}
    for r in runs:
        b = base.setdefault(r["kv_policy"], r)
        r["decode_speedup"] = round(r["decode_tokens_per_s"] / b["decode_tokens_per_s"], 2) \
            if r["decode_tokens_per_s"] and b["decode_tokens_per_s"] else None
        r["output_speedup"] = round(r["output_tokens_per_s"] / b["output_tokens_per_s"], 2) \
            if b["output_tokens_per_s"] else None
    any_health = next(iter(servers.values()))
    print(f"tqbench serve sweep: {any_health.get('model')} ({any_health.get('cache_mode')}), {a.requests} requests x "
          f"{a.max_tokens} tokens per run, server threads {a.threads if not a.url else 'n/a (external)'}")
    header = ("policy:mode", "conc", "done", "out tok/s", "decode tok/s", "x c1", "batch", "at once",
              "latency p50/p95 ms", "TTFT p50/p95 ms", "TPOT p50/p95 ms", "KV peak KiB", "KV/req KiB",
              "RSS peak MB", "same tokens", "errors")
    table = []
    for r in runs:
        kv_req = r["request_resident_kv_bytes_p50"]
        table.append((r["kv_policy"], r["concurrency"], f"{r['completed']}/{r['sent']}", r["output_tokens_per_s"],
                      r["decode_tokens_per_s"], r["decode_speedup"], r["mean_batch"], r["peak_running"],
                      f"{r['latency_ms_p50']}/{r['latency_ms_p95']}", f"{r['ttft_ms_p50']}/{r['ttft_ms_p95']}", f"{r['tpot_ms_p50']}/{r['tpot_ms_p95']}",
                      round(r["peak_resident_kv_bytes"] / 1024, 1), round(kv_req / 1024, 1) if kv_req else None,
                      r["peak_rss_mb"], r["same_tokens_as_reference"],
                      ", ".join(f"{k} x{v}" for k, v in sorted(r["errors"].items())) or "none"))
    widths = [max(len(str(h)), *(len(str(t[i])) for t in table)) for i, h in enumerate(header)]
    print("  ".join(str(h).rjust(w) for h, w in zip(header, widths)))
    for t in table:
        print("  ".join(str(v).rjust(w) for v, w in zip(t, widths)))
    print(f"load average {runs[0]['loadavg_before'][0]:.2f} -> {runs[-1]['loadavg_after'][0]:.2f} (1 min), "
          f"{cpu_model()}, {os.cpu_count()} CPUs")
    payload = {
        "benchmark": "serve-sweep", "command": [sys.executable, *sys.argv],
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "servers": servers, "requests": a.requests, "prompt_tokens": a.prompt_tokens, "kv_budget": a.kv_budget, "concurrencies": a.concurrencies, "max_tokens": a.max_tokens,
        "server_threads": a.threads if not a.url else None, "python": platform.python_version(),
        "cpu": cpu_model(), "cpus": os.cpu_count(), "runs": runs,
    }
    write_json(a.json, payload)
    return 0 if all(r["completed"] == r["sent"] for r in runs) else 1


def _ms(v):
    return None if v is None else round(v * 1000, 1)


def _first_diff(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv=None) -> int:
    a = parse_args(argv)
    if len(a.concurrencies) > 1 or len(a.policies) > 1:
        return main_sweep(a)
    proc = None
    url = a.url
    if url is None:
        proc, url = spawn_server(a)
    try:
        parsed = urllib.parse.urlparse(url)
        auth = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
        _, health = get_json(parsed.hostname, parsed.port or 80, "/health", auth)
        load_before = os.getloadavg()
        rows, wall = run(a, url)
        load_after = os.getloadavg()
    finally:
        stop_server(proc)
    summary = summarize(rows, wall)
    print(f"tqbench serve benchmark: {health.get('model')} kv_policy {a.request_kv_policy or health.get('kv_policy')} "
          f"({health.get('cache_mode')}), {a.requests} requests x {a.max_tokens} tokens at concurrency "
          f"{a.concurrency}, server threads {a.threads if proc else 'n/a (external)'}")
    header = ("completed", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p95 ms", "TPOT p50 ms", "TPOT p95 ms",
              "queued p50 ms", "errors")
    values = (f"{summary['completed']}/{summary['sent']}", f"{summary['requests_per_s']:.3f}",
              f"{summary['output_tokens_per_s']:.1f}", summary["ttft_ms_p50"], summary["ttft_ms_p95"],
              summary["tpot_ms_p50"], summary["tpot_ms_p95"], summary["queue_ms_p50"],
              ", ".join(f"{k} x{v}" for k, v in sorted(summary["errors"].items())) or "none")
    widths = [max(len(h), len(str(v))) for h, v in zip(header, values)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    print("  ".join(str(v).rjust(w) for v, w in zip(values, widths)))
    print(f"wall {summary['wall_s']:.1f}s; load average {load_before[0]:.2f} -> {load_after[0]:.2f} (1 min), "
          f"{cpu_model()}, {os.cpu_count()} CPUs")
    payload = {
        "benchmark": "serve",
        "command": [sys.executable, *sys.argv] if argv is None else ["serve.py", *argv],
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "url": url, "spawned": proc is not None, "server": health,
        "requests": a.requests, "concurrency": a.concurrency, "max_tokens": a.max_tokens,
        "request_kv_policy": a.request_kv_policy, "server_threads": a.threads if proc else None,
        "python": platform.python_version(), "cpu": cpu_model(), "cpus": os.cpu_count(),
        "loadavg_before": list(load_before), "loadavg_after": list(load_after),
        **summary, "rows": rows,
    }
    write_json(a.json, payload)
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
