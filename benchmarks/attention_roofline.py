"""The native CPU kernel against its byte limit: one decode token's attention per call, each way a layer's KV can
be stored, at real model shapes, beside the machine's copy bandwidth measured in the same run.

    python benchmarks/attention_roofline.py --shapes smollm2,llama3-8b --contexts 8192,32768 --threads 1 --json out.json

Ways (``--ways``): ``fp16`` / ``bf16`` (the kernel over 16-bit rows as stored: ``dense-fp16-kernel``), ``turbo4``,
``turbo3``, ``turbo2`` (K centred, a norm per row, like the engine's turbo keys; V the same width),
``turbo4-int8`` / ``turbo2-int8`` / ``turbo4-int16`` / ``turbo3-int16`` / ``turbo2-int16`` (the same, keys scored in
integers:
``Side.score_int8`` / ``score_int16``), ``pcaq4``
(calibrated keys, 4 bits per coordinate on average, widths and levels as the codec builds them from a fit
(``pcaq_tables``), turbo4 values; keys scored in float, as the engine scores them), ``pcaq4-int16`` (the same
keys scored in 16 bits, ``Side.score_int16``: a kernel option, see ``attention.PCAQ_KEY_INT_SCORING``) and
``per-head`` (a per-head
layer: the even KV heads k=turbo4 v=turbo2, the odd ones k=pcaq3 v=turbo3, each group its own side, one call;
its keys scored as the engine scores them, ``attention.key_scoring``). The engine's fused turbo4/turbo2
layers are the ``-int16`` rows (``KEY_INT_SCORING``); ``turbo4`` / ``turbo3`` / ``turbo2`` are the same keys scored
in float.
Shapes (``--shapes``): ``smollm2`` (3 KV heads x 64, 9 query heads), ``llama3-8b`` (8 x 128, 32), ``gemma3``
(Gemma-3-1B: 1 x 256, 4).

Per row: the bytes each token costs the layer (K + V, every KV head, every norm and code; the codec's
per-layer state is added to the call's bytes), the call's time (median), GB/s read, the fraction of the copy
bandwidth (bytes read + written per second of a 128 MiB copy at the same thread count, measured in this run),
and the time relative to the fp16 kernel: each round times every way once, in turn (baseline and candidates
interleaved), and the ratio is the median of the rounds' ratios. Timed cold where memory allows: round r reads
copy r of the way's store, not read since it was built, as long as the copies stay under ``--cold-mib`` (a
larger store is one copy, read every round: it is far larger than the 2 MiB L2 this process's core has; what a
shared L3 keeps is reported beside its size). Codes are random (the kernel's time
does not depend on their values). Records the CPU, threads, the kernel's ISA and the load average.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

from _common import ROOT, cpu_model, write_json
from _shapes import load_shape
from attention import last_level_cache_bytes

#: Gemma-3-1B's attention (its config.json: 4 heads, 1 KV head, head_dim 256); tqbench ships no Gemma-3 config
GEMMA3 = (1, 4, 256)
SHAPE_NAMES = ("smollm2", "llama3-8b", "gemma3")
WAYS = ("fp16", "bf16", "turbo4", "turbo3", "turbo2", "turbo4-int8", "turbo2-int8", "turbo4-int16", "turbo3-int16",
        "turbo2-int16",
        "pcaq4", "pcaq4-int16", "per-head")
BASE = "fp16"


def _list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="smollm2,llama3-8b,gemma3", help=f"comma list of {', '.join(SHAPE_NAMES)}")
    p.add_argument("--contexts", default="4096,8192,32768,65536", help="rows per KV head, comma list")
    p.add_argument("--threads", default="1,2", help="comma list of torch thread counts")
    p.add_argument("--ways", default=",".join(WAYS), help=f"comma list of {', '.join(WAYS)} (fp16 always runs)")
    p.add_argument("--repeats", type=int, default=7, help="rounds (each times every way once); medians")
    p.add_argument("--clock", default="auto", choices=("auto", "cpu", "wall"),
                   help="cpu: this process's CPU time (what other processes' load inflates least); wall; "
                        "auto: cpu at 1 thread, wall at more")
    p.add_argument("--cold-mib", type=int, default=256,
                   help="each way's store copies that a cold timing rotates through cover at least this many MiB "
                        "(or 4x the last-level cache, if smaller)")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "attention-roofline.json"))
    a = p.parse_args(argv)
    a.shapes = _list(a.shapes)
    a.ways = [BASE] + [w for w in _list(a.ways) if w != BASE]
    bad = [s for s in a.shapes if s not in SHAPE_NAMES] + [w for w in a.ways if w not in WAYS]
    if bad:
        p.error(f"unknown {', '.join(bad)}: shapes are {', '.join(SHAPE_NAMES)}; ways are {', '.join(WAYS)}")
    try:
        a.contexts = [int(x) for x in _list(a.contexts)]
        a.threads = [int(x) for x in _list(a.threads)]
    except ValueError:
        p.error("--contexts and --threads take comma lists of integers, e.g. --contexts 8192,32768 --threads 1,2")
    if not a.contexts or min(a.contexts) < 64 or not a.threads or min(a.threads) < 1 or a.repeats < 1:
        p.error("--contexts take >= 64 rows, --threads >= 1, --repeats >= 1")
    return a


def shape_of(name: str) -> tuple[int, int, int]:
    """(KV heads, query heads, head size)."""
    if name == "gemma3":
        return GEMMA3
    s = load_shape(name)
    return s.kv_heads, s.q_heads, s.head_dim


def pcaq_tables(h: int, d: int, mean_bits: int, gen):
    """(widths uint8 [h, d], levels float32 [h, d, 2**max width]) as the calibrated codec builds them: per head a
    fit (``calibrated_fit.fit_head``) of random keys with a decaying spectrum, widths water-filled to
    ``mean_bits`` per coordinate on average, each coordinate the Lloyd-Max levels of its group of ``GROUP`` at
    its width (coordinates of one group and width share their levels, as in the codec's tables)."""
    import torch

    from tqbench.engine.codecs.calibrated_fit import GROUP, fit_head, level_offset, water_fill

    widths, levels = [], []
    for _ in range(h):
        spectrum = torch.exp(-4.0 * torch.arange(d) / d).sqrt()
        mix = torch.linalg.qr(torch.randn(d, d, generator=gen))[0]
        fit = fit_head((torch.randn(2048, d, generator=gen) * spectrum) @ mix, torch.randn(256, d, generator=gen))
        w = water_fill(fit["var"], fit["mse"], mean_bits * d)
        lv = torch.zeros(d, 1 << int(w.max()))
        for j in range(d):
            if int(w[j]):
                lv[j, : 1 << int(w[j])] = fit["levels"][j // GROUP, level_offset(int(w[j])):][: 1 << int(w[j])].float()
        widths.append(w)
        levels.append(lv)
    top = max(x.shape[-1] for x in levels)
    levels = [torch.nn.functional.pad(x, (0, top - x.shape[-1])) for x in levels]
    return torch.stack(widths).to(torch.uint8), torch.stack(levels).contiguous()


class Builder:
    """Random stores of one shape: kernel ``Side``s and their bytes (per token, and the per-layer state)."""

    def __init__(self, mod, h: int, d: int, n: int, gen):
        self.mod, self.h, self.d, self.n, self.gen = mod, h, d, n, gen
        self.tables: dict = {}  # pcaq widths and levels per (heads, mean bits): fitted once, every copy shares them

    def dense(self, dtype, heads):
        import torch

        rows = torch.randn(1, len(heads), self.n, self.d, generator=self.gen).to(dtype)
        return self.mod.Side(head_dim=self.d, dense=[rows]), len(heads) * self.d * rows.element_size(), 0

    def turbo(self, bits: int, role: str, heads):
        import torch

        from tqbench.engine.codecs import codec_from_spec

        h, d, n = len(heads), self.d, self.n
        codec = codec_from_spec(f"turbo{bits}", role=role, center=role == "k")
        row = (d * bits + 7) // 8
        codes = torch.randint(0, 256, (1, h, n, row), generator=self.gen, dtype=torch.uint8)
        norms = (1 + 0.1 * torch.rand(1, h, n, 1, generator=self.gen)).half()
        mu = (0.1 * torch.randn(1, h, 1, d, generator=self.gen)).half() if role == "k" else None
        lev = codec.codebook_tensor(dtype=torch.float32, head_dim=d)
        rot = codec.rotation_tensor(dtype=torch.float32, head_dim=d)
        side = self.mod.Side(kind="turbo", bits=bits, head_dim=d, n_before=0, n_packed=n, codes=codes, norms=norms,
                             levels=lev, rotation=rot, mu=mu, dense=[])
        state = 2 * d * d + 4 * lev.numel() + (0 if mu is None else 2 * h * d)  # rotation as fp16 would be
        return side, h * (row + 2), state

    def pcaq(self, mean_bits: int, heads):
        import torch

        h, d, n = len(heads), self.d, self.n
        key = (tuple(heads), mean_bits)
        if key not in self.tables:
            self.tables[key] = pcaq_tables(h, d, mean_bits, self.gen)
        widths, levels = self.tables[key]
        row = (int(widths[0].sum()) + 7) // 8
        codes = torch.randint(0, 256, (1, h, n, row), generator=self.gen, dtype=torch.uint8)
        transform = torch.linalg.qr(torch.randn(h, d, d, generator=self.gen))[0].contiguous()
        mu = (0.1 * torch.randn(1, h, 1, d, generator=self.gen)).half()
        side = self.mod.Side(kind="pcaq", bits=int(widths.max()), head_dim=d, n_before=0, n_packed=n, codes=codes,
                             widths=widths, levels=levels, rotation=transform, mu=mu, dense=[])
        state = widths.numel() + 2 * (levels.numel() + transform.numel()) + 2 * mu.numel()
        return side, h * row, state

    def way(self, name: str):
        """([k sides], [v sides], bytes per token, state bytes): one side per group of heads."""
        import torch

        from tqbench.kernels.cpu.attention import key_scoring

        all_heads = list(range(self.h))
        if name in ("fp16", "bf16"):
            dt = torch.float16 if name == "fp16" else torch.bfloat16
            (k, bk, _), (v, bv, _) = self.dense(dt, all_heads), self.dense(dt, all_heads)
            return [k], [v], bk + bv, 0
        if name.startswith("turbo"):
            bits = int(name[5])
            (k, bk, sk), (v, bv, sv) = self.turbo(bits, "k", all_heads), self.turbo(bits, "v", all_heads)
            if "-" in name:  # keys scored in integers: Side.score_int8 / score_int16
                setattr(k, f"score_{name.split('-')[1]}", True)
            return [k], [v], bk + bv, sk + sv
        if name.startswith("pcaq4"):
            (k, bk, sk), (v, bv, sv) = self.pcaq(4, all_heads), self.turbo(4, "v", all_heads)
            if name == "pcaq4-int16":  # keys scored in 16 bits (a kernel option: PCAQ_KEY_INT_SCORING)
                k.score_int16 = True
            return [k], [v], bk + bv, sk + sv
        groups = [(all_heads[0::2], lambda hs: self.turbo(4, "k", hs), lambda hs: self.turbo(2, "v", hs)),
                  (all_heads[1::2], lambda hs: self.pcaq(3, hs), lambda hs: self.turbo(3, "v", hs))]
        ks, vs, per_token, state = [], [], 0, 0
        for heads, kf, vf in groups:
            if not heads:  # one KV head (gemma3): the layer is its first group alone
                continue
            (k, bk, sk), (v, bv, sv) = kf(heads), vf(heads)
            key_scoring(k, torch.float32)  # as the engine scores a group's keys (16-bit for turbo 4/2-bit)
            for s in (k, v):
                s.heads, s.kv_heads = heads, self.h
            ks.append(k)
            vs.append(v)
            per_token, state = per_token + bk + bv, state + sk + sv
        return ks, vs, per_token, state


def clock_of(name: str, threads: int):
    """(clock name, clock function)."""
    if name == "cpu" or (name == "auto" and threads == 1):
        return "cpu", time.process_time
    return "wall", time.perf_counter


def copy_bandwidth(clock) -> float:
    """GB/s (bytes read + bytes written) of a 128 MiB fp32 copy into a buffer already touched, median of 9."""
    import torch

    src = torch.ones(1 << 25)
    dst = torch.zeros_like(src)
    dst.copy_(src)
    times = []
    for _ in range(9):
        t = clock()
        dst.copy_(src)
        times.append(clock() - t)
    return 2 * src.numel() * 4 / statistics.median(times) / 1e9


def measure(mod, shape: str, n: int, ways: list[str], repeats: int, cold: int, clock, gen) -> list[dict]:
    """One (shape, context) at the current thread count: rounds of every way in turn."""
    import torch

    from tqbench.kernels.cpu.attention import native_attention_batch

    h, hq, d = shape_of(shape)
    build = Builder(mod, h, d, n, gen)
    q = torch.randn(1, hq, 1, d, generator=gen)
    stores, meta = {}, {}
    for w in ways:
        first = build.way(w)
        total = n * first[2] + first[3]
        copies = [first] + [build.way(w) for _ in range(min(repeats, -(-cold // total) - 1))]
        stores[w] = [(ks, vs) for ks, vs, _, _ in copies]
        meta[w] = (first[2], total, len(copies))
        native_attention_batch(q, *stores[w][0], d ** -0.5)  # warm-up (first-call costs)
    times = {w: [] for w in ways}
    for r in range(1, repeats + 1):
        for w in ways:
            ks, vs = stores[w][r % len(stores[w])]
            t = clock()
            native_attention_batch(q, ks, vs, d ** -0.5)
            times[w].append(clock() - t)
    rows = []
    for w in ways:
        per_token, total, copies = meta[w]
        t = statistics.median(times[w])
        rows.append({"shape": shape, "kv_heads": h, "q_heads": hq, "head_dim": d, "context": n, "way": w,
                     "bytes_per_token": per_token, "bytes_per_call": total, "ms": round(t * 1e3, 4),
                     "gbs": round(total / t / 1e9, 3), "copies": copies, "rotation_bytes": copies * total,
                     "time_vs_fp16": round(statistics.median(a / b for a, b in zip(times[w], times[BASE])), 4)})
    return rows


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch

    from tqbench.kernels.cpu import native_module, native_status
    from tqbench.kernels.cpu.attention import kernel_rules

    ok, why = native_status()
    if not ok:
        raise SystemExit(f"error: the native kernel cannot run here: {why}")
    mod = native_module()
    skipped = {}
    int_bits = kernel_rules()["score_int8_bits"]
    for w in [w for w in a.ways if w.startswith("turbo") and w.endswith(("-int8", "-int16"))]:
        if int(w[5]) not in int_bits:
            skipped[w] = (f"this CPU's kernel build scores {w[5]}-bit turbo keys in float only (integer scoring: "
                          f"{', '.join(map(str, int_bits)) or 'none'}-bit; needs AVX-512 VNNI, 3-bit VBMI too)")
            print(f"{w}: skipped, {skipped[w]}")
    if not kernel_rules()["score_int16_pcaq"] and "pcaq4-int16" in a.ways and "pcaq4-int16" not in skipped:
        skipped["pcaq4-int16"] = "this CPU's kernel build has no AVX-512 VBMI + VNNI (pcaq keys are scored in float)"
        print(f"pcaq4-int16: skipped, {skipped['pcaq4-int16']}")
    a.ways = [w for w in a.ways if w not in skipped]
    llc = last_level_cache_bytes("cpu")
    cold = min(4 * llc, a.cold_mib << 20)
    load0, t0 = os.getloadavg(), time.time()
    rows, bw, clocks = [], {}, {}
    for threads in a.threads:
        torch.set_num_threads(threads)
        clocks[threads], clock = clock_of(a.clock, threads)
        bw[threads] = copy_bandwidth(clock)
        for shape in a.shapes:
            for n in a.contexts:
                gen = torch.Generator().manual_seed(n)
                for r in measure(mod, shape, n, a.ways, a.repeats, cold, clock, gen):
                    rows.append(r | {"threads": threads, "clock": clocks[threads],
                                     "frac_copy_bw": round(r["gbs"] / bw[threads], 4)})
    load1 = os.getloadavg()
    isa = kernel_rules()["isa"]
    print(f"native kernel ({isa}) on {cpu_model()}, one decode token per call, median of {a.repeats} interleaved "
          f"rounds; each way rotates through store copies of >= {cold >> 20} MiB (last-level cache {llc >> 20} MiB); "
          "copy bandwidth (read + write) "
          + ", ".join(f"{bw[t]:.1f} GB/s at {t} thread{'s' * (t > 1)} ({clocks[t]} clock)" for t in a.threads)
          + f"; load average {load0[0]:.2f} -> {load1[0]:.2f}")
    cols = ("shape", "context", "threads", "way", "bytes/token", "ms", "GB/s", "% copy bw", "time vs fp16")
    print("  ".join(f"{c:>12}" for c in cols))
    for r in rows:
        cells = (r["shape"], r["context"], r["threads"], r["way"], r["bytes_per_token"], f"{r['ms']:.3f}",
                 f"{r['gbs']:.2f}", f"{100 * r['frac_copy_bw']:.1f}%", f"{r['time_vs_fp16']:.3f}")
        print("  ".join(f"{c:>12}" for c in cells))
    summary: dict = {}
    for r in rows:
        cell = summary.setdefault(r["shape"], {}).setdefault(str(r["context"]), {}).setdefault(str(r["threads"]), {})
        cell[r["way"]] = {"time_vs_fp16": r["time_vs_fp16"], "frac_copy_bw": r["frac_copy_bw"]}
    write_json(a.json, {
        "command": [sys.executable, *sys.argv] if argv is None else ["attention_roofline.py", *argv],
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_model(), "isa": isa, "threads": a.threads, "torch": torch.__version__,
        "copy_bandwidth_gbs": {str(t): round(b, 2) for t, b in bw.items()},
        "copy_bandwidth_counts": "bytes read + bytes written per second (a 128 MiB fp32 copy)",
        "last_level_cache_bytes": llc, "rotation_min_bytes": cold, "clocks": {str(t): c for t, c in clocks.items()},
        "repeats": a.repeats, "seconds": round(time.time() - t0, 1),
        "loadavg_before": list(load0), "loadavg_after": list(load1),
        "time_vs_fp16": "median over interleaved rounds of (this way's call time / the fp16 kernel's in that round)",
        "summary": summary, "skipped_ways": skipped, "rows": rows,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
