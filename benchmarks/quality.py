"""Quality per byte: teacher-forced KL(baseline || candidate) vs bits per element on the default model.

Prefill 1024 tokens of a shipped text, then 256 single-token steps through the candidate cache; KL averaged
over steps; every byte counted (windows, norms, scales, centering means, rotations and codebooks once).

    python benchmarks/quality.py                       # the README table
    python benchmarks/quality.py --policies turbo4,k=turbo3,v=turbo3,sink=4,recent=16 --texts bread
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from tqbench.engine.engine import Engine
from tqbench.engine.validate import baseline_logprobs, corpus_ids, teacher_forced

DEFAULT_POLICIES = ["q8k-q8v", "fp16k-int4v", "q8k-int4v", "turbo4", "turbo3.5", "turbo3", "turbo2.5", "turbo2",
                    "k4v2", "k3v2", "turbo4-qjl"]
TARGETS = [(2.5, 0.03), (3.5, 0.01), (4.5, 0.005)]  # (bits/element budget, KL target), tightest first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--policies", default=None, help="';'-separated policies (default: the README list)")
    ap.add_argument("--texts", default="lighthouses", help="comma-separated corpus names")
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--mode", default="simulate")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default="benchmarks/results/quality.json")
    args = ap.parse_args()
    policies = args.policies.split(";") if args.policies else DEFAULT_POLICIES
    con = Console()
    engine = Engine.load(args.model, threads=args.threads)
    rows = []
    t0 = time.time()
    for name in args.texts.split(","):
        ids = corpus_ids(engine.tokenizer, name, args.prefill + args.steps + 1)
        base = baseline_logprobs(engine, ids, args.prefill)
        for pol in policies:
            r = teacher_forced(engine, ids, args.prefill, pol, args.mode, baseline=base)
            rows.append({"text": name, **r.to_dict(), "policy_input": pol})
            con.print(f"{name:12s} {pol:40s} bits={r.bits_per_element:.3f} KL={r.kl_mean:.5f} "
                      f"top1={r.top1_agreement:.3f} ppl={r.ppl_candidate:.3f}/{r.ppl_baseline:.3f}")
    # average over texts per policy
    table = Table(title=f"teacher-forced quality ({args.prefill} prefill + {args.steps} steps, {args.mode})")
    for col in ("policy", "bits/el", "KL mean", "KL max", "top-1", "ppl", "ppl fp16", "target"):
        table.add_column(col, justify="right" if col != "policy" else "left")
    summary = []
    for pol in policies:
        rs = [r for r in rows if r["policy_input"] == pol]
        avg = {k: sum(r[k] for r in rs) / len(rs) for k in
               ("bits_per_element", "kl_mean", "kl_max", "top1_agreement", "ppl_candidate", "ppl_baseline")}
        target = next((f"KL<={kl} @<={b}b: {'met' if avg['kl_mean'] <= kl else 'missed'}"
                       for b, kl in TARGETS if avg["bits_per_element"] <= b + 1e-9), "")
        summary.append({"policy": pol, "label": rs[0]["kv_policy"], **avg, "target": target})
        table.add_row(rs[0]["kv_policy"], f"{avg['bits_per_element']:.3f}", f"{avg['kl_mean']:.5f}",
                      f"{avg['kl_max']:.4f}", f"{avg['top1_agreement']:.3f}", f"{avg['ppl_candidate']:.3f}",
                      f"{avg['ppl_baseline']:.3f}", target)
    con.print(table)
    out = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "model": engine.name, "device": str(engine.loaded.device), "dtype": str(engine.loaded.dtype),
        "threads": torch.get_num_threads(), "loadavg": os.getloadavg(), "cpu": platform.processor(),
        "torch": torch.__version__, "seconds": round(time.time() - t0, 1), "rows": rows, "summary": summary,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    con.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
