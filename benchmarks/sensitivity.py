"""Per-layer sensitivity: teacher-forced KL when only one layer's K (or V) is quantized, and how well the
allocator's cheap measure (``engine.allocate.measure_sensitivity``: one chunk forward per cell) ranks like it.

    python benchmarks/sensitivity.py --codec turbo2 --steps 64          # measure the teacher-forced table
    python benchmarks/sensitivity.py --reference benchmarks/results/sensitivity-turbo2.json \
        --json benchmarks/results/sensitivity-rank-turbo2.json          # reuse it, time and rank the proxy

Prints a table (layer, KL with only K quantized, KL with only V quantized, the proxy's) and writes JSON with
the Spearman rank correlation of the two over the 2 x layers cells and the seconds each took.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from tqbench.engine.allocate import measure_sensitivity, rank_correlation
from tqbench.engine.engine import Engine
from tqbench.engine.policy import parse_policy
from tqbench.engine.validate import baseline_logprobs, corpus_ids, teacher_forced


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--codec", default="turbo2")
    ap.add_argument("--extra", default="sink=4,recent=16", help="policy keys added to every run")
    ap.add_argument("--text", default="lighthouses")
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--roles", default="k,v")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reference", default=None, help="a teacher-forced table written by this script: reuse it")
    ap.add_argument("--json", default="benchmarks/results/sensitivity.json")
    args = ap.parse_args()
    engine = Engine.load(args.model, threads=args.threads)
    roles = args.roles.split(",")
    load_before = os.getloadavg()
    t0 = time.time()
    if args.reference:
        ref = json.loads(Path(args.reference).read_text())
        rows, tf_seconds = ref["rows"], ref["seconds"]
    else:
        ids = corpus_ids(engine.tokenizer, args.text, args.prefill + args.steps + 1)
        base = baseline_logprobs(engine, ids, args.prefill)
        rows = []
        for layer in range(engine.config.num_hidden_layers):
            row = {"layer": layer}
            for role in roles:
                pol = f"kv=fp16,{role}@{layer}={args.codec},{args.extra}"
                r = teacher_forced(engine, ids, args.prefill, pol, "simulate", baseline=base)
                row[f"kl_{role}"] = r.kl_mean
            rows.append(row)
            print(row, flush=True)
        tf_seconds = round(time.time() - t0, 1)
    t1 = time.time()
    ids = corpus_ids(engine.tokenizer, args.text, args.prefill + args.steps)
    proxy = measure_sensitivity(engine, ids, args.prefill, [args.codec], parse_policy(args.extra))
    proxy_seconds = round(time.time() - t1, 1)
    for row in rows:
        for role in roles:
            row[f"proxy_{role}"] = proxy.get(row["layer"], role, args.codec)
    tf = [row[f"kl_{r}"] for row in rows for r in roles]
    px = [row[f"proxy_{r}"] for row in rows for r in roles]
    rho = rank_correlation(px, tf)
    table = Table(title=f"per-layer KL, one layer at {args.codec} ({args.extra}): teacher-forced vs chunk proxy")
    for col in ("layer", *[f"TF KL {r.upper()}" for r in roles], *[f"proxy {r.upper()}" for r in roles]):
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(str(row["layer"]), *[f"{row[f'kl_{r}']:.5f}" for r in roles],
                      *[f"{row[f'proxy_{r}']:.5f}" for r in roles])
    Console().print(table)
    print(f"Spearman rank correlation over {len(tf)} cells: {rho:.3f}; teacher-forced {tf_seconds} s, "
          f"proxy {proxy_seconds} s ({torch.get_num_threads()} threads)")
    out = {"args": vars(args), "threads": torch.get_num_threads(), "seconds": tf_seconds,
           "proxy_seconds": proxy_seconds, "spearman": rho, "loadavg_before": load_before,
           "loadavg_after": os.getloadavg(), "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
