"""Turn a per-layer sensitivity table into a policy that fits a bits/element budget.

    python benchmarks/sensitivity.py --codec turbo2 --json benchmarks/results/sensitivity-turbo2.json
    python benchmarks/allocate.py --budget 2.5 --out tqbench/data/policies/smollm2-2.5bit.json

The budget is checked with the exact byte estimate (windows, norms, centering means, rotations counted)
at --seq-len tokens; the allocator's own fp16-row overhead term is lowered until the exact figure fits.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqbench.engine.cache.estimate import KVGeometry, estimate_kv
from tqbench.engine.policy.allocate import allocate_bits, allocation_policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sensitivity", default="benchmarks/results/sensitivity-turbo2.json")
    ap.add_argument("--budget", type=float, required=True)
    ap.add_argument("--seq-len", type=int, default=1280)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--recent", type=int, default=16)
    ap.add_argument("--geometry", default="30,3,64", help="layers,kv_heads,head_dim")
    ap.add_argument("--out", default=None)
    ap.add_argument("--model", default="mse", choices=("mse", "kl"), help="per-bit KL model (see allocate.py)")
    args = ap.parse_args()
    data = json.loads(Path(args.sensitivity).read_text())
    rows = sorted(data["rows"], key=lambda r: r["layer"])
    sk, sv = [r["kl_k"] for r in rows], [r["kl_v"] for r in rows]
    layers, heads, d = (int(x) for x in args.geometry.split(","))
    geo = KVGeometry(layers, heads, d)
    overhead = 0.0
    while True:
        kb, vb, pred = allocate_bits(sk, sv, args.budget - overhead, d, model=args.model)
        name = Path(args.out).stem if args.out else f"alloc-{args.budget:g}bit"
        pol = allocation_policy(kb, vb, args.sink, args.recent, name=name)
        est = estimate_kv(pol, geo, args.seq_len)
        if est.bits_per_element <= args.budget + 1e-9:
            break
        overhead += 0.01
    print(f"policy: {pol.to_string()}")
    print(f"K bits per layer: {kb}\nV bits per layer: {vb}")
    print(f"exact bits/element at {args.seq_len} tokens: {est.bits_per_element:.4f}; predicted KL {pred:.4f}")
    if args.out:
        body = pol.to_dict()
        body["name"] = name
        body["_source"] = {"sensitivity": args.sensitivity, "budget": args.budget, "seq_len": args.seq_len,
                           "bits_per_element": round(est.bits_per_element, 4)}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(body, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
