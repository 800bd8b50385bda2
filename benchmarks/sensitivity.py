"""Per-layer sensitivity: teacher-forced KL when only one layer's K (or V) is quantized.

    python benchmarks/sensitivity.py --codec turbo2 --steps 64

Prints a table (layer, KL with only K quantized, KL with only V quantized) and writes JSON. The sum over
layers approximates the KL of quantizing them all, so the table says where extra bits pay most.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from tqbench.engine.engine import Engine
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
    ap.add_argument("--json", default="benchmarks/results/sensitivity.json")
    args = ap.parse_args()
    engine = Engine.load(args.model, threads=args.threads)
    ids = corpus_ids(engine.tokenizer, args.text, args.prefill + args.steps + 1)
    base = baseline_logprobs(engine, ids, args.prefill)
    n = engine.config.num_hidden_layers
    rows = []
    t0 = time.time()
    for layer in range(n):
        row = {"layer": layer}
        for role in args.roles.split(","):
            pol = f"kv=fp16,{role}@{layer}={args.codec},{args.extra}"
            r = teacher_forced(engine, ids, args.prefill, pol, "simulate", baseline=base)
            row[f"kl_{role}"] = r.kl_mean
        rows.append(row)
        print(row, flush=True)
    table = Table(title=f"per-layer KL, one layer at {args.codec} ({args.extra})")
    for col in ("layer", *[f"KL {r.upper()} only" for r in args.roles.split(",")]):
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(str(row["layer"]), *[f"{row[f'kl_{r}']:.5f}" for r in args.roles.split(",")])
    Console().print(table)
    out = {"args": vars(args), "threads": torch.get_num_threads(), "seconds": round(time.time() - t0, 1), "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
