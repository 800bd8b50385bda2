"""Fused decode cost per step in this thread's CPU time (and wall time) against a dense DynamicCache, same process.

A shared 2-core machine makes wall-clock tokens/s swing with other processes; ``time.thread_time`` of the decoding
thread counts only its own work, so the ratio against dense is steadier. Per context and policy: a random prompt
of that length is prefilled, 2 warm-up steps, then ``--steps`` greedy steps timed; every policy runs ``--rounds``
times interleaved with dense and the best round counts. Each fused run must have run only the native kernel (its
cache report's ``fused_impl``): otherwise the script stops and says what ran.

    python benchmarks/decode_cpu.py --contexts 1024,4096 --policies turbo4,smollm2-head-2.5bit --threads 1

``--baseline dense-fp16`` (or ``dense-bf16``) times the dense cache with 16-bit K/V rows (upcast for the model's
attention) instead of the model's dtype; ``--baseline dense-fp16-kernel`` the same rows read as stored by the native
kernel (as engines read an f16 cache); ``--compare-baselines dense,dense-fp16`` times other dense baselines in the
same rounds (rows against ``--baseline`` too). The JSON names the baseline, its K/V dtype and its attention; a
kernel-attended baseline that did not run the kernel stops the script, saying so.

    python benchmarks/decode_cpu.py --contexts 4096,8192 --policies turbo4 --threads 2 \
        --baseline dense-fp16-kernel --compare-baselines dense,dense-fp16
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
from _common import DENSE_BASELINES, add_baseline_arg, check_baselines, cpu_model, write_json


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
    p.add_argument("--compare-baselines", default="",
                   help="comma-separated dense baselines also timed in the same rounds (against --baseline too): "
                        + ", ".join(DENSE_BASELINES))
    p.add_argument("--json", default="benchmarks/results/decode-cpu.json")
    a = p.parse_args(argv)
    a.compare_baselines = [b.strip() for b in a.compare_baselines.split(",") if b.strip()]
    bad = [b for b in a.compare_baselines if b not in DENSE_BASELINES]
    if bad:
        p.error(f"--compare-baselines: unknown dense baseline {bad[0]!r}: valid dense baselines are "
                f"{', '.join(DENSE_BASELINES)}")
    a.compare_baselines = [b for b in dict.fromkeys(a.compare_baselines) if b != a.baseline]
    return a


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
    from tqbench.constants import dense_baseline_label
    from tqbench.engine.cache.dense_kernel import kernel_calls
    from tqbench.engine.engine import Engine
    from tqbench.engine.policy.grammar import split_policies

    policies = split_policies(a.policies)
    contexts = [int(c) for c in a.contexts.split(",") if c.strip()]
    if a.steps < 1 or a.rounds < 1 or not contexts or min(contexts) < 1:
        sys.exit("error: --steps, --rounds and every context must be at least 1")
    load0 = os.getloadavg()
    eng = Engine.load(a.model, threads=a.threads)
    baselines = [a.baseline, *a.compare_baselines]
    check_baselines(baselines, eng)  # a kernel-attended baseline where the kernel cannot run: exit 2, saying why
    rows = []
    for ctx in contexts:
        ids = torch.randint(100, min(20000, eng.config.vocab_size), (1, ctx), generator=torch.Generator().manual_seed(0))
        best: dict[str, tuple[float, float]] = {}
        for _ in range(a.rounds):
            for pol in [*baselines, *policies]:
                cache = eng.make_cache(pol, "fused")  # a baseline name: its dense cache
                cpu, wall = _run(eng.model, ids, cache, a.steps)
                if pol in baselines:
                    if kernel_calls(cache) == 0:
                        sys.exit(f"error: the {pol} baseline at {ctx} tokens ran no native kernel call")
                else:
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
    vs = f"x {a.baseline}"  # (the JSON's *_ratio_vs_dense: against --baseline, whichever dense baseline it is)
    print(f"{'context':>7}  {'policy':<24} {'cpu ms/step':>11} {vs + ' (cpu)':>24} {'wall ms/step':>12} "
          f"{vs + ' (wall)':>25}")
    for r in rows:
        print(f"{r['context']:>7}  {r['policy']:<24} {r['cpu_ms_per_step']:>11.1f} {r['cpu_ratio_vs_dense']:>24.2f} "
              f"{r['wall_ms_per_step']:>12.1f} {r['wall_ratio_vs_dense']:>25.2f}")
    model_dtype = str(eng.loaded.dtype).replace("torch.", "")
    kv_dtype = eng.baseline_kv_dtype(a.baseline)
    labels = {b: dense_baseline_label(b, model_dtype) for b in baselines}
    print(f"threads {a.threads}, load {load0[0]:.2f} -> {load1[0]:.2f}; steps {a.steps}, best of {a.rounds} rounds; "
          f"ratios against {a.baseline}")
    for b in baselines:
        print(f"  {labels[b]}")
    write_json(a.json, {"benchmark": "decode_cpu", "date": datetime.datetime.now().isoformat(timespec="seconds"),
                        "model": eng.name, "cpu": cpu_model(), "threads": a.threads, "load_before": load0,
                        "load_after": load1, "steps": a.steps, "rounds": a.rounds,
                        "baseline": a.baseline, "baseline_label": labels[a.baseline], "baseline_kv_dtype": kv_dtype,
                        "baselines": {b: {"kv_dtype": eng.baseline_kv_dtype(b), "label": labels[b]}
                                      for b in baselines},
                        "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
