"""Where one fused decode step's time goes on a real model: the cache's append (quantize + pack the step's new K/V
rows, and the layer's bookkeeping), the fused attention's Python glue, the native kernel, and the rest of the
model's forward, per step and per layer.

    python benchmarks/step_cost.py --policy turbo4 --contexts 1024,4096 --steps 16

Timed as this thread's CPU time at 1 thread (the kernel runs inline in the calling thread; other processes'
load inflates CPU time least), by wrapping ``TQLayer.update`` (the append), ``native_glue._attend`` (glue +
kernel) and ``native_glue.native_attention_batch`` (the kernel call); each step is one token through every layer
after a prefill of ``context`` tokens of a shipped text. The baseline (``--baseline``, default
``dense-fp16-kernel``: 16-bit rows read by the same native kernel) is timed the same way in the same process, its
steps interleaved with the policy's (its append: the layer's ``update``; its glue: ``native_dense_attention``
less the kernel), so the ratio of step times compares the two under the same load. Medians over the steps; load
and CPU recorded.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from _common import cpu_model, write_json


def text_ids(tokenizer, text: str, n: int):
    """The first ``n`` tokens of a shipped text, the text repeated when it is shorter (a long context)."""
    from tqbench.engine.validate.quality import corpus_path

    whole = tokenizer((corpus_path(text)).read_text(encoding="utf-8"), return_tensors="pt")["input_ids"]
    return whole.repeat(1, -(-n // whole.shape[1]))[:, :n]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--policy", default="turbo4")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--text", default="rivers")
    ap.add_argument("--baseline", default="dense-fp16-kernel", help="a dense baseline timed the same way ('' for none)")
    ap.add_argument("--json", default="benchmarks/results/step-cost.json")
    a = ap.parse_args(argv)
    contexts = [int(x) for x in a.contexts.split(",") if x.strip()]
    import torch

    from tqbench.engine.cache.dense_kernel import DenseKernelLayer
    from tqbench.engine.cache.fused import native_glue
    from tqbench.engine.cache.layer import TQLayer
    from tqbench.engine.engine import Engine

    torch.set_num_threads(1)
    clock = time.thread_time
    spent = {"append": 0.0, "attend": 0.0, "kernel": 0.0}

    def timed(fn, key):
        def wrapper(*args, **kwargs):
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += clock() - t
        return wrapper

    TQLayer.update = timed(TQLayer.update, "append")
    DenseKernelLayer.update = timed(DenseKernelLayer.update, "append")
    native_glue._attend = timed(native_glue._attend, "attend")
    native_glue.native_dense_attention = timed(native_glue.native_dense_attention, "attend")
    native_glue.native_attention_batch = timed(native_glue.native_attention_batch, "kernel")
    engine = Engine.load(a.model, threads=1)
    layers = engine.model.config.num_hidden_layers
    names = [a.policy] + ([a.baseline] if a.baseline else [])
    load0 = os.getloadavg()
    rows = []
    for n in contexts:
        ids = text_ids(engine.tokenizer, a.text, n + a.steps)
        caches = {name: engine.make_cache(name, "fused") for name in names}
        per_step = {name: [] for name in names}
        with torch.inference_mode():
            for cache in caches.values():
                engine.model(input_ids=ids[:, :n], cache=cache, use_cache=True)
            for t in range(n, n + a.steps):
                for name, cache in caches.items():  # (interleaved: both see the same load)
                    for k in spent:
                        spent[k] = 0.0
                    t0 = clock()
                    engine.model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True)
                    total = clock() - t0
                    per_step[name].append({"total": total, "append": spent["append"],
                                           "glue": spent["attend"] - spent["kernel"], "kernel": spent["kernel"],
                                           "rest": total - spent["append"] - spent["attend"]})
        for name in names:
            rep = caches[name].report() if name == a.policy else None
            med = {k: statistics.median(s[k] for s in per_step[name]) for k in per_step[name][0]}
            rows.append({"cache": name, "context": n, "steps": a.steps,
                         "fused_impl": None if rep is None else rep.fused_impl,
                         "notes": None if rep is None else [x for x in rep.notes if "not in place" in x],
                         **{f"{k}_ms_per_step": round(v * 1e3, 3) for k, v in med.items()},
                         **{f"{k}_us_per_layer": round(v * 1e6 / layers, 1) for k, v in med.items() if k != "total"}})
        if a.baseline:
            pol, base = rows[-2], rows[-1]
            pol["step_time_vs_baseline"] = round(pol["total_ms_per_step"] / base["total_ms_per_step"], 3)
    load1 = os.getloadavg()
    print(f"{engine.name}, {a.policy} fused vs {a.baseline or 'no baseline'}, {layers} layers, 1 thread, thread CPU "
          f"time, median of {a.steps} steps; {cpu_model()}; load {load0[0]:.2f} -> {load1[0]:.2f}")
    cols = ["context", "total", "append", "glue", "kernel", "rest"]
    print(f"{'cache':>18} {'context':>8} " + " ".join(f"{c + ' ms':>11}" for c in cols[1:])
          + "   per layer (us): append glue kernel   step time vs baseline")
    for r in rows:
        print(f"{r['cache']:>18} {r['context']:>8} " + " ".join(f"{r[c + '_ms_per_step']:>11.3f}" for c in cols[1:])
              + f"   {r['append_us_per_layer']:.0f} {r['glue_us_per_layer']:.0f} {r['kernel_us_per_layer']:.0f}"
              + (f"   {r['step_time_vs_baseline']:.3f}" if "step_time_vs_baseline" in r else ""))
        for note in r["notes"] or ():
            print(f"  note: {note}")
    write_json(a.json, {"command": [sys.executable, *sys.argv], "model": engine.name, "policy": a.policy,
                        "baseline": a.baseline or None,
                        "layers": layers, "threads": 1, "clock": "thread CPU time", "cpu": cpu_model(),
                        "loadavg_before": list(load0), "loadavg_after": list(load1), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
