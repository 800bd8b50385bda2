"""Decode tokens/s of every cache mode, as ratios against a dense ``DynamicCache`` run in the same process.

``python benchmarks/decode.py [--contexts 1024,4096] [--policies turbo4,q8k-int4v] [--threads N] [--quick]
[--baseline dense-fp16]`` (see ``--help``).

``--baseline``: the dense cache the ratios are against (``tqbench.constants.DENSE_BASELINES``): ``dense`` (the
default; K/V in the model's dtype, float32 on CPU), ``dense-fp16`` / ``dense-bf16`` (K/V rows stored in 16 bits,
as llama.cpp's f16 cache, upcast for the model's attention), ``dense-fp16-kernel`` / ``dense-bf16-kernel`` (the
same rows read as stored by the native CPU kernel, as engines read an f16 cache: exit 2, saying why, where the
kernel cannot run). The JSON names it, its K/V dtype and how its attention reads the rows.

``--shape llama3-8b`` (qwen3-8b, mistral-7b, smollm2: ``_shapes.SHAPES``) times a random-weight model of that
family with the real attention shapes (hidden size, query/KV heads, head size) and ``--layers`` layers (4;
vocabulary 512 so it fits in memory; the real MLP width unless ``--intermediate``) at contexts up to 128K:
every cache (the dense ``DynamicCache`` baseline and each policy x mode) is filled to the context with the
same random K/V rows through its own ``update`` (the cache's real append path; no model prefill, which takes
minutes per 32K prompt on a CPU), then ``--new-tokens`` decode steps of the model are timed. For each context, runs are interleaved (per repeat: the baseline, then every policy x
mode) and the median decode tok/s is reported (``GenerationResult.decode_tokens_per_second``: decode steps
only, the prefill token excluded); a summary gives fused vs dense and fused vs compressed per context.
Every configuration is warmed up once on a short prompt first, so one-time costs (codebooks, rotations,
the fused attention switch, which also reroutes the baseline's attention) are not timed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
from pathlib import Path

from _common import add_baseline_arg, check_baselines, cpu_model, write_json
from _shapes import SHAPES, load_shape, random_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CORPUS = ROOT / "tqbench" / "data" / "corpus"
MODES = ("dense-shadow", "simulate", "compressed", "fused")
REPORT_KEYS = ("resident_decode_bytes", "active_decode_memory_saved_pct", "compressed_storage_bytes",
               "dense_fp16_bytes", "memory_saved_pct", "bits_per_element", "fused_calls")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="1024,4096", help="comma-separated prompt lengths (tqbench/data/corpus)")
    p.add_argument("--context", type=int, default=None, help="one prompt length (overrides --contexts)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--policies", default="turbo4,q8k-int4v", help="comma-separated presets or compact policies")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "decode.json"))
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="auto")
    add_baseline_arg(p)
    p.add_argument("--quick", action="store_true", help="context 256, 8 new tokens, 1 repeat (smoke test)")
    p.add_argument("--shape", default=None, choices=sorted(SHAPES),
                   help="a random-weight model with this real model's attention shapes (instead of --model)")
    p.add_argument("--layers", type=int, default=4, help="--shape: decoder layers")
    p.add_argument("--intermediate", type=int, default=None, help="--shape: MLP width (default: the real one)")
    a = p.parse_args(argv)
    if a.shape and a.model != "default":
        p.error("--shape builds its own random-weight model: drop --model")
    try:
        a.contexts = [a.context] if a.context else [int(x) for x in a.contexts.split(",") if x.strip()]
    except ValueError:
        p.error(f"--contexts takes comma-separated integers, got {a.contexts!r}")
    if a.quick:
        a.contexts, a.new_tokens, a.repeats = [256], 8, 1
    a.policies = split_policies(a.policies)
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = sorted(set(a.modes) - set(MODES))
    if bad or not a.contexts or min(a.contexts) < 1 or a.new_tokens < 2 or a.repeats < 1:
        p.error(f"bad --modes {bad}" if bad else "need contexts >= 1, --new-tokens >= 2, --repeats >= 1")
    return a


def split_policies(text: str) -> list[str]:
    """``turbo4,k=int8,v=int4,q8k-int4v`` -> ``[turbo4,k=int8,v=int4]``, ``[q8k-int4v]``: key=value parts
    continue the policy before them (a compact policy holds commas)."""
    out: list[str] = []
    for part in (s.strip() for s in text.split(",")):
        if part and "=" in part and out:
            out[-1] += "," + part
        elif part:
            out.append(part)
    return out




def corpus_ids(engine, n: int):
    """Exactly ``n`` token ids ``[1, n]`` of the corpus texts, concatenated (repeated if short)."""
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(CORPUS.glob("*.txt")))
    while len(text) < 16 * n:
        text += "\n\n" + text
    chars = 2 * n
    # the tokenizer itself (not encode_prompt): a prefix longer than the model's context is cut to n below
    while (ids := engine.tokenizer(text[:chars], return_tensors="pt")["input_ids"]).shape[1] < n:
        chars *= 2
    return ids[:, :n].contiguous()


class AppendClock:
    """Time spent in ``KVStore.append`` on one-token calls (the decode step's quantize + pack + append)."""

    def __init__(self) -> None:
        import time

        from tqbench.engine.cache.store import KVStore

        self.seconds = 0.0
        original = KVStore.append
        clock = self

        def timed(store, x, *a, **kw):
            if x.shape[2] != 1:
                return original(store, x, *a, **kw)
            t = time.perf_counter()
            try:
                return original(store, x, *a, **kw)
            finally:
                clock.seconds += time.perf_counter() - t

        KVStore.append = timed

    def lap(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s


def measure(engine, args, context, console) -> tuple[dict, list[dict]]:
    """Interleaved repeats of the baseline and every policy x mode at one context: (baseline row, rows)."""
    ids = corpus_ids(engine, context)
    configs = [(args.baseline, "dynamic")] + [(p, m) for p in args.policies for m in args.modes]

    def run(policy, mode, prompt, n):
        if mode == "dynamic":
            return engine.generate(prompt, policy, max_new_tokens=n, stop_at_eos=False)
        return engine.generate(prompt, policy, mode, max_new_tokens=n, stop_at_eos=False)

    with console.status("warming up ..."):
        for policy, mode in configs:
            run(policy, mode, ids[:, : min(64, context)], 3)
    results: dict[tuple, list] = {c: [] for c in configs}
    append: dict[tuple, list] = {c: [] for c in configs}
    clock = AppendClock()
    with console.status("measuring ...") as status:
        for r in range(args.repeats):
            for i, (policy, mode) in enumerate(configs):
                status.update(f"context {context}, repeat {r + 1}/{args.repeats}: {label(policy)} "
                              f"{mode} ({i + 1}/{len(configs)})")
                clock.lap()
                res = run(policy, mode, ids, args.new_tokens)
                results[(policy, mode)].append(res)
                steps = args.new_tokens - 1  # decode steps (the prefill token excluded)
                append[(policy, mode)].append((clock.lap(), steps / res.decode_tokens_per_second, steps))

    def median_tps(runs):
        return statistics.median(x.decode_tokens_per_second for x in runs)

    base_tps = median_tps(results[configs[0]])
    rows = []
    for (policy, mode), runs in results.items():
        rep, tps = runs[-1].cache_report, median_tps(runs)
        rows.append({
            "context": context, "policy": label(policy), "mode": mode, "decode_tok_s": round(tps, 3),
            "decode_tok_s_runs": [round(x.decode_tokens_per_second, 3) for x in runs],
            "ratio_vs_dense": round(tps / base_tps, 4) if base_tps else None,
            "prefill_s": round(statistics.median(x.prefill_seconds for x in runs), 4),
            # quantize + pack + append of the step's new rows (every layer, K and V), per decode step
            "append_ms_per_step": round(1e3 * statistics.median(a / n for a, _, n in append[(policy, mode)]), 4),
            "append_share": round(statistics.median(a / t for a, t, _ in append[(policy, mode)]), 4),
        } | {k: getattr(rep, k, None) for k in REPORT_KEYS})
        if rep is not None and mode == "fused":
            rows[-1]["fused_impl"] = rep.fused_impl
            rows[-1]["fallbacks"] = rep.fallbacks
    rows[0]["kv_dtype"] = engine.baseline_kv_dtype(args.baseline)
    return rows[0], rows[1:]


def label(policy: str) -> str:
    """A row's policy: the baseline's name (``dynamic-cache`` for ``dense``, as before there were others)."""
    return "dynamic-cache" if policy == "dense" else policy


def fill_cache(cache, config, k_rows, v_rows) -> None:
    """Put the same K/V rows into every layer of ``cache`` through its own ``update`` (per-layer rows)."""
    for layer in range(config.num_hidden_layers):
        cache.update(k_rows[layer], v_rows[layer], layer)


def measure_filled(engine, args, context, console) -> tuple[dict, list[dict]]:
    """``--shape``: every cache filled with the same random K/V rows to ``context``, then interleaved repeats
    of ``--new-tokens`` timed decode steps (random token ids); (baseline row, rows) as ``measure``."""
    import time

    import torch

    from tqbench.engine.cache.tqcache import TQCache
    from tqbench.engine.generate import _forward

    cfg = engine.config
    geo = engine.geometry
    gen = torch.Generator().manual_seed(context)
    shape = (1, geo.kv_heads, context, geo.head_dim)
    configs = [(args.baseline, "dynamic")] + [(p, m) for p in args.policies for m in args.modes]
    caches, fill_s = {}, {}
    with console.status(f"filling caches to {context} tokens ..."):
        for policy, mode in configs:
            k_rows = [torch.randn(shape, generator=torch.Generator().manual_seed(2 * i)) for i in range(geo.num_layers)]
            v_rows = [torch.randn(shape, generator=torch.Generator().manual_seed(2 * i + 1))
                      for i in range(geo.num_layers)]
            cache = engine.make_cache(policy, mode)
            t = time.perf_counter()
            fill_cache(cache, cfg, k_rows, v_rows)
            fill_s[(policy, mode)] = time.perf_counter() - t
            caches[(policy, mode)] = cache
            del k_rows, v_rows
    ids = torch.randint(4, cfg.vocab_size, (args.repeats + 1, args.new_tokens), generator=gen)
    for c in configs:  # warm-up: one step per cache (the fused switch, codebooks, the kernel's first call)
        _forward(engine.model, ids[-1:, :1], caches[c])
    steps: dict[tuple, list] = {c: [] for c in configs}
    append: dict[tuple, list] = {c: [] for c in configs}
    clock = AppendClock()
    with console.status("measuring ...") as status:
        for r in range(args.repeats):
            for c in configs:
                status.update(f"context {context}, repeat {r + 1}/{args.repeats}: {label(c[0])} {c[1]}")
                clock.lap()
                times = []
                for j in range(args.new_tokens):
                    t = time.perf_counter()
                    _forward(engine.model, ids[r : r + 1, j : j + 1], caches[c])
                    times.append(time.perf_counter() - t)
                steps[c].append(times)
                append[c].append((clock.lap(), sum(times), len(times)))
    base_tps = statistics.median(len(t) / sum(t) for t in steps[configs[0]])
    rows = []
    for c in configs:
        policy, mode = c
        cache = caches[c]
        rep = cache.report() if isinstance(cache, TQCache) else None
        tps = statistics.median(len(t) / sum(t) for t in steps[c])
        rows.append({
            "context": context, "policy": label(policy), "mode": mode, "decode_tok_s": round(tps, 3),
            "decode_tok_s_runs": [round(len(t) / sum(t), 3) for t in steps[c]],
            "ratio_vs_dense": round(tps / base_tps, 4), "prefill_s": round(fill_s[c], 4), "fill": "random K/V",
            "append_ms_per_step": round(1e3 * statistics.median(a / n for a, _, n in append[c]), 4),
            "append_share": round(statistics.median(a / t for a, t, _ in append[c]), 4),
        } | {k: getattr(rep, k, None) for k in REPORT_KEYS})
        if rep is not None and mode == "fused":
            rows[-1]["fused_impl"] = rep.fused_impl
            rows[-1]["fallbacks"] = rep.fallbacks
    caches.clear()
    rows[0]["kv_dtype"] = engine.baseline_kv_dtype(args.baseline)
    return rows[0], rows[1:]


def summary(rows: list[dict]) -> list[dict]:
    """Per context and policy: fused vs dense and fused vs compressed."""
    out = []
    by = {(r["context"], r["policy"], r["mode"]): r for r in rows}
    for (ctx, pol, mode), r in by.items():
        if mode != "fused":
            continue
        comp = by.get((ctx, pol, "compressed"))
        out.append({"context": ctx, "policy": pol, "fused_vs_dense": r["ratio_vs_dense"],
                    "fused_vs_compressed": round(r["decode_tok_s"] / comp["decode_tok_s"], 3) if comp else None})
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()
    import torch
    import transformers
    from rich.console import Console
    from rich.table import Table

    from tqbench.constants import DENSE_BASELINE_ATTENTION, dense_baseline_label
    from tqbench.engine.engine import Engine

    console = Console() if sys.stdout.isatty() else Console(width=150)  # no wrapped cells in logs
    if args.shape:
        if args.threads:
            torch.set_num_threads(args.threads)
        shape = load_shape(args.shape)
        engine = Engine(random_model(shape, args.layers, intermediate=args.intermediate,
                                     context=max(args.contexts) + args.new_tokens + 1))
        console.print(f"{engine.name}: {shape.describe()}, {args.layers} layers, MLP "
                      f"{engine.config.intermediate_size}, {engine.loaded.num_params / 1e6:.0f}M params "
                      f"({engine.loaded.num_params * 4 / 2**30:.2f} GiB fp32); caches filled with random K/V")
    else:
        engine = Engine.load(args.model, dtype=args.dtype, threads=args.threads)
    if engine.max_context and max(args.contexts) + args.new_tokens > engine.max_context:
        raise SystemExit(f"contexts + --new-tokens exceed {engine.name}'s context of {engine.max_context}")
    check_baselines([args.baseline], engine)  # a kernel-attended baseline where the kernel cannot run: exit 2, why
    per_context = []
    for context in args.contexts:
        baseline, rows = (measure_filled if args.shape else measure)(engine, args, context, console)
        per_context.append({"context": context, "baseline": baseline, "rows": rows})
        table = Table(title=f"decode: {engine.name}, {context} ctx{' (filled)' if args.shape else ''} + "
                            f"{args.new_tokens} new, "
                            f"{torch.get_num_threads()} threads, median of {args.repeats}")
        for col in ("policy", "mode", "decode tok/s", f"vs {args.baseline}", "fill s" if args.shape else "prefill s", "append/step", "resident KV", "saved",
                    "bits/el"):
            table.add_column(col, justify="left" if col in ("policy", "mode") else "right")
        for row in [baseline, *rows]:
            res = row["resident_decode_bytes"]
            table.add_row(
                row["policy"], row["mode"], f"{row['decode_tok_s']:.2f}", f"{row['ratio_vs_dense']:.2f}x",
                f"{row['prefill_s']:.2f}",
                "-" if res is None else f"{row['append_ms_per_step']:.2f} ms ({100 * row['append_share']:.0f}%)",
                "-" if res is None else f"{res / 2**20:.2f} MiB",
                "-" if res is None else f"{row['active_decode_memory_saved_pct']:.1f}%",
                "-" if res is None else f"{row['bits_per_element']:.2f}",
            )
        console.print(table)
    load_after = os.getloadavg()
    summ = summary([r for c in per_context for r in c["rows"]])
    if summ:
        t = Table(title="fused decode tok/s ratios")
        for col in ("context", "policy", f"fused / {args.baseline}", "fused / compressed"):
            t.add_column(col, justify="left" if col == "policy" else "right")
        for s in summ:
            t.add_row(str(s["context"]), s["policy"], f"{s['fused_vs_dense']:.2f}x",
                      "-" if s["fused_vs_compressed"] is None else f"{s['fused_vs_compressed']:.2f}x")
        console.print(t)
    kv_dtype = engine.baseline_kv_dtype(args.baseline)
    model_dtype = str(engine.loaded.dtype).replace("torch.", "")
    console.print(f"baseline: {dense_baseline_label(args.baseline, model_dtype)}; the model computes in {model_dtype}")
    console.print(f"load average {load_before[0]:.2f} -> {load_after[0]:.2f} (1 min), {cpu_model()}")

    out = {
        "command": [sys.executable, *sys.argv] if argv is None else ["decode.py", *argv],
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": engine.name, "dtype": str(engine.loaded.dtype).replace("torch.", ""),
        "device": str(engine.loaded.device), "contexts": args.contexts, "new_tokens": args.new_tokens,
        "repeats": args.repeats, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "transformers": transformers.__version__, "python": platform.python_version(), "cpu": cpu_model(),
        "loadavg_before": list(load_before), "loadavg_after": list(load_after),
        "baseline": args.baseline, "baseline_kv_dtype": kv_dtype,
        "baseline_attention": DENSE_BASELINE_ATTENTION[args.baseline],
        "results": per_context, "summary": summ, "shape": args.shape,
        "layers": args.layers if args.shape else None,
        "intermediate_size": getattr(engine.config, "intermediate_size", None), "num_params": engine.loaded.num_params,
    }
    write_json(args.json, out, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
