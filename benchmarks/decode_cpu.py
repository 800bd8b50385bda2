"""Fused decode cost per step in this thread's CPU time (and wall time) against a dense DynamicCache, same process.

A shared 2-core machine makes wall-clock tokens/s swing with other processes; ``time.thread_time`` of the decoding
thread counts only its own work, so the ratio against dense is steadier. Per context and policy: a random prompt
of that length is prefilled, 2 warm-up steps, then ``--steps`` greedy steps timed; every policy runs ``--rounds``
times interleaved with dense and the best round counts. Each fused run must have run only the native kernel (its
cache report's ``fused_impl``): otherwise the script stops and says what ran.

    python benchmarks/decode_cpu.py --contexts 1024,4096 --policies turbo4,smollm2-head-2.5bit --threads 1

``--baseline dense-fp16`` (or ``dense-bf16``) times the dense cache with 16-bit K/V rows (upcast for the model's
attention) instead of the model's dtype; the JSON names the baseline and its K/V dtype.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
from _common import add_baseline_arg, cpu_model, write_json


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="a model spec (default: SmolLM2-135M-Instruct; tiny for a test)")
    p.add_argument("--contexts", default="1024,4096", help="comma-separated prompt lengths")
    p.add_argument("--policies", default="turbo4;smollm2-head-2.5bit",
                   help="';'-separated policies run in the fused mode (',' also separates plain names)")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    add_baseline_arg(p)
    p.add_argument("--json", default="benchmarks/results/decode-cpu.json")
    return p.parse_args(argv)


def _run(model, ids, cache, steps: int) -> tuple[float, float]:
    with torch.inference_mode():
        tok = model(input_ids=ids, cache=cache).logits[:, -1:].argmax(-1)
        for _ in range(2):
            tok = model(input_ids=tok, cache=cache).logits[:, -1:].argmax(-1)
        c0, w0 = time.thread_time(), time.perf_counter()
        for _ in range(steps):
            tok = model(input_ids=tok, cache=cache).logits[:, -1:].argmax(-1)
        return (time.thread_time() - c0) / steps * 1e3, (time.perf_counter() - w0) / steps * 1e3


def main(argv=None) -> int:
    a = parse_args(argv)
    from tqbench.engine.engine import Engine
    from tqbench.engine.policy.grammar import split_policies

    policies = split_policies(a.policies)
    contexts = [int(c) for c in a.contexts.split(",") if c.strip()]
    if a.steps < 1 or a.rounds < 1 or not contexts or min(contexts) < 1:
        sys.exit("error: --steps, --rounds and every context must be at least 1")
    load0 = os.getloadavg()
    eng = Engine.load(a.model, threads=a.threads)
    rows = []
    for ctx in contexts:
        ids = torch.randint(100, min(20000, eng.config.vocab_size), (1, ctx), generator=torch.Generator().manual_seed(0))
        best: dict[str, tuple[float, float]] = {}
        for _ in range(a.rounds):
            for pol in [a.baseline, *policies]:
                cache = eng.make_cache(pol, "fused")  # the baseline name: its DynamicCache
                cpu, wall = _run(eng.model, ids, cache, a.steps)
                if pol != a.baseline:
                    ran = cache.report().fused_impl
                    if set(ran) != {"native-cpu"}:
                        sys.exit(f"error: {pol} at {ctx} tokens did not run only the native kernel: {ran}")
                old = best.get(pol)
                best[pol] = (min(cpu, old[0]), min(wall, old[1])) if old else (cpu, wall)
        dense_cpu, dense_wall = best[a.baseline]
        for pol, (cpu, wall) in best.items():
            rows.append({"context": ctx, "policy": pol, "cpu_ms_per_step": round(cpu, 2),
                         "wall_ms_per_step": round(wall, 2), "cpu_ratio_vs_dense": round(dense_cpu / cpu, 3),
                         "wall_ratio_vs_dense": round(dense_wall / wall, 3)})
    load1 = os.getloadavg()
    print(f"{'context':>7}  {'policy':<24} {'cpu ms/step':>11} {'x dense (cpu)':>13} {'wall ms/step':>12} "
          f"{'x dense (wall)':>14}")
    for r in rows:
        print(f"{r['context']:>7}  {r['policy']:<24} {r['cpu_ms_per_step']:>11.1f} {r['cpu_ratio_vs_dense']:>13.2f} "
              f"{r['wall_ms_per_step']:>12.1f} {r['wall_ratio_vs_dense']:>14.2f}")
    kv_dtype = eng.baseline_kv_dtype(a.baseline)
    baseline = f"{a.baseline} DynamicCache, {kv_dtype} K/V"
    print(f"threads {a.threads}, load {load0[0]:.2f} -> {load1[0]:.2f}; baseline: {baseline}, steps {a.steps}, "
          f"best of {a.rounds} rounds")
    write_json(a.json, {"benchmark": "decode_cpu", "date": datetime.datetime.now().isoformat(timespec="seconds"),
                        "model": eng.name, "cpu": cpu_model(), "threads": a.threads, "load_before": load0,
                        "load_after": load1, "steps": a.steps, "rounds": a.rounds,
                        "baseline": baseline, "baseline_kv_dtype": kv_dtype, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
