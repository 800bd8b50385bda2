"""Prefix-cache benchmark: questions about one shared context, each prefilling the whole prompt vs reading the
context's compressed prefix (``tqbench serve --prefix-cache``, ``cache_prefix``), on one in-process server.

``python benchmarks/serve_prefix.py [--model default] [--kv-policy turbo4] [--cache-mode compressed]
[--context 1024] [--questions 4] [--max-tokens 16] [--threads 1]`` loads the model once, serves it on a free
loopback port (uvicorn in a thread), sends each question as a chat whose system message is the context (a
shipped corpus text cut to ``--context`` tokens), first with ``cache_prefix: false`` (the whole prompt
prefilled), then with ``cache_prefix: true`` (the first request compresses the context, the others read it).
Prints per question the server's prefill seconds (a miss adds its prefix's compression), the request's wall
seconds, the prefix tokens read, and whether the answer's tokens equal ``Engine.compress(context)`` then generating
in-process; then the mean prefill ratio (whole prompt / hit) and the prefix cache's stored bytes from
``/metrics`` (once, however many requests read it). Records threads and the load average; writes JSON
(default ``benchmarks/results/serve_prefix-MODEL-POLICY-MODE.json``). The machine is shared: compare ratios, not seconds.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import re
import socket
import sys
import threading
import time
from pathlib import Path

from _common import cpu_model, write_json

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ["What is this text about?", "Name one place the text mentions.", "Summarise the text in one line.",
             "Which word appears first in the text?", "What could a reader learn from it?",
             "Give the text a title."]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--kv-policy", default="turbo4")
    p.add_argument("--cache-mode", default="compressed")
    p.add_argument("--context", type=int, default=1024, help="context tokens (the shared system message)")
    p.add_argument("--corpus", default="rivers", help="the shipped corpus text the context is cut from")
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, help="default: benchmarks/results/serve_prefix-MODEL-POLICY-MODE.json")
    return p.parse_args(argv)


def _post(port: int, body: dict) -> tuple[dict, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = json.loads(resp.read())
    seconds = time.perf_counter() - t0
    if resp.status != 200:
        raise SystemExit(f"request failed ({resp.status}): {data}")
    return data, seconds


def _get(port: int, path: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", path)
    return conn.getresponse().read().decode()


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import uvicorn

    from tqbench.engine import Engine
    from tqbench.engine.validate.quality import corpus_ids
    from tqbench.server import create_app

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    engine = Engine.load(args.model, threads=args.threads)
    load_seconds = time.perf_counter() - t0
    context = engine.tokenizer.decode(corpus_ids(engine.tokenizer, args.corpus, args.context)[0],
                                      skip_special_tokens=True)
    app = create_app(engine, kv_policy=args.kv_policy, cache_mode=args.cache_mode, max_new_tokens=args.max_tokens,
                     max_queue=4)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    questions = (QUESTIONS * (1 + args.questions // len(QUESTIONS)))[: args.questions]
    rows = []
    try:  # a warm-up request first (not recorded): the first forward calls pay one-off costs
        _post(port, {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2, "cache_prefix": False})
        for cached in (False, True):
            for q in questions:
                messages = [{"role": "system", "content": context}, {"role": "user", "content": q}]
                body = {"messages": messages, "max_tokens": args.max_tokens, "ignore_eos": True, "cache_prefix": cached}
                data, wall = _post(port, body)
                ext = data["tqbench"]
                use = ext["prefix_cache"]
                prefill = ext["prefill_seconds"] + (use["compress_seconds"] if use and not use["hit"] else 0.0)
                row = {"cache_prefix": cached, "question": q, "prompt_tokens": data["usage"]["prompt_tokens"],
                       "prefix_tokens": use["tokens"] if use else 0, "hit": bool(use and use["hit"]),
                       "prefill_seconds": round(prefill, 4), "wall_seconds": round(wall, 4),
                       "prefix_bytes": use["bytes"] if use else None, "token_ids": ext["token_ids"]}
                if cached:  # the same question prefilled whole (cache_prefix false) above: the same answer?
                    whole_row = next(r for r in rows if not r["cache_prefix"] and r["question"] == q)
                    row["same_as_whole_prompt"] = whole_row["token_ids"] == ext["token_ids"]
                if cached:  # the in-process reference: compress the context, then generate the question
                    ids = engine.encode_prompt(messages, chat=True)
                    ctx = engine.compress(ids[:, : use["tokens"]], args.kv_policy, args.cache_mode, prefill_chunk=0)
                    ref = ctx.generate(ids[:, use["tokens"]:], max_new_tokens=args.max_tokens, stop_at_eos=False)
                    row["same_as_in_process"] = ref.token_ids == ext["token_ids"]
                rows.append(row)
                print(f"cache_prefix={str(cached):5}  prompt {row['prompt_tokens']:5}  prefix read "
                      f"{row['prefix_tokens']:5} ({'hit ' if row['hit'] else 'miss' if cached else '-   '})  prefill "
                      f"{row['prefill_seconds']:8.3f} s  wall {row['wall_seconds']:8.3f} s"
                      + (f"  same as in-process: {row['same_as_in_process']}, as the whole prompt: "
                         f"{row['same_as_whole_prompt']}" if cached else ""), flush=True)
        metrics = _get(port, "/metrics")
    finally:
        server.should_exit = True
        thread.join(30)
    stored = int(re.search(r"^tqbench_prefix_cache_bytes (\d+)$", metrics, re.M).group(1))
    whole = [r["prefill_seconds"] for r in rows if not r["cache_prefix"]]
    hits = [r["prefill_seconds"] for r in rows if r["hit"]]
    ratio = (sum(whole) / len(whole)) / (sum(hits) / len(hits)) if hits and min(hits) > 0 else None
    load = os.getloadavg()
    print(f"\nmean prefill: whole prompt {sum(whole) / len(whole):.3f} s, from the stored prefix "
          f"{sum(hits) / max(1, len(hits)):.3f} s (x{ratio:.1f} less)" if ratio else "no hits")
    print(f"prefix cache: {stored} bytes stored once for {len(hits) + 1} requests; threads {args.threads}, load "
          f"average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (shared machine: compare ratios, not seconds)")
    out = args.json or str(ROOT / "benchmarks" / "results" / re.sub(
        r"[^A-Za-z0-9_.=-]+", "_", f"serve_prefix-{args.model}-{args.kv_policy}-{args.cache_mode}.json"))
    write_json(out, {
        "benchmark": "serve_prefix", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "model": engine.name, "kv_policy": args.kv_policy, "cache_mode": args.cache_mode,
        "context_tokens": args.context, "max_tokens": args.max_tokens, "threads": args.threads,
        "load_average": [round(x, 2) for x in load], "cpu": cpu_model(), "python": sys.version.split()[0],
        "model_load_seconds": round(load_seconds, 2), "prefill_ratio_whole_over_hit": ratio,
        "prefix_cache_bytes": stored, "rows": rows,
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
