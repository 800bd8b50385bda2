"""Decode tokens/s of llama.cpp's KV caches beside tqbench's, same model, contexts and threads; each system's
quantized / 16-bit ratio.

    python benchmarks/engines.py [--contexts 1024,4096,8192,16384] [--threads 2] [--steps 32] [--rounds 2]

llama.cpp: ``llama-bench -m GGUF -d CONTEXT -n STEPS -p 0 -t THREADS -fa 1 -ctk T -ctv T -r 1 -o json`` for T in
``--llamacpp-types`` (f16, q8_0, q4_0), its tools found or built by ``tqbench.engine.deploy.llamacpp`` (a build
takes minutes, once; ``--no-build`` skips llama.cpp instead, saying why). It runs the model's GGUF file as it is
(the default model's is Q4_1 weights), so only the ratios within each system compare across systems.

tqbench: corpus text of the longest context is prefilled once into a dense cache; at each context, every cache
under test (``dense``: float32 K/V; ``dense-fp16``: K/V rows stored in 16 bits, upcast for attention;
``dense-fp16-kernel``: the same rows read as stored by the native kernel, as llama.cpp reads its f16 cache, and
tqbench's own 16-bit cache in the ratios (where the kernel cannot run: dense-fp16, and the report says why); each
``--policies`` entry in the fused mode) is filled with the first ``CONTEXT`` rows through its own ``update`` (the
rows a prefill of that length gives: attention is causal); then ``STEPS`` greedy decode
steps are timed per cache (2 warm-up steps first). Each round runs every tqbench cache, then every llama.cpp type,
so the two systems see the same machine load; the best round counts (the machine may be shared: the load average
is recorded before and after every context). Contexts past the model's trained context (8192 for the default
model) time the same computation; their tokens are not meaningful, and the table says so.
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

from _common import ROOT, cpu_model, write_json

from tqbench.constants import DENSE_BASELINE_ATTENTION, dense_baseline_label

LLAMA_BITS = {"f16": 16.0, "bf16": 16.0, "q8_0": 8.5, "q5_1": 6.0, "q5_0": 5.5, "q4_1": 5.0, "q4_0": 4.5,
              "iq4_nl": 4.5}  # bits per element of each GGML KV type (block scales included)
DENSE = ("dense", "dense-fp16", "dense-fp16-kernel")  # tqbench's dense baselines: 32- and 16-bit K/V, float32 model
OWN_16BIT = "dense-fp16-kernel"  # tqbench's 16-bit cache in the ratios: read as stored, as llama.cpp reads its f16
TARGETS = {8192: 1.5, 16384: 2.0}  # issue 31: fused turbo4 decode vs tqbench's fp16-K/V dense baseline
#: llama-bench options beyond the measured ones: llama.cpp 11434 built -march=native on an AMX/AVX512-FP16 Xeon
#: crashes (SIGSEGV) in batched prompt processing (the -d depth fill) with the Q4_1 weights repacked for the CPU;
#: --repack 0 keeps them as stored in the GGUF (decode speed then reads the GGUF's own layout)
LLAMA_EXTRA = ("--repack", "0")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="a model spec (default: SmolLM2-135M-Instruct; tiny: smoke)")
    p.add_argument("--contexts", default="1024,4096,8192,16384")
    p.add_argument("--threads", type=int, default=2, help="torch threads and llama-bench -t")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per run (llama-bench -n)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the best counts")
    p.add_argument("--policies", default="turbo4;smollm2-head-2.5bit;smollm2-head-3.5bit",
                   help="';'-separated tqbench policies, run in the fused mode")
    p.add_argument("--llamacpp-types", default="f16,q8_0,q4_0", help="llama.cpp KV types (-ctk/-ctv)")
    p.add_argument("--no-build", action="store_true", help="do not build llama.cpp when it is not built yet")
    p.add_argument("--prefill-chunk", type=int, default=2048, help="tqbench's one prefill, in calls of this size")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "engines.json"))
    a = p.parse_args(argv)
    try:
        a.contexts = [int(c) for c in a.contexts.split(",") if c.strip()]
    except ValueError:
        p.error(f"--contexts takes comma-separated integers, got {a.contexts!r}")
    a.types = [t.strip() for t in a.llamacpp_types.split(",") if t.strip()]
    bad = [t for t in a.types if t not in LLAMA_BITS]
    if bad:
        p.error(f"unknown llama.cpp KV type {bad[0]!r}: valid types are {', '.join(LLAMA_BITS)}")
    if "f16" not in a.types:
        p.error("--llamacpp-types must include f16 (the 16-bit cache the ratios are against)")
    if not a.contexts or min(a.contexts) < 16 or a.steps < 2 or a.rounds < 1 or a.threads < 1:
        p.error("need contexts >= 16, --steps >= 2, --rounds >= 1, --threads >= 1")
    return a


# ---- llama.cpp --------------------------------------------------------------------------------------------
def find_llama_bench(engine, no_build: bool) -> tuple[str | None, str, str | None]:
    """(llama-bench's path or None, the GGUF to run, why llama.cpp is skipped or None)."""
    gguf = engine.loaded.source.gguf_path
    if gguf is None:
        return None, "", (f"{engine.name} is not a GGUF model: llama-bench runs GGUF files (pass the default model "
                          "or a .gguf)")
    try:
        from tqbench.engine.deploy.llamacpp import LlamaCppUnavailable, build_llamacpp, find_llamacpp_tool
    except ImportError as exc:
        return None, str(gguf), f"this tqbench has no llama.cpp component ({exc})"
    tool = find_llamacpp_tool("llama-bench")
    if tool is None and no_build:
        return None, str(gguf), "llama.cpp is not built yet and --no-build was given"
    if tool is None:
        try:
            tool = build_llamacpp().tool("llama-bench")  # says what it does on stderr; minutes, once
        except LlamaCppUnavailable as exc:
            return None, str(gguf), f"llama.cpp could not be built: {exc}"
    return str(tool), str(gguf), None


def llama_bench(tool: str, gguf: str, context: int, kv: str, steps: int, threads: int) -> dict:
    """One ``llama-bench`` run (one repetition): decode tok/s of ``steps`` tokens at depth ``context``."""
    cmd = [tool, "-m", gguf, "-d", str(context), "-n", str(steps), "-p", "0", "-t", str(threads), "-fa", "1",
           "-ctk", kv, "-ctv", kv, "-r", "1", "-o", "json", *LLAMA_EXTRA]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        how = "crashed with SIGSEGV" if proc.returncode in (-11, 139) else f"failed (exit {proc.returncode})"
        raise RuntimeError(f"llama-bench {how} for -ctk {kv} at -d {context}: {' '.join(cmd)}: "
                           + " | ".join(tail))
    (row,) = json.loads(proc.stdout)
    return {"tok_s": float(row["avg_ts"]), "wall_s": round(wall, 2), "build": row.get("build_commit"),
            "n_threads": row.get("n_threads"), "cpu_info": row.get("cpu_info"), "command": cmd}


# ---- tqbench ----------------------------------------------------------------------------------------------
def prompt_kv(engine, n: int, chunk: int):
    """The K/V rows of ``n`` + 1 corpus tokens (``benchmarks/decode.py``'s text), prefilled once into a dense
    cache in calls of ``chunk`` tokens: a context of ``c <= n`` tokens is its first ``c`` rows (causal attention:
    the same rows a ``c``-token prefill gives), and token ``c`` of the text is its first decode input."""
    import torch
    from decode import corpus_ids

    from tqbench.engine.generate import prefill

    ids = corpus_ids(engine, n + 1)
    dense = engine.make_cache("dense")
    with torch.inference_mode():
        prefill(engine.model, ids[:, :n], dense, chunk=chunk)
    return [(la.keys, la.values) for la in dense.layers], ids


def filled_caches(engine, kv, context: int, names: list[str]) -> dict:
    """Every cache ``names`` (dense baselines by name, policies fused) holding the first ``context`` rows of
    ``kv``, appended through its own ``update``."""
    import torch

    caches = {}
    with torch.inference_mode():
        for name in names:
            cache = engine.make_cache(name, "fused")
            for i, (k, v) in enumerate(kv):
                cache.update(k[:, :, :context].clone(), v[:, :, :context].clone(), i)
            caches[name] = cache
    return caches


def time_steps(model, cache, tok, steps: int) -> tuple[float, float, object]:
    """(wall ms/step, process CPU ms/step over all threads, the last token) of ``steps`` greedy steps."""
    import torch

    with torch.inference_mode():
        w0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            tok = model(input_ids=tok, cache=cache).logits[:, -1:].argmax(-1)
        return (time.perf_counter() - w0) / steps * 1e3, (time.process_time() - c0) / steps * 1e3, tok


def kv_bits(engine, name: str, cache) -> float:
    from tqbench.engine.cache.tqcache import TQCache

    if isinstance(cache, TQCache):
        return round(cache.report().bits_per_element, 3)
    return {"float32": 32.0, "float16": 16.0, "bfloat16": 16.0}[engine.baseline_kv_dtype(name)]


def measure_context(engine, a, context: int, prompt, tool: str | None, gguf: str, say) -> list[dict]:
    from tqbench.engine.cache.tqcache import TQCache

    names = [*a.dense, *a.policies]
    kv, ids = prompt
    t = time.perf_counter()
    caches = filled_caches(engine, kv, context, names)
    first = ids[:, context : context + 1]
    say(f"  {context}: filled {len(caches)} caches in {time.perf_counter() - t:.0f} s")
    toks = {}
    for name in names:  # warm-up: the fused switch, codebooks, the kernel's first call
        _, _, toks[name] = time_steps(engine.model, caches[name], first, 2)
    tq: dict[str, list] = {n: [] for n in names}
    ll: dict[str, list] = {k: [] for k in (a.types if tool else [])}
    for r in range(a.rounds):
        for name in names:
            wall, cpu, toks[name] = time_steps(engine.model, caches[name], toks[name], a.steps)
            tq[name].append((wall, cpu))
        for kv in ll:
            ll[kv].append(llama_bench(tool, gguf, context, kv, a.steps, a.threads))
        say(f"  {context}: round {r + 1}/{a.rounds} done, load {os.getloadavg()[0]:.2f}")
    rows = []
    for name in names:
        wall = min(w for w, _ in tq[name])
        cache = caches[name]
        row = {"context": context, "system": "tqbench", "cache": name if name in DENSE else f"{name} fused",
               "kv_dtype": engine.baseline_kv_dtype(name) if name in DENSE else "packed",
               "bits_per_element": kv_bits(engine, name, cache), "decode_tok_s": round(1e3 / wall, 3),
               "ms_per_step": round(wall, 3), "cpu_ms_per_step": round(min(c for _, c in tq[name]), 3),
               "runs_tok_s": [round(1e3 / w, 3) for w, _ in tq[name]]}
        if isinstance(cache, TQCache):
            rep = cache.report()
            row["fused_impl"] = rep.fused_impl
            if set(rep.fused_impl) != {"native-cpu"}:
                row["note"] = f"not all native kernel: {rep.fused_impl}"
        rows.append(row)
    for kv, runs in ll.items():
        best = max(runs, key=lambda x: x["tok_s"])
        rows.append({"context": context, "system": "llama.cpp", "cache": kv, "kv_dtype": kv,
                     "bits_per_element": LLAMA_BITS[kv], "decode_tok_s": round(best["tok_s"], 3),
                     "ms_per_step": round(1e3 / best["tok_s"], 3), "runs_tok_s": [round(x["tok_s"], 3) for x in runs],
                     "llama_build": best["build"], "command": " ".join(best["command"])})
    caches.clear()
    for row in rows:  # each system's cache against its own 16-bit cache
        base = next(x for x in rows if x["system"] == row["system"] and x["cache"] in (a.own16, "f16"))
        row["vs_own_16bit"] = round(row["decode_tok_s"] / base["decode_tok_s"], 4)
    return rows


# ---- report -----------------------------------------------------------------------------------------------
def summary(rows: list[dict], max_trained: int, own16: str = OWN_16BIT) -> dict:
    """Per context: turbo4 fused vs tqbench's 16-bit dense ``own16`` (with issue 31's targets) and every other dense
    baseline timed, and the quantized/16-bit comparison: llama.cpp's best type against tqbench's best cache at most
    as many bits per element."""
    out = {}
    for ctx in sorted({r["context"] for r in rows}):
        at = [r for r in rows if r["context"] == ctx]
        s: dict = {"past_trained_context": bool(max_trained and ctx > max_trained), "own_16bit": own16}
        turbo = next((r for r in at if r["cache"] == "turbo4 fused"), None)
        if turbo is not None:
            s["turbo4_vs_own_16bit"] = turbo["vs_own_16bit"]
            for r in at:
                if r["system"] == "tqbench" and r["cache"] in DENSE:
                    key = {"dense": "dense_fp32"}.get(r["cache"], r["cache"].replace("-", "_"))
                    s[f"turbo4_vs_{key}"] = round(turbo["decode_tok_s"] / r["decode_tok_s"], 4)
            if ctx in TARGETS:
                s["turbo4_target"] = TARGETS[ctx]
                s["turbo4_target_met"] = turbo["vs_own_16bit"] >= TARGETS[ctx]
        llama = [r for r in at if r["system"] == "llama.cpp" and r["cache"] != "f16"]
        if llama:
            best = max(llama, key=lambda r: r["vs_own_16bit"])
            fits = [r for r in at if r["system"] == "tqbench" and r["cache"] not in DENSE
                    and r["bits_per_element"] <= best["bits_per_element"]]
            s["llamacpp_best"] = {"cache": best["cache"], "bits": best["bits_per_element"],
                                  "vs_f16": best["vs_own_16bit"]}
            if fits:
                mine = max(fits, key=lambda r: r["vs_own_16bit"])
                s["tqbench_best_within_bits"] = {"cache": mine["cache"], "bits": mine["bits_per_element"],
                                                 "vs_fp16": mine["vs_own_16bit"]}
                s["tqbench_ahead"] = mine["vs_own_16bit"] > best["vs_own_16bit"]
        out[str(ctx)] = s
    return out


def print_report(rows: list[dict], summ: dict, skipped: str | None, a, model: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console() if sys.stdout.isatty() else Console(width=140)
    t = Table(title=f"decode: {model}, {a.threads} threads, {a.steps} steps, best of {a.rounds} interleaved rounds")
    for col in ("context", "system", "KV cache", "bits/el", "decode tok/s", "ms/step", "vs own 16-bit"):
        t.add_column(col, justify="left" if col in ("system", "KV cache") else "right")
    for r in rows:
        t.add_row(str(r["context"]), r["system"], r["cache"], f"{r['bits_per_element']:.2f}",
                  f"{r['decode_tok_s']:.1f}", f"{r['ms_per_step']:.2f}", f"{r['vs_own_16bit']:.2f}x")
    console.print(t)
    console.print(f"own 16-bit: tqbench {a.own16} ({DENSE_BASELINE_ATTENTION[a.own16]}); llama.cpp f16 (-fa 1). "
                  "dense = float32 K/V; dense-fp16 = float16 K/V upcast to float32 for the model's attention.")
    if a.own16_note:
        console.print(a.own16_note)
    for ctx, s in summ.items():
        parts = []
        if "turbo4_vs_own_16bit" in s:
            target = (f" (target {s['turbo4_target']}x: {'met' if s['turbo4_target_met'] else 'MISSED'})"
                      if "turbo4_target" in s else "")
            parts.append(f"turbo4 fused {s['turbo4_vs_own_16bit']:.2f}x {a.own16}{target}")
            parts += [f"{v:.2f}x {k[len('turbo4_vs_'):]}" for k, v in s.items()
                      if k.startswith("turbo4_vs_") and k != "turbo4_vs_own_16bit"
                      and k != f"turbo4_vs_{a.own16.replace('-', '_')}"]
        if "llamacpp_best" in s:
            b = s["llamacpp_best"]
            parts.append(f"llama.cpp best {b['cache']} {b['vs_f16']:.2f}x f16")
            if "tqbench_best_within_bits" in s:
                m = s["tqbench_best_within_bits"]
                parts.append(f"tqbench best at <= {b['bits']} bits/el: {m['cache']} {m['vs_fp16']:.2f}x fp16 "
                             f"({'ahead' if s['tqbench_ahead'] else 'BEHIND'})")
        if s["past_trained_context"]:
            parts.append("past the model's trained context: speed only")
        console.print(f"{ctx}: " + "; ".join(parts))
    if skipped:
        console.print(f"llama.cpp skipped: {skipped}")


class _Quiet:
    """A console for the JSON written after every context (a killed run keeps the contexts it finished)."""

    def print(self, *_args) -> None:
        pass


def payload(a, argv, engine, gguf: str, skipped: str | None, rows: list[dict], loads: dict, load0) -> dict:
    import torch
    import transformers

    return {
        "benchmark": "engines", "command": [sys.executable, *sys.argv] if argv is None else ["engines.py", *argv],
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": engine.name, "gguf": gguf or None, "dtype": str(engine.loaded.dtype).replace("torch.", ""),
        "threads": a.threads, "steps": a.steps, "rounds": a.rounds, "contexts": a.contexts,
        "contexts_done": sorted({r["context"] for r in rows}), "cpu": cpu_model(), "cpus": os.cpu_count(),
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "loadavg_before": list(load0), "loadavg_after": list(os.getloadavg()), "loadavg_per_context": loads,
        "baselines": {"tqbench": {n: dense_baseline_label(n, str(engine.loaded.dtype).replace("torch.", ""))
                                  for n in a.dense},
                      "own_16bit": a.own16, "own_16bit_note": a.own16_note,
                      "llama.cpp": "f16 cache, flash attention (-fa 1)"},
        "llamacpp_skipped": skipped, "rows": rows, "summary": summary(rows, engine.max_context, a.own16),
    }


def main(argv=None) -> int:
    a = parse_args(argv)
    a.policies = [p.strip() for p in a.policies.split(";") if p.strip()]
    load0 = os.getloadavg()
    import torch

    from tqbench.engine.cache.dense_kernel import check_kernel_baseline
    from tqbench.engine.engine import Engine

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    engine = Engine.load(a.model, threads=a.threads)
    torch.set_num_threads(a.threads)
    a.dense, a.own16, a.own16_note = list(DENSE), OWN_16BIT, None
    try:
        check_kernel_baseline(OWN_16BIT, engine.loaded.device)
    except RuntimeError as exc:  # said in the report: tqbench's own 16-bit cache is then the upcast one
        a.dense.remove(OWN_16BIT)
        a.own16, a.own16_note = "dense-fp16", f"{OWN_16BIT} skipped: {exc}"
        say(a.own16_note)
    tool, gguf, skipped = find_llama_bench(engine, a.no_build)
    if skipped:
        say(f"llama.cpp skipped: {skipped}")
    t = time.perf_counter()
    prompt = prompt_kv(engine, max(a.contexts), a.prefill_chunk)
    say(f"prefilled {max(a.contexts)} tokens once in {time.perf_counter() - t:.0f} s")
    rows, loads = [], {}
    for ctx in a.contexts:
        before = os.getloadavg()
        try:
            rows += measure_context(engine, a, ctx, prompt, tool, gguf, say)
        except RuntimeError as exc:  # llama-bench refused: say so, keep tqbench's rows of the next contexts
            if tool is None or not str(exc).startswith("llama-bench "):
                raise
            say(str(exc))
            skipped, tool = str(exc), None
            rows += measure_context(engine, a, ctx, prompt, None, gguf, say)
        loads[str(ctx)] = {"before": list(before), "after": list(os.getloadavg())}
        write_json(a.json, payload(a, argv, engine, gguf, skipped, rows, loads, load0), console=_Quiet())
    summ = summary(rows, engine.max_context, a.own16)
    print_report(rows, summ, skipped, a, engine.name)
    load1 = os.getloadavg()
    print(f"load average {load0[0]:.2f} -> {load1[0]:.2f} (1 min), {os.cpu_count()} CPUs, {cpu_model()}")
    write_json(a.json, payload(a, argv, engine, gguf, skipped, rows, loads, load0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
