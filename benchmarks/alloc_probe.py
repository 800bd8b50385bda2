"""Where an allocation's error is: teacher-forced KL of a policy and of variants of it (a role kept exact, a layer
kind kept exact, another recent window for all layers or for the sliding-window layers alone: ``srecent``).

Each policy is verified as ``allocate`` verifies (``verify.frontier_texts``: the dense baseline, then the policy
through its cache in simulate mode, prefill over exact K/V then single-token steps, KL(baseline || candidate)), one
policy at a time so a killed run keeps its rows (the JSON is rewritten after each). Bits per element at the
stated context come from ``estimate_kv`` (every byte counted). Variants that keep a role exact cost more bytes:
they say where the error is, they are not candidates.

    python benchmarks/alloc_probe.py --model gemma3-270m --threads 1 --steps 128 \\
        --json benchmarks/results/allocate/gemma-probe/probe.json "POLICY" "POLICY,v@all=fp16" ...
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch
from _common import cpu_model, write_json

from tqbench.engine.allocate.verify import frontier_texts
from tqbench.engine.cache.estimate import estimate_kv
from tqbench.engine.engine import Engine
from tqbench.engine.policy.files import parse_policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("policies", nargs="+", help="policy texts, measured in this order")
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--texts", default="rivers,heldout:technical")
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    engine = Engine.load(args.model, threads=args.threads)
    texts = args.texts.split(",")
    out = {"model": engine.loaded.name, "threads": torch.get_num_threads(), "texts": texts, "prefill": args.prefill,
           "steps": args.steps, "context": args.context, "cpu": cpu_model(), "python": platform.python_version(),
           "torch": torch.__version__, "load_start": os.getloadavg(), "rows": []}
    for text in args.policies:
        pol = parse_policy(text)
        t0 = time.time()
        res = frontier_texts(engine, [pol], texts=texts, prefill=args.prefill, steps=args.steps,
                             context=args.context)
        row = {"policy": pol.to_string(), "bits_per_element": estimate_kv(pol, engine.geometry,
                                                                          args.context).bits_per_element,
               "kl": {t: res[t][0].kl_mean for t in texts}, "top1": {t: res[t][0].top1_agreement for t in texts},
               "wall_s": round(time.time() - t0, 1), "load": os.getloadavg()[0]}
        out["rows"].append(row)
        print(f"{row['bits_per_element']:.3f} bits  " + "  ".join(f"{t} {row['kl'][t]:.4f}" for t in texts)
              + f"  {pol.to_string()}", flush=True)
        write_json(args.json, out, console=None)


if __name__ == "__main__":
    main()
