"""Batched decode steps on the engine: tokens/s of one forward call over B sequences vs B = 1, interleaved.

``python benchmarks/batch_decode.py [--model default] [--policies fp16,turbo4] [--batches 1,4,8] [--threads 2]``
prefills B copies of a chat prompt per (policy, B), decodes ``--warmup`` steps, then times ``--steps`` steps
of ``Engine.decode_step`` (the server's batched step: one forward call, each sequence on its own cache) and
repeats the whole set ``--rounds`` times round-robin, so a change in machine load hits every B alike.
Prints tok/s per (policy, B) (median over rounds) and the ratio to B = 1 in the same round; writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from _common import cpu_model, write_json

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [{"role": "user", "content": "Explain in a few sentences why the sky is blue."}]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--policies", default="fp16,turbo4")
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "batch-decode.json"))
    a = p.parse_args(argv)
    import torch

    from tqbench.engine.engine import Engine

    torch.set_num_threads(a.threads)
    engine = Engine.load(a.model, device="cpu", threads=a.threads)
    ids = engine.encode_prompt(PROMPT)
    policies = a.policies.split(",")
    batches = [int(b) for b in a.batches.split(",")]
    load_before = os.getloadavg()
    rates: dict[tuple[str, int], list[float]] = {}
    ratios: dict[tuple[str, int], list[float]] = {}
    for r in range(a.rounds):
        for pol in policies:
            base = None
            for b in batches:
                seqs = [engine.sequence(ids, pol, max_new_tokens=a.warmup + a.steps + 2, stop_at_eos=False)
                        for _ in range(b)]
                for s in seqs:
                    s.start()
                    s.step()
                for _ in range(a.warmup):
                    engine.decode_step(seqs)
                    for s in seqs:
                        s.step()
                t0 = time.perf_counter()
                for _ in range(a.steps):
                    engine.decode_step(seqs)
                    for s in seqs:
                        s.step()
                rate = b * a.steps / (time.perf_counter() - t0)
                base = rate if base is None else base
                rates.setdefault((pol, b), []).append(rate)
                ratios.setdefault((pol, b), []).append(rate / base)
                print(f"  round {r + 1} {pol} B={b}: {rate:.1f} tok/s ({rate / base:.2f}x B={batches[0]})", flush=True)
    load_after = os.getloadavg()
    print(f"batched decode steps, {engine.name}, compressed, {a.threads} threads, prompt {ids.shape[1]} tokens, "
          f"{a.steps} timed steps, median of {a.rounds} interleaved rounds")
    print(f"{'policy':>7} {'B':>3} {'tok/s':>7} {'x B=1':>6}")
    rows = []
    for pol in policies:
        for b in batches:
            rate, ratio = statistics.median(rates[(pol, b)]), statistics.median(ratios[(pol, b)])
            rows.append({"policy": pol, "batch": b, "tokens_per_s": round(rate, 2), "ratio_vs_b1": round(ratio, 2),
                         "rounds_tokens_per_s": [round(x, 2) for x in rates[(pol, b)]],
                         "rounds_ratio": [round(x, 2) for x in ratios[(pol, b)]]})
            print(f"{pol:>7} {b:>3} {rate:>7.1f} {ratio:>6.2f}")
    print(f"load average {load_before[0]:.2f} -> {load_after[0]:.2f} (1 min), {cpu_model()}, {os.cpu_count()} CPUs")
    write_json(a.json, {
        "benchmark": "batch-decode", "command": [sys.executable, *sys.argv],
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": engine.name, "threads": a.threads, "prompt_tokens": int(ids.shape[1]), "steps": a.steps,
        "rounds": a.rounds, "python": platform.python_version(), "torch": torch.__version__, "cpu": cpu_model(),
        "cpus": os.cpu_count(), "loadavg_before": list(load_before), "loadavg_after": list(load_after), "rows": rows,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
