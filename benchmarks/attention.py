"""Kernel-level attention over the packed store vs dense SDPA (timed cold), per codec, at real model shapes.

``python benchmarks/attention.py --shape llama3-8b --contexts 32768 --codecs turbo4:turbo4 --threads 2``
(see ``--help``). On a CUDA device it times the Triton kernel (``tqbench.kernels.packed_attention``) against
fp16 SDPA (and flash-attn where installed); on CPU the native kernel (``tqbench.kernels.cpu``, C++) and the
torch reference against fp32 SDPA. ``--shape`` takes the KV heads, GQA and head size of a real model
(``_shapes.SHAPES``: llama3-8b, qwen3-8b, mistral-7b, smollm2); ``--queries 1,4,16`` times one decode token
and 4 / 16 query tokens (speculation, chunked prefill: causal over the last L positions).

Every run measures the machine's copy bandwidth in the same process, and every row reports the bytes each
path must read (dense K+V vs packed codes + norms/scales), the achieved GB/s and its fraction of that
bandwidth, the speedup over SDPA and the byte-ratio limit of that speedup, and the relative error of the
output against fp32 SDPA over the unquantized K/V. Both sides are timed COLD, as in a model whose other
layers evict this layer's K/V: each repeat reads the next of several copies of the K/V (dense) and of the
packed store, together at least 4x the last-level cache. ``--sparsev 0.001`` adds native-kernel rows with
Sparse-V at that threshold (skipped share + error). JSON goes to ``benchmarks/results/attention-<device>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from _common import cpu_model, write_json
from _shapes import SHAPES, load_shape

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
INTERPRETED = "triton"  # on CPU: the Triton kernels under TRITON_INTERPRET=1 (slow; never timed by default)
COLD_FACTOR = 4  # the copies a cold timing rotates through cover this many times the last-level cache
MAX_COPIES = 64


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when available)")
    p.add_argument("--shape", default=None, choices=sorted(SHAPES),
                   help="a real model's KV heads, GQA and head size (overrides --kv-heads/--gqa/--head-dims)")
    p.add_argument("--contexts", default=None, help="default: 1024..131072 on cuda, 1024,4096,16384 on cpu")
    p.add_argument("--queries", default="1", help="query tokens per call, comma list (1 = decode; 4/16: "
                                                  "speculation and chunked prefill, causal over the last L)")
    p.add_argument("--batch", default=None, help="comma list; default 1,8 on cuda, 1 on cpu")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--gqa", type=int, default=8, help="query heads per kv head")
    p.add_argument("--codecs", default="turbo4:turbo4,turbo2:turbo2,int8:int4", help="k:v pairs")
    p.add_argument("--impls", default=None, help="comma list of fused implementations to time (default: every "
                                                 "one available: native-cpu,torch-reference on cpu; triton on cuda)")
    p.add_argument("--sparsev", default="", help="comma list of Sparse-V thresholds to add as native-kernel rows")
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
    a.queries = ints(a.queries)
    a.sparsev = floats(a.sparsev)
    a.repeats = a.repeats or (50 if gpu else 5)
    a.shape_info = None
    if a.shape:
        s = load_shape(a.shape)
        a.kv_heads, a.gqa, a.head_dims, a.shape_info = s.kv_heads, s.gqa, [s.head_dim], s
    if a.quick:
        a.contexts, a.batch, a.head_dims, a.kv_heads, a.gqa, a.repeats = [256], [1], [64], 2, 4, 2
    a.codecs = [tuple(pair.split(":")) for pair in a.codecs.split(",") if pair.strip()]
    if any(len(c) != 2 for c in a.codecs):
        p.error("--codecs takes k:v pairs, e.g. turbo4:turbo4,int8:int4")
    if not a.queries or min(a.queries) < 1 or min(a.contexts) < max(a.queries):
        p.error("--queries takes positive integers no larger than the smallest context")
    if a.sparsev and (min(a.sparsev) <= 0 or max(a.sparsev) >= 1):
        p.error("--sparsev takes thresholds in (0, 1)")
    a.impls = [x.strip() for x in a.impls.split(",") if x.strip()] if a.impls else None
    name = f"attention-{a.device}" + (f"-{a.shape}" if a.shape else "")
    a.json = a.json or str(ROOT / "benchmarks" / "results" / f"{name}.json")
    return a


def last_level_cache_bytes(device: str) -> int:
    """The L3 (CPU) or L2 (GPU) size: what a cold timing's copies must exceed."""
    import torch

    if device == "cuda":
        return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20) or (64 << 20))
    best = 0
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    for idx in root.glob("index*"):
        try:
            text = (idx / "size").read_text().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        best = max(best, int(text.rstrip("KMG")) * mult)
    return best or (64 << 20)


def n_copies(nbytes: int, llc: int) -> int:
    """Copies of an ``nbytes`` working set that together cover ``COLD_FACTOR`` x the last-level cache (at most
    ``MAX_COPIES``: a row whose copies cover less says so, ``cold: false``)."""
    return max(1, min(MAX_COPIES, math.ceil(COLD_FACTOR * llc / max(1, nbytes))))


def timer(device: str, repeats: int):
    """``run(fns)``: median seconds of ``repeats`` calls, call i running ``fns[i % len(fns)]`` (cold rotation)."""
    import torch

    def run(fns) -> float:
        fns = fns if isinstance(fns, list) else [fns]
        fns[0]()  # warm up (and compile)
        times = []
        for i in range(repeats):
            fn = fns[i % len(fns)]
            if device == "cuda":
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        return statistics.median(times)

    return run


def copy_bandwidth(device: str, run) -> float:
    """GB/s of a device-to-device copy into a buffer already touched (bytes read + bytes written), larger
    than any cache (a fresh ``clone`` would time the page faults of its new allocation too)."""
    import torch

    n = (1 << 28) if device == "cuda" else (1 << 25)  # 1 GiB / 128 MiB of fp32
    x = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    y = torch.empty_like(x).fill_(0.0)
    t = run(lambda: y.copy_(x))
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


def copy_side(side):
    """The same side over a fresh copy of its packed tensors (cold rotation)."""
    return dataclasses.replace(side, payload={k: t.clone() for k, t in side.payload.items()}, _tables={})


def native_call(q, ks, vs, mask, scale, sparse_v: float = 0.0):
    """The native CPU kernel over packed rows only: ``(out, NativeCall)`` (the one place this script calls it)."""
    import torch

    from tqbench.kernels.cpu.attention import native_attention

    heads = ks.payload["idx" if ks.kind == "turbo" else "q"].shape[1]
    empty = torch.empty(q.shape[0], heads, 0, q.shape[-1])
    return native_attention(q, ks, vs, empty, empty, 0, 0, mask, scale, sparse_v=sparse_v)


def fused_impls(dev: str, console) -> dict:
    """name -> fn(q, ks, vs, mask, scale) returning the output first; what is unavailable is said, with why."""
    import torch

    if dev == "cuda":
        from tqbench.kernels.packed_attention import packed_attention

        return {"triton": packed_attention}
    from tqbench.kernels.cpu import native_status
    from tqbench.kernels.reference import packed_attention_partials

    impls = {}
    ok, why = native_status()
    if ok:
        impls["native-cpu"] = native_call
    else:
        console.print(f"[yellow]native CPU kernel unavailable: {why}[/]")
    impls["torch-reference"] = packed_attention_partials
    if os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available():
        try:  # the Triton kernels under the interpreter: only when asked for (--impls triton), e.g. gpu_check's dry run
            from tqbench.kernels.packed_attention import packed_attention

            impls[INTERPRETED] = packed_attention
        except ImportError as e:
            console.print(f"[yellow]triton unavailable: {e}[/]")
    return impls


def flash_attention():
    """flash-attn's ``flash_attn_func`` where installed (GPU), else None."""
    try:
        from flash_attn import flash_attn_func
    except Exception:  # not installed / no GPU build
        return None
    return flash_attn_func


def rel_err(out, ref) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import torch.nn.functional as F
    from rich.console import Console
    from rich.table import Table

    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console() if sys.stdout.isatty() else Console(width=190)
    dev = args.device
    gpu = dev == "cuda"
    dense_dtype = torch.float16 if gpu else torch.float32
    impls = fused_impls(dev, console)
    if args.impls:
        unknown = sorted(set(args.impls) - set(impls))
        if unknown:
            raise SystemExit(f"--impls {unknown}: available here are {', '.join(impls)}")
        impls = {k: v for k, v in impls.items() if k in args.impls}
    elif not gpu:
        impls.pop(INTERPRETED, None)
    if args.sparsev and "native-cpu" not in impls:
        console.print("[yellow]--sparsev rows need the native CPU kernel, which is not timed here[/]")
    flash = flash_attention() if gpu else None
    impl = ", ".join(impls)
    load_before = os.getloadavg()
    run = timer(dev, args.repeats)
    bw = copy_bandwidth(dev, run)
    llc = last_level_cache_bytes(dev)
    dev_name = torch.cuda.get_device_name() if gpu else cpu_model()
    shape_text = args.shape_info.describe() if args.shape_info else f"{args.kv_heads} KV heads x GQA {args.gqa}"
    console.print(f"device {dev} ({dev_name}), copy bandwidth {bw:.1f} GB/s, last-level cache "
                  f"{llc / 2**20:.0f} MiB, fused = {impl}, dense = SDPA {str(dense_dtype)[6:]}"
                  f"{' + flash-attn' if flash else ''}; shape {shape_text}")
    rows = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for d in args.head_dims:
        for b in args.batch:
            for n in args.contexts:
                hq = args.kv_heads * args.gqa
                k = torch.randn(b, args.kv_heads, n, d, device=dev, generator=gen, dtype=torch.float32)
                v = torch.randn(b, args.kv_heads, n, d, device=dev, generator=gen, dtype=torch.float32)
                kd, vd = k.to(dense_dtype), v.to(dense_dtype)
                dense_bytes = 2 * kd.numel() * kd.element_size()
                dense_copies = [(kd, vd)] + [(kd.clone(), vd.clone()) for _ in range(n_copies(dense_bytes, llc) - 1)]
                for L in args.queries:
                    q = torch.randn(b, hq, L, d, device=dev, generator=gen, dtype=torch.float32).to(dense_dtype)
                    # causal over the last L positions (query l sees rows 0 .. n - L + l); None for one token
                    allowed = (torch.arange(n, device=dev)[None, :] <= torch.arange(n - L, n, device=dev)[:, None])
                    sdpa_mask = None if L == 1 else allowed
                    kmask = None if L == 1 else allowed[None].expand(b, L, n).contiguous()
                    ref = F.scaled_dot_product_attention(q, kd, vd, attn_mask=sdpa_mask, enable_gqa=True)
                    t_dense = run([lambda kv=kv, q=q, m=sdpa_mask: F.scaled_dot_product_attention(
                        q, kv[0], kv[1], attn_mask=m, enable_gqa=True) for kv in dense_copies])
                    t_flash = None
                    if flash is not None:
                        qf = q.transpose(1, 2).contiguous()
                        kvf = [(a.transpose(1, 2).contiguous(), c.transpose(1, 2).contiguous()) for a, c in dense_copies]
                        t_flash = run([lambda kv=kv, qf=qf, c=L > 1: flash(qf, kv[0], kv[1], causal=c) for kv in kvf])
                        del qf, kvf
                    for kspec, vspec in args.codecs:
                        ks, kb = make_side(kspec, "k", k, torch.float32)
                        vs, vb = make_side(vspec, "v", v, torch.float32)
                        scale = d ** -0.5
                        packed = kb + vb
                        sides = [(ks, vs)] + [(copy_side(ks), copy_side(vs)) for _ in range(n_copies(packed, llc) - 1)]
                        variants = [(name, fn, 0.0) for name, fn in impls.items()]
                        if "native-cpu" in impls:
                            variants += [(f"native-cpu sparsev={t:g}", native_call, t) for t in args.sparsev]
                        for impl_name, fused, thr in variants:
                            def call(s, fused=fused, thr=thr, q=q, scale=scale, kmask=kmask):
                                if thr:
                                    return fused(q, s[0], s[1], kmask, scale, sparse_v=thr)
                                return fused(q, s[0], s[1], kmask, scale)
                            t = run([lambda s=s, call=call: call(s) for s in sides])
                            out = call(sides[0])
                            skipped = None
                            if thr:
                                skipped = round(out[1].skipped_rows / max(1, out[1].weighted_rows), 4)
                            rows.append({
                                "head_dim": d, "batch": b, "context": n, "queries": L, "kv_heads": args.kv_heads,
                                "q_heads": hq, "codec": f"{kspec}:{vspec}", "impl": impl_name, "sparsev": thr,
                                "dense_ms": round(t_dense * 1e3, 4), "fused_ms": round(t * 1e3, 4),
                                "flash_ms": None if t_flash is None else round(t_flash * 1e3, 4),
                                "speedup": round(t_dense / t, 3), "byte_limit": round(dense_bytes / packed, 3),
                                "dense_bytes": dense_bytes, "packed_bytes": packed,
                                "dense_gbs": round(dense_bytes / t_dense / 1e9, 2),
                                "fused_gbs": round(packed / t / 1e9, 2),
                                "dense_frac_copy_bw": round(dense_bytes / t_dense / 1e9 / bw, 3),
                                "fused_frac_copy_bw": round(packed / t / 1e9 / bw, 3),
                                "rel_err_vs_sdpa": round(rel_err(out[0], ref), 5), "sparsev_skipped_share": skipped,
                                "dense_copies": len(dense_copies), "packed_copies": len(sides),
                                "cold": min(len(dense_copies) * dense_bytes, len(sides) * packed) >= COLD_FACTOR * llc,
                            })
                        del ks, vs, sides
                    del q, ref
                del k, v, kd, vd, dense_copies
                if gpu:
                    torch.cuda.empty_cache()
    load_after = os.getloadavg()
    threads = torch.get_num_threads() if not gpu else "gpu"
    table = Table(title=f"attention over the packed store vs SDPA, {shape_text}, median of {args.repeats} "
                        f"({dev}, {threads} threads); both timed COLD (rotating copies >= {COLD_FACTOR}x the "
                        f"{llc / 2**20:.0f} MiB last-level cache); copy bandwidth {bw:.1f} GB/s")
    cols = ["d", "batch", "context", "q tok", "codec", "impl", "SDPA ms", "fused ms", "speedup", "byte limit",
            "SDPA % bw", "fused GB/s", "fused % copy bw", "rel err", "skipped"]
    if flash is not None:
        cols.insert(7, "flash ms")
    for col in cols:
        table.add_column(col, justify="left" if col in ("codec", "impl") else "right")
    for r in rows:
        cells = [str(r["head_dim"]), str(r["batch"]), str(r["context"]), str(r["queries"]), r["codec"], r["impl"],
                 f"{r['dense_ms']:.3f}{'' if r['cold'] else '*'}", f"{r['fused_ms']:.3f}", f"{r['speedup']:.2f}x", f"{r['byte_limit']:.2f}x",
                 f"{100 * r['dense_frac_copy_bw']:.0f}%", f"{r['fused_gbs']:.1f}",
                 f"{100 * r['fused_frac_copy_bw']:.0f}%", f"{r['rel_err_vs_sdpa']:.4f}",
                 "-" if r["sparsev_skipped_share"] is None else f"{100 * r['sparsev_skipped_share']:.1f}%"]
        if flash is not None:
            cells.insert(7, "-" if r["flash_ms"] is None else f"{r['flash_ms']:.3f}")
        table.add_row(*cells)
    console.print(table)
    if not all(r["cold"] for r in rows):
        console.print(f"* warm: at most {MAX_COPIES} copies, which cover less than {COLD_FACTOR}x the last-level cache")
    console.print(f"load average {load_before[0]:.2f} -> {load_after[0]:.2f} (1 min), {threads} threads")
    out = {
        "command": [sys.executable, *sys.argv] if argv is None else ["attention.py", *argv],
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": dev, "device_name": dev_name, "shape": args.shape,
        "shape_fields": args.shape_info.fields if args.shape_info else None,
        "impl": impl, "impls": list(impls), "dense_dtype": str(dense_dtype).replace("torch.", ""),
        "flash_attn": flash is not None, "copy_bandwidth_gbs": round(bw, 2), "last_level_cache_bytes": llc,
        "timing": f"cold: each repeat reads the next of several copies (>= {COLD_FACTOR}x the last-level cache)",
        "threads": torch.get_num_threads(), "repeats": args.repeats, "torch": torch.__version__,
        "python": platform.python_version(), "loadavg_before": list(load_before), "loadavg_after": list(load_after),
        "rows": rows,
    }
    write_json(args.json, out, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
