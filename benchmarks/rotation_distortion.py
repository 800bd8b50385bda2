"""The randomized Hadamard rotation against the QR rotation on real K/V, at 1-4 bits: does the rotation whose stored
state is ``d`` sign bits quantize as well as the dense ``d x d`` one?

``python benchmarks/rotation_distortion.py --model FILE.gguf`` captures Q/K/V of every layer on held-out texts and
quantizes each layer's K (centered, norm-corrected, as policies build turbo keys; V exact) and V (K exact) with
``turbo{b}`` under ``rotation=qr`` and ``rotation=hadamard``, no sink or window. Per (layer, KV head), averaged:
relative q.k score error (K), relative attention-output error (V: softmax(exact scores) @ V vs @ V'). Also the
bytes each rotation is counted at (``rotation_bytes``). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

from _common import cpu_model, write_json

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bits", default="1,2,3,4")
    p.add_argument("--texts", default="heldout:technical,corpus:rivers")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/allocate/rotation_distortion.json"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from tqbench.engine import Engine
    from tqbench.engine.allocate.chunk import quantized_rows
    from tqbench.engine.calibrate import text_path
    from tqbench.engine.codecs.rotation import rotation_bytes
    from tqbench.engine.policy.spec import Policy
    from tqbench.engine.scan import capture_qkv

    t0 = time.perf_counter()
    engine = Engine.load(args.model, dtype="float32")
    bits = [int(b) for b in args.bits.split(",")]
    rots = ("qr", "hadamard")
    sums = {(r, role, b): [] for r in rots for role in ("k", "v") for b in bits}
    for name in args.texts.split(","):
        cap = capture_qkv(engine, text_path(name).read_text(encoding="utf-8"), None, args.tokens, 0, chat=False)
        for layer, qkv in sorted(cap.layers.items()):
            k, v, q = qkv.k.double(), qkv.v.double(), qkv.q.double()  # [H, T, d], q [Hq, T, d]
            heads, t, d = k.shape
            group = q.shape[0] // heads
            mask = torch.ones(t, t, dtype=torch.bool).tril()
            for r in rots:
                pol = Policy(rotation=r)
                for b in bits:
                    kq = quantized_rows(pol, f"turbo{b}", "k", k[None].float(), layer)[0].double()
                    vq = quantized_rows(pol, f"turbo{b}", "v", v[None].float(), layer)[0].double()
                    for h in range(heads):
                        qh = q[h * group:(h + 1) * group]
                        s = qh @ k[h].T
                        sq = qh @ kq[h].T
                        ks = s - s.mean(-1, keepdim=True)  # centering shifts every score of a query alike
                        kqs = sq - sq.mean(-1, keepdim=True)
                        err = ((ks - kqs)[:, mask]).norm() / ks[:, mask].norm()
                        p = torch.softmax(s.masked_fill(~mask, float("-inf")) * d ** -0.5, -1)
                        o, oq = p @ v[h], p @ vq[h]
                        sums[(r, "k", b)].append(float(err))
                        sums[(r, "v", b)].append(float((o - oq).norm() / o.norm()))
        print(f"measured {name}: {len(cap.token_ids)} tokens, {len(cap.layers)} layers", flush=True)
    d = engine.geometry.head_dim
    rows = []
    print(f"\nhead_dim {d}; rotation bytes counted: qr {rotation_bytes(d, 'qr'):,}, hadamard "
          f"{rotation_bytes(d, 'hadamard'):,}")
    print(f"{'role':<5}{'bits':>5}{'qr':>12}{'hadamard':>12}{'had/qr':>9}")
    for role in ("k", "v"):
        for b in bits:
            a = sum(sums[("qr", role, b)]) / len(sums[("qr", role, b)])
            h = sum(sums[("hadamard", role, b)]) / len(sums[("hadamard", role, b)])
            rows.append({"role": role, "bits": b, "qr": a, "hadamard": h, "ratio": h / a})
            print(f"{role:<5}{b:>5}{a:>12.5f}{h:>12.5f}{h / a:>9.3f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    write_json(args.out, {"model": engine.name, "head_dim": d, "texts": args.texts, "tokens": args.tokens,
                          "metric": {"k": "relative q.k score error (centered per query)",
                                     "v": "relative attention-output error (exact softmax)"},
                          "rotation_bytes": {r: rotation_bytes(d, r) for r in rots}, "rows": rows,
                          "threads": args.threads, "load": os.getloadavg(), "cpu": cpu_model(),
                          "seconds": round(time.perf_counter() - t0, 1),
                          "when": datetime.datetime.now(datetime.timezone.utc).isoformat()})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
