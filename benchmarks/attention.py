"""Kernel-level decode attention: dense SDPA vs fused attention over the packed store, per codec.

``python benchmarks/attention.py`` (one command; see ``--help``). On a CUDA device it times the Triton
kernel (``tqbench.kernels.packed_attention``) against fp16 SDPA over contexts 1K..128K; on CPU it times the
native kernel (``tqbench.kernels.cpu``, C++) and the torch reference against fp32 SDPA over 1K..16K. For every point it prints the time,
the bytes each path must read (dense K+V vs packed codes + norms/scales), the achieved GB/s, the fraction
of the measured copy bandwidth, the speedup over SDPA and the byte-ratio limit of that speedup; JSON goes
to ``benchmarks/results/attention-<device>.json``.

One decode step: ``batch`` sequences x ``kv_heads * gqa`` query heads x 1 query token against ``context``
packed rows (the full-precision window is small and left out here; the engine merges it with one matmul).
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
sys.path.insert(0, str(ROOT))


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when available)")
    p.add_argument("--contexts", default=None, help="default: 1024..131072 on cuda, 1024,4096,16384 on cpu")
    p.add_argument("--batch", default=None, help="comma list; default 1,8 on cuda, 1 on cpu")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--gqa", type=int, default=8, help="query heads per kv head")
    p.add_argument("--codecs", default="turbo4:turbo4,turbo2:turbo2,int8:int4", help="k:v pairs")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per point (median)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json", default=None)
    p.add_argument("--quick", action="store_true", help="tiny smoke run (context 256, batch 1, d64, 2 kv heads)")
    a = p.parse_args(argv)
    import torch

    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    gpu = a.device == "cuda"
    a.contexts = ints(a.contexts) if a.contexts else ([1024, 4096, 16384, 65536, 131072] if gpu else [1024, 4096, 16384])
    a.batch = ints(a.batch) if a.batch else ([1, 8] if gpu else [1])
    a.head_dims = ints(a.head_dims)
    a.repeats = a.repeats or (50 if gpu else 5)
    if a.quick:
        a.contexts, a.batch, a.head_dims, a.kv_heads, a.gqa, a.repeats = [256], [1], [64], 2, 4, 2
    a.codecs = [tuple(pair.split(":")) for pair in a.codecs.split(",") if pair.strip()]
    if any(len(c) != 2 for c in a.codecs):
        p.error("--codecs takes k:v pairs, e.g. turbo4:turbo4,int8:int4")
    a.json = a.json or str(ROOT / "benchmarks" / "results" / f"attention-{a.device}.json")
    return a


def timer(device: str, repeats: int):
    import torch

    def run(fn) -> float:
        fn()  # warm up (and compile)
        if device == "cuda":
            torch.cuda.synchronize()
            times = []
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            return statistics.median(times)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    return run


def copy_bandwidth(device: str, run) -> float:
    """GB/s of a device-to-device clone (bytes read + bytes written)."""
    import torch

    n = (1 << 28) if device == "cuda" else (1 << 25)  # 1 GiB / 128 MiB of fp32
    x = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    t = run(lambda: x.clone())
    return 2 * x.numel() * 4 / t / 1e9


def make_side(spec: str, role: str, x, state_dtype):
    from tqbench.engine.codecs import codec_from_spec
    from tqbench.kernels.reference import PackedSide

    turbo = spec.startswith("turbo")
    codec = codec_from_spec(spec, role=role, center=turbo and role == "k")
    state = codec.calibrate(x)
    enc = codec.encode(x, state)
    d, n = x.shape[-1], x.shape[2]
    nbytes = sum(t.numel() * t.element_size() for t in enc.values())
    if turbo:
        side = PackedSide("turbo", codec.bits, enc, n, d, levels=codec.codebook_tensor(x.device, state_dtype, d),
                          rotation=codec.rotation_tensor(x.device, state_dtype, d), mu=state.get("mu"))
    elif role == "k":
        side = PackedSide("affine-channel", codec.bits, enc, n, d, group=codec.block)
    else:
        side = PackedSide("affine-token", codec.bits, enc, n, d, group=codec.group)
    return side, nbytes


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import torch.nn.functional as F
    from rich.console import Console
    from rich.table import Table

    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console() if sys.stdout.isatty() else Console(width=170)
    dev = args.device
    gpu = dev == "cuda"
    dense_dtype = torch.float16 if gpu else torch.float32
    if gpu:
        from tqbench.kernels.packed_attention import packed_attention
        impls = {"triton": packed_attention}
    else:
        from tqbench.kernels.cpu import native_status
        from tqbench.kernels.reference import packed_attention_partials

        impls = {}
        ok, why = native_status()
        if ok:
            from tqbench.kernels.cpu.attention import native_attention

            def native(q, ks, vs, mask, scale):
                empty = torch.empty(q.shape[0], ks.payload["idx" if ks.kind == "turbo" else "q"].shape[1], 0,
                                    q.shape[-1])
                return native_attention(q, ks, vs, empty, empty, 0, 0, mask, scale)

            impls["native-cpu"] = native
        else:
            console.print(f"[yellow]native CPU kernel unavailable: {why}[/]")
        impls["torch-reference"] = packed_attention_partials
    impl = ", ".join(impls)
    load_before = os.getloadavg()
    run = timer(dev, args.repeats)
    bw = copy_bandwidth(dev, run)
    console.print(f"device {dev} ({torch.cuda.get_device_name() if gpu else cpu_model()}), "
                  f"copy bandwidth {bw:.1f} GB/s, fused = {impl}, dense = SDPA {str(dense_dtype)[6:]}")
    rows = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for d in args.head_dims:
        for b in args.batch:
            for n in args.contexts:
                hq = args.kv_heads * args.gqa
                k = torch.randn(b, args.kv_heads, n, d, device=dev, generator=gen, dtype=torch.float32)
                v = torch.randn(b, args.kv_heads, n, d, device=dev, generator=gen, dtype=torch.float32)
                q = torch.randn(b, hq, 1, d, device=dev, generator=gen, dtype=torch.float32).to(dense_dtype)
                kd, vd = k.to(dense_dtype), v.to(dense_dtype)
                dense_bytes = 2 * kd.numel() * kd.element_size()
                t_dense = run(lambda kd=kd, vd=vd, q=q: F.scaled_dot_product_attention(q, kd, vd, enable_gqa=True))
                del kd, vd
                for kspec, vspec in args.codecs:
                    ks, kb = make_side(kspec, "k", k, torch.float32)
                    vs, vb = make_side(vspec, "v", v, torch.float32)
                    scale = d ** -0.5
                    packed = kb + vb
                    for impl_name, fused in impls.items():
                        t = run(lambda q=q, ks=ks, vs=vs, scale=scale, fused=fused: fused(q, ks, vs, None, scale))
                        rows.append({
                            "head_dim": d, "batch": b, "context": n, "kv_heads": args.kv_heads, "q_heads": hq,
                            "codec": f"{kspec}:{vspec}", "impl": impl_name,
                            "dense_ms": round(t_dense * 1e3, 4), "fused_ms": round(t * 1e3, 4),
                            "speedup": round(t_dense / t, 3), "byte_limit": round(dense_bytes / packed, 3),
                            "dense_bytes": dense_bytes, "packed_bytes": packed,
                            "dense_gbs": round(dense_bytes / t_dense / 1e9, 2), "fused_gbs": round(packed / t / 1e9, 2),
                            "dense_frac_copy_bw": round(dense_bytes / t_dense / 1e9 / bw, 3),
                            "fused_frac_copy_bw": round(packed / t / 1e9 / bw, 3),
                        })
                    del ks, vs
                del k, v
                if gpu:
                    torch.cuda.empty_cache()
    load_after = os.getloadavg()
    table = Table(title=f"decode attention, {args.kv_heads} kv heads x GQA {args.gqa}, 1 query token, "
                        f"median of {args.repeats} ({dev}, {torch.get_num_threads() if not gpu else 'gpu'} threads)")
    for col in ("d", "batch", "context", "codec", "impl", "SDPA ms", "fused ms", "speedup", "byte limit",
                "SDPA GB/s", "fused GB/s", "fused % copy bw"):
        table.add_column(col, justify="left" if col == "codec" else "right")
    for r in rows:
        table.add_row(str(r["head_dim"]), str(r["batch"]), str(r["context"]), r["codec"], r["impl"],
                      f"{r['dense_ms']:.3f}",
                      f"{r['fused_ms']:.3f}", f"{r['speedup']:.2f}x", f"{r['byte_limit']:.2f}x",
                      f"{r['dense_gbs']:.1f}", f"{r['fused_gbs']:.1f}", f"{100 * r['fused_frac_copy_bw']:.0f}%")
    console.print(table)
    console.print(f"load average {load_before[0]:.2f} -> {load_after[0]:.2f} (1 min)")
    out = {
        "command": [sys.executable, *sys.argv] if argv is None else ["attention.py", *argv],
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": dev, "device_name": torch.cuda.get_device_name() if gpu else cpu_model(),
        "impl": impl, "impls": list(impls), "dense_dtype": str(dense_dtype).replace("torch.", ""), "copy_bandwidth_gbs": round(bw, 2),
        "threads": torch.get_num_threads(), "repeats": args.repeats, "torch": torch.__version__,
        "python": platform.python_version(), "loadavg_before": list(load_before), "loadavg_after": list(load_after),
        "rows": rows,
    }
    write_json(args.json, out, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
