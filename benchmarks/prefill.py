"""Prefill without the dense cache: peak memory of a long prefill (dense vs chunked into the compressed store) and
the quality cost of chunking (teacher-forced KL, chunked vs one-call prefill).

``python benchmarks/prefill.py memory --shape llama3-8b --context 32768 --chunk 1024 --threads 2``: each variant
runs in a fresh subprocess on the same random-weight model (``_shapes.random_model``: the family's real attention
shapes, ``--layers`` layers, the real MLP unless ``--intermediate``) and reports its peak RSS (``VmHWM``, the
model's weights included in every variant), the RSS after building the model, and the store's own peak of dense
K/V (``TQCache.peak_dense_kv_bytes``). Variants: ``dense`` (DynamicCache, the whole prompt in one forward call),
``dense-chunked`` (DynamicCache, the prompt in chunks: only the activations shrink) and ``fused-chunked`` (the
policy in fused mode, chunks appended into the packed store as they go).

``python benchmarks/prefill.py quality --context 1024 --tokens 128 --chunks 0,128,256 --threads 2``: the default
model, teacher-forced KL against the dense baseline for each chunk size (0 = one call) on the shipped corpus texts
(prose) and a Python source file of tqbench (code); the baseline always prefills in one exact call.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from _common import cpu_model, write_json
from _shapes import SHAPES, load_shape, random_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
VARIANTS = ("dense", "dense-chunked", "fused-chunked")
CODE_TEXT = ROOT / "tqbench" / "engine" / "cache" / "tqcache.py"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    m = sub.add_parser("memory", help="peak RSS of one long prefill per variant (fresh subprocesses)")
    m.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    m.add_argument("--layers", type=int, default=4)
    m.add_argument("--intermediate", type=int, default=None, help="MLP width (default: the real one)")
    m.add_argument("--context", type=int, default=32768)
    m.add_argument("--chunk", type=int, default=1024)
    m.add_argument("--policy", default="turbo4")
    m.add_argument("--variants", default=",".join(VARIANTS))
    m.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    q = sub.add_parser("quality", help="teacher-forced KL of chunked vs one-call prefill on the default model")
    q.add_argument("--model", default="default")
    q.add_argument("--context", type=int, default=1024, help="prefill tokens")
    q.add_argument("--tokens", type=int, default=128, help="scored tokens after the prefill")
    q.add_argument("--chunks", default="0,128,256", help="prefill chunk sizes (0 = one call)")
    q.add_argument("--policy", default="turbo4", help="';'-separated policies, e.g. 'turbo4;turbo4,sparsev=0.001'")
    q.add_argument("--mode", default="fused")
    q.add_argument("--texts", default="bread,lighthouses,rivers,code", help="corpus texts (+ code: a tqbench source)")
    for sp in (m, q):
        sp.add_argument("--threads", type=int, default=None)
        sp.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.what == "memory":
        a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
        bad = sorted(set(a.variants) - set(VARIANTS))
        if bad or a.context < 2 or a.chunk < 1:
            p.error(f"unknown --variants {bad}: use {', '.join(VARIANTS)}" if bad else "need --context >= 2, --chunk >= 1")
        a.json = a.json or str(ROOT / "benchmarks" / "results" / f"prefill-memory-{a.shape}-{a.context}.json")
    else:
        a.chunks = [int(x) for x in a.chunks.split(",") if x.strip()]
        a.json = a.json or str(ROOT / "benchmarks" / "results" / "prefill-quality.json")
    return a


def vm_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def memory_worker(args) -> dict:
    """One variant in this (fresh) process: build the model, prefill, report peak RSS."""
    import torch

    from tqbench.engine.engine import Engine
    from tqbench.engine.generate import prefill

    if args.threads:
        torch.set_num_threads(args.threads)
    shape = load_shape(args.shape)
    engine = Engine(random_model(shape, args.layers, intermediate=args.intermediate, context=args.context + 1))
    if args.worker == "fused-chunked":
        engine.enable_fused()
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    rss_model = vm_kib("VmRSS") * 1024
    ids = torch.randint(4, engine.config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))
    cache = engine.make_cache(None if args.worker.startswith("dense") else args.policy,
                              "fused" if args.worker == "fused-chunked" else "compressed")
    t = time.perf_counter()
    logits, _ = prefill(engine.model, ids, cache, chunk=0 if args.worker == "dense" else args.chunk)
    seconds = time.perf_counter() - t
    out = {"variant": args.worker, "peak_rss_bytes": vm_kib("VmHWM") * 1024, "rss_after_model_bytes": rss_model,
           "weights_bytes": weights, "prefill_s": round(seconds, 2), "tokens": args.context,
           "chunk": 0 if args.worker == "dense" else args.chunk, "finite_logits": bool(torch.isfinite(logits).all())}
    if hasattr(cache, "peak_dense_kv_bytes"):
        rep = cache.report()
        out |= {"store_peak_dense_kv_bytes": cache.peak_dense_kv_bytes(), "fused_impl": rep.fused_impl,
                "fallbacks": rep.fallbacks, "compressed_storage_bytes": rep.compressed_storage_bytes}
    else:
        out["dense_kv_bytes"] = sum(la.keys.numel() * la.keys.element_size() + la.values.numel() * la.values.element_size()
                                    for la in cache.layers)
    return out


def memory(args, console) -> dict:
    rows = []
    for variant in args.variants:
        cmd = [sys.executable, __file__, "memory", "--worker", variant, "--shape", args.shape, "--layers",
               str(args.layers), "--context", str(args.context), "--chunk", str(args.chunk), "--policy", args.policy]
        cmd += ["--intermediate", str(args.intermediate)] if args.intermediate else []
        cmd += ["--threads", str(args.threads)] if args.threads else []
        with console.status(f"{variant}: prefill of {args.context} tokens ..."):
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode:
            raise SystemExit(f"{variant} failed:\n{proc.stderr[-3000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    dense = next((r for r in rows if r["variant"] == "dense"), None)
    for r in rows:
        r["peak_vs_dense"] = round(r["peak_rss_bytes"] / dense["peak_rss_bytes"], 4) if dense else None
    return {"rows": rows}


def quality(args, console) -> dict:
    import torch

    from tqbench.engine.engine import Engine
    from tqbench.engine.validate.quality import baseline_logprobs, corpus_ids, teacher_forced

    engine = Engine.load(args.model, threads=args.threads)
    n = args.context + args.tokens + 1
    wanted = [x.strip() for x in args.texts.split(",") if x.strip()]
    texts = {name: corpus_ids(engine.tokenizer, name, n) for name in wanted if name != "code"}
    if "code" in wanted:
        code = engine.tokenizer(CODE_TEXT.read_text(encoding="utf-8"), return_tensors="pt")["input_ids"]
        if code.shape[1] < n:
            raise SystemExit(f"{CODE_TEXT.name} has {code.shape[1]} tokens, fewer than the {n} needed")
        texts["code:tqcache.py"] = code[:, :n]
    rows = []
    policies = [x.strip() for x in args.policy.split(";") if x.strip()]
    for name, ids in texts.items():
        base = baseline_logprobs(engine, ids, args.context)
        for policy in policies:
            for chunk in args.chunks:
                t = time.perf_counter()
                r = teacher_forced(engine, ids, args.context, policy, args.mode, baseline=base, prefill_chunk=chunk)
                rows.append(row(name, policy, chunk, r, t))
                console.print(f"{name} {policy} chunk {chunk}: KL {r.kl_mean:.5f} top-1 {r.top1_agreement:.3f} "
                              f"({rows[-1]['seconds']} s)")
    del torch
    return {"model": engine.name, "rows": rows}


def row(name, policy, chunk, r, t) -> dict:
    return {"text": name, "policy": policy, "chunk": chunk, "kl_mean": r.kl_mean, "kl_max": r.kl_max,
            "top1_agreement": r.top1_agreement, "ppl_baseline": r.ppl_baseline, "ppl_candidate": r.ppl_candidate,
            "seconds": round(time.perf_counter() - t, 2)}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.what == "memory" and args.worker:
        print(json.dumps(memory_worker(args)))
        return 0
    load_before = os.getloadavg()
    import torch
    from rich.console import Console
    from rich.table import Table

    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console() if sys.stdout.isatty() else Console(width=160)
    res = memory(args, console) if args.what == "memory" else quality(args, console)
    load_after = os.getloadavg()
    if args.what == "memory":
        t = Table(title=f"peak RSS of a {args.context}-token prefill, random {args.shape} ({args.layers} layers), "
                        f"chunk {args.chunk}, {args.policy}; weights counted in every row")
        for col in ("variant", "peak RSS", "vs dense", "RSS after model", "weights", "store peak dense K/V",
                    "prefill s"):
            t.add_column(col, justify="left" if col == "variant" else "right")
        gib = 2 ** 30
        for r in res["rows"]:
            store = r.get("store_peak_dense_kv_bytes")
            t.add_row(r["variant"], f"{r['peak_rss_bytes'] / gib:.2f} GiB",
                      "-" if r["peak_vs_dense"] is None else f"{100 * r['peak_vs_dense']:.0f}%",
                      f"{r['rss_after_model_bytes'] / gib:.2f} GiB", f"{r['weights_bytes'] / gib:.2f} GiB",
                      "-" if store is None else f"{store / 2**20:.1f} MiB", f"{r['prefill_s']:.1f}")
    else:
        t = Table(title=f"teacher-forced KL vs the dense baseline, {res['model']}, {args.mode} mode, "
                        f"prefill {args.context} + {args.tokens} scored")
        for col in ("text", "policy", "prefill chunk", "KL mean", "KL max", "top-1", "ppl base", "ppl cand"):
            t.add_column(col, justify="left" if col in ("text", "policy") else "right")
        for r in res["rows"]:
            t.add_row(r["text"], r["policy"], str(r["chunk"] or "one call"), f"{r['kl_mean']:.5f}", f"{r['kl_max']:.4f}",
                      f"{r['top1_agreement']:.3f}", f"{r['ppl_baseline']:.3f}", f"{r['ppl_candidate']:.3f}")
    console.print(t)
    console.print(f"load average {load_before[0]:.2f} -> {load_after[0]:.2f} (1 min), {torch.get_num_threads()} "
                  f"threads, {cpu_model()}")
    out = {"command": [sys.executable, *sys.argv] if argv is None else ["prefill.py", *argv],
           "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
           "cpu": cpu_model(), "loadavg_before": list(load_before), "loadavg_after": list(load_after),
           "args": {k: v for k, v in vars(args).items() if k not in ("json", "worker")}} | res
    write_json(args.json, out, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
