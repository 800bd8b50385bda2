"""One layer's decode attention over a dense 16-bit cache, each way a baseline can read it: the native kernel over
float16 rows as stored (``dense-fp16-kernel``), the kernel over float32 rows (what ``dense``'s rows would cost it),
and the rows upcast to float32 first, then SDPA (``dense-fp16``: what the model's attention does with them).

    python benchmarks/attention_dense16.py [--contexts 4096,8192] [--kv-heads 3] [--q-heads 9] [--head-dim 64]

Attention only (no model, no cache append), in this process's CPU time per call (``time.process_time``: every
thread's work, steadier than wall time on a shared machine), best of ``--repeats`` interleaved repeats of
``--calls`` calls; load and threads recorded. Defaults: the default model's (SmolLM2-135M) attention shape.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
from _common import ROOT, cpu_model, write_json


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="4096,8192")
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "attention-dense16.json"))
    a = p.parse_args(argv)
    a.contexts = [int(c) for c in a.contexts.split(",") if c.strip()]
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    from tqbench.kernels.cpu import native_module, native_status

    ok, why = native_status()
    if not ok:
        raise SystemExit(f"error: the native kernel cannot run here: {why}")
    mod = native_module()
    torch.set_num_threads(a.threads)
    load0 = os.getloadavg()
    d, gen = a.head_dim, torch.Generator().manual_seed(0)
    q = torch.randn(1, a.q_heads, 1, d, generator=gen)
    rows = []
    for n in a.contexts:
        k, v = (torch.randn(1, a.kv_heads, n, d, generator=gen) for _ in range(2))
        k16, v16 = k.half(), v.half()

        def kernel(kr, vr):
            return mod.attend(q, d**-0.5, [mod.Side(head_dim=d, dense=[kr])], [mod.Side(head_dim=d, dense=[vr])],
                              [], 0.0, None, 0.0)[0]

        ways = {
            "kernel, float16 rows as stored (dense-fp16-kernel)": lambda k16=k16, v16=v16: kernel(k16, v16),
            "kernel, float32 rows": lambda k=k, v=v: kernel(k, v),
            "upcast to float32 + SDPA (dense-fp16)": lambda k16=k16, v16=v16: (
                torch.nn.functional.scaled_dot_product_attention(q, k16.float(), v16.float(), enable_gqa=True)),
        }
        best = {w: float("inf") for w in ways}
        for fn in ways.values():  # warm-up: first-call costs are not timed
            fn()
        for _ in range(a.repeats):
            for w, fn in ways.items():
                t = time.process_time()
                for _ in range(a.calls):
                    fn()
                best[w] = min(best[w], (time.process_time() - t) / a.calls * 1e6)
        base = best["kernel, float16 rows as stored (dense-fp16-kernel)"]
        for w, us in best.items():
            rows.append({"context": n, "way": w, "cpu_us_per_call": round(us, 1), "vs_fp16_kernel": round(us / base, 3)})
    load1 = os.getloadavg()
    print(f"{'context':>7}  {'way':<52} {'cpu us/call':>11} {'x fp16 kernel':>13}")
    for r in rows:
        print(f"{r['context']:>7}  {r['way']:<52} {r['cpu_us_per_call']:>11.1f} {r['vs_fp16_kernel']:>13.2f}")
    print(f"threads {a.threads}, load {load0[0]:.2f} -> {load1[0]:.2f}, kv heads {a.kv_heads}, query heads "
          f"{a.q_heads}, head dim {d}; {mod.rules()['isa']}")
    write_json(a.json, {"benchmark": "attention_dense16",
                        "date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu": cpu_model(),
                        "isa": mod.rules()["isa"], "threads": a.threads, "load_before": load0, "load_after": load1,
                        "kv_heads": a.kv_heads, "q_heads": a.q_heads, "head_dim": d, "calls": a.calls,
                        "repeats": a.repeats, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
