"""Native CPU kernel micro-benchmark at real model shapes: packed decode attention vs cold SDPA fp32, the
fraction of copy bandwidth, each width vs turbo4, and the per-call Python glue. Prints a table, writes JSON.

    python benchmarks/kernel_micro.py --threads 2 --contexts 32768 131072

Packed stores hold random codes and norms (the kernel's time does not depend on code values) plus a 16-row
full-precision tail; K is centred (mu), like the engine's turbo keys. Every timing is cold: each repeat reads the
next of several copies that together exceed 4x the last-level cache. Ratios are taken in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

LLC_BYTES = 32 << 20  # this machine's L3 (lscpu); copies cover >= 4x of it


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--codecs", nargs="+", default=["turbo4", "turbo3", "turbo2"])
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--gqa", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--tail", type=int, default=16, help="full-precision rows after the packed run")
    p.add_argument("--json", type=Path, default=Path("benchmarks/results/kernel_micro.json"))
    return p.parse_args(argv)


def _median(fns, repeats: int) -> float:
    fns[0]()
    times = []
    for i in range(repeats):
        t = time.perf_counter()
        fns[i % len(fns)]()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _copy_bandwidth() -> float:
    """GB/s (bytes read + written) of a 128 MiB copy into a buffer already touched."""
    import torch

    src = torch.ones(1 << 25)
    dst = torch.zeros_like(src)
    return 2 * src.numel() * 4 / _median([lambda: dst.copy_(src)], 9) / 1e9


def _copies(nbytes: int) -> int:
    return max(1, -(-4 * LLC_BYTES // max(nbytes, 1)))


def main(argv=None) -> int:
    args = _args(argv)
    import torch
    import torch.nn.functional as F

    from tqbench.engine.codecs import codec_from_spec
    from tqbench.kernels.cpu import native_module
    from tqbench.kernels.cpu.attention import kernel_rules, kernel_side, native_attention_batch
    from tqbench.kernels.reference import PackedSide

    torch.set_num_threads(args.threads)
    mod = native_module()
    rules = kernel_rules()
    h, g, d = args.kv_heads, args.gqa, args.head_dim
    gen = torch.Generator().manual_seed(0)
    load_before = os.getloadavg()
    bw = _copy_bandwidth()

    def side(spec, role, n):
        codec = codec_from_spec(spec, role=role, center=role == "k")
        bits = codec.bits
        nbytes = (d * bits + 7) // 8
        codes = torch.randint(0, 256, (1, h, n, nbytes), generator=gen, dtype=torch.uint8)
        norms = (1 + 0.1 * torch.rand(1, h, n, 1, generator=gen)).half()
        mu = (0.1 * torch.randn(1, h, 1, d, generator=gen)).half() if role == "k" else None
        tail = torch.randn(1, h, args.tail, d, generator=gen)
        s = mod.Side(kind="turbo", bits=bits, head_dim=d, n_before=0, n_packed=n, codes=codes, norms=norms,
                     levels=codec.codebook_tensor(dtype=torch.float32, head_dim=d),
                     rotation=codec.rotation_tensor(dtype=torch.float32, head_dim=d), mu=mu, dense=[tail])
        packed = codes.numel() + norms.numel() * 2 + tail.numel() * 4 + (0 if mu is None else mu.numel() * 2)
        return s, packed

    rows = []
    for n in args.contexts:
        q = torch.randn(1, h * g, 1, d, generator=gen)
        total = n + args.tail
        dense_bytes = 2 * h * total * d * 4
        kv = [(torch.randn(1, h, total, d, generator=gen), torch.randn(1, h, total, d, generator=gen))
              for _ in range(_copies(dense_bytes))]
        t_sdpa = _median([lambda k=k, v=v, q=q: F.scaled_dot_product_attention(q, k, v, enable_gqa=True) for k, v in kv],
                         args.repeats)
        del kv
        base = None
        for spec in args.codecs:
            first_k, nbytes_k = side(spec, "k", n)
            first_v, nbytes_v = side(spec, "v", n)
            packed = nbytes_k + nbytes_v
            stores = [(first_k, first_v)] + [(side(spec, "k", n)[0], side(spec, "v", n)[0])
                                             for _ in range(_copies(packed) - 1)]
            t = _median([lambda ks=ks, vs=vs, q=q: native_attention_batch(q, [ks], [vs], d ** -0.5) for ks, vs in stores],
                        args.repeats)
            del stores
            base = t if base is None else base
            rows.append({"context": n, "codec": f"{spec}:{spec}", "kv_heads": h, "q_heads": h * g, "head_dim": d,
                         "sdpa_ms": round(t_sdpa * 1e3, 3), "kernel_ms": round(t * 1e3, 3),
                         "vs_sdpa": round(t_sdpa / t, 2), "packed_bytes": packed, "dense_bytes": dense_bytes,
                         "kernel_frac_copy_bw": round(packed / t / 1e9 / bw, 3),
                         "sdpa_frac_copy_bw": round(dense_bytes / t_sdpa / 1e9 / bw, 3),
                         "time_vs_first_codec": round(t / base, 3)})

    # per-call Python glue at 1 thread (the C++ call then runs inline in this thread): this thread's CPU time of
    # the whole entry (two kernel_side + native_attention_batch) minus the C++ call with the same arguments
    torch.set_num_threads(1)
    ks, _ = side("turbo4", "k", 48)
    vs, _ = side("turbo4", "v", 48)
    q = torch.randn(1, h * g, 1, d, generator=gen)
    packed_k = PackedSide("turbo", ks.bits, {"idx": ks.codes, "norm": ks.norms}, 48, d, levels=ks.levels,
                          rotation=ks.rotation, mu=ks.mu)
    packed_v = PackedSide("turbo", vs.bits, {"idx": vs.codes, "norm": vs.norms}, 48, d, levels=vs.levels,
                          rotation=vs.rotation)

    def entry():
        a, _ = kernel_side(packed_k, ks.dense, 0, d, torch.float32)
        b, _ = kernel_side(packed_v, vs.dense, 0, d, torch.float32)
        return native_attention_batch(q, [a], [b], 0.1)

    def per_call(fn, reps=2000) -> float:
        best = float("inf")
        for _ in range(7):
            t = time.thread_time()
            for _ in range(reps):
                fn()
            best = min(best, (time.thread_time() - t) / reps)
        return best

    t_entry = per_call(entry)
    t_cpp = per_call(lambda: mod.attend(q, 0.1, [ks], [vs], [], 0.0, None, 0.0))
    t_sides = per_call(lambda: (kernel_side(packed_k, ks.dense, 0, d, torch.float32),
                                kernel_side(packed_v, vs.dense, 0, d, torch.float32)))
    torch.set_num_threads(args.threads)
    load_after = os.getloadavg()
    meta = {"threads": args.threads, "isa": rules["isa"], "copy_bw_gbs": round(bw, 2), "cpu": platform.processor()
            or platform.machine(), "load_before": load_before, "load_after": load_after,
            "glue_us": round((t_entry - t_cpp) * 1e6, 2), "glue_sides_us": round(t_sides * 1e6, 2), "call_us_64_tokens": round(t_entry * 1e6, 2),
            "timing": "cold: each repeat reads the next of copies covering >= 4x the 32 MiB L3"}
    print(f"native kernel ({rules['isa']}), {h} kv heads x GQA {g}, d{d}, 1 query token, {args.threads} threads, "
          f"copy bandwidth {bw:.1f} GB/s (read + write), load {load_before[0]:.2f} -> {load_after[0]:.2f}")
    cols = ["context", "codec", "sdpa_ms", "kernel_ms", "vs_sdpa", "kernel_frac_copy_bw", "sdpa_frac_copy_bw",
            "time_vs_first_codec"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    print(f"per-call Python glue (1 thread, CPU time) {meta['glue_us']} us, of which two kernel_side "
          f"{meta['glue_sides_us']} us (whole call at 64 tokens {meta['call_us_64_tokens']} us)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
