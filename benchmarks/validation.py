"""The README's validation tables in one command: compare-policies over every preset on two prompts, and
teacher-forced quality (perplexity, KL, top-1) of the same presets on a shipped text.

    python benchmarks/validation.py --threads 1                 # both tables (several minutes on 2 CPUs)
    python benchmarks/validation.py --model tiny --quick        # a smoke run

Writes benchmarks/results/validation-compare.json and validation-teacher-forced.json (with the command,
threads, load average, torch version and timings).
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

from tqbench.cli.render.compare import compare_md, print_compare
from tqbench.cli.render.progress import EventProgress
from tqbench.cli.render.validate import print_teacher_forced, teacher_forced_md
from tqbench.constants import COMPARE_PROMPTS
from tqbench.engine.engine import Engine
from tqbench.engine.validate import compare_policies, default_policies, teacher_forced_quality


def _meta(engine, t0: float, loadavg_before) -> dict:
    return {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "model": engine.name, "device": str(engine.loaded.device), "dtype": str(engine.loaded.dtype),
        "threads": torch.get_num_threads(), "loadavg_before": loadavg_before, "loadavg_after": os.getloadavg(),
        "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
        "seconds": round(time.time() - t0, 1), "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--policies", default=None, help="';'-separated policies (default: every preset but fp16)")
    ap.add_argument("--mode", default="compressed")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--corpus", default="lighthouses")
    ap.add_argument("--tf-context", type=int, default=512)
    ap.add_argument("--tf-tokens", type=int, default=128)
    ap.add_argument("--skip-compare", action="store_true")
    ap.add_argument("--skip-tf", action="store_true")
    ap.add_argument("--quick", action="store_true", help="8 new tokens, 64+16 teacher-forced tokens")
    ap.add_argument("--out-dir", default="benchmarks/results")
    args = ap.parse_args()
    if args.quick:
        args.max_new_tokens, args.tf_context, args.tf_tokens = 8, 64, 16
    con = Console()
    engine = Engine.load(args.model, threads=args.threads)
    policies = args.policies.split(";") if args.policies else default_policies("fp16")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not args.skip_compare:
        t0, la = time.time(), os.getloadavg()
        with EventProgress(total=len(policies) * 2 + 2, label="compare") as prog:
            res = compare_policies(engine, policies, list(COMPARE_PROMPTS), cache_mode=args.mode,
                                   max_new_tokens=args.max_new_tokens, on_event=prog)
        payload = {**_meta(engine, t0, la), **res.to_dict()}
        print_compare(res)
        path = out_dir / "validation-compare.json"
        path.write_text(json.dumps(payload, indent=2))
        (out_dir / "validation-compare.md").write_text(compare_md(res))
        con.print(f"wrote {path}")
    if not args.skip_tf:
        t0, la = time.time(), os.getloadavg()
        with EventProgress(label="teacher-forced") as prog:
            rep = teacher_forced_quality(engine, policies, corpus=args.corpus, context_tokens=args.tf_context,
                                         eval_tokens=args.tf_tokens, cache_mode=args.mode, on_event=prog)
        payload = {**_meta(engine, t0, la), **rep.to_dict()}
        print_teacher_forced(rep)
        path = out_dir / "validation-teacher-forced.json"
        path.write_text(json.dumps(payload, indent=2))
        (out_dir / "validation-teacher-forced.md").write_text(teacher_forced_md(rep))
        con.print(f"wrote {path}")


if __name__ == "__main__":
    main()
