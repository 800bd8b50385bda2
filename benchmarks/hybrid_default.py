"""Which layers to compress in a hybrid (sliding-window + global) model: teacher-forced KL per candidate on
held-out texts of several kinds, and the exact bytes at the lengths the model is used at (issue 39, item 2).

Each candidate is a policy; the layer-kind selectors ``sliding`` and ``global`` name the model's sliding-window and
full-attention layers, so one list runs on any model. On a model without sliding layers they name no layer, so a
candidate that uses them is the same as turbo4 there: it is skipped with that reason. Per text: the dense baseline
once (one causal forward), then each candidate through the cache (prefill over exact K/V, then single-token
steps); KL(baseline || candidate) averaged over steps. Bytes come from ``estimate_kv`` (every byte counted) at
each ``--lengths``, against the model's own fp16 cache (its sliding layers hold the window only). The JSON is rewritten after every row, so a killed run keeps what it had.

    python benchmarks/hybrid_default.py --model gemma3-270m --threads 1 \\
        --json benchmarks/results/gemma/hybrid-gemma3-270m.json
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch
from _common import cpu_model, write_json
from rich.console import Console

from tqbench.engine.allocate.texts import resolve_texts
from tqbench.engine.cache.estimate import estimate_kv
from tqbench.engine.cache.geometry import KVGeometry
from tqbench.engine.engine import Engine
from tqbench.engine.policy import is_hybrid
from tqbench.engine.validate import baseline_logprobs, teacher_forced

#: name -> policy text ({sliding}/{global}: the model's layer indices of that kind)
CANDIDATES = {  # in the order they were added (issue 39: each round chose the next from the last one's numbers)
    "turbo4 everywhere": "turbo4,sliding=compress",
    "turbo4 globals, windows fp16": "turbo4,sliding=dense",
    "turbo4 globals, windows q8_0": "turbo4,sliding=compress,kv@sliding=q8_0",
    "windows q8_0, globals K q8_0 + V turbo4": "turbo4,sliding=compress,kv@sliding=q8_0,k@global=q8_0",
    "turbo4 windows, globals K q4_0 + V turbo4": "turbo4,sliding=compress,k@global=q4_0",
    "windows q8_0, globals K q4_0 + V turbo4": "turbo4,sliding=compress,kv@sliding=q8_0,k@global=q4_0",
    "turbo4 windows, globals K q8_0 + V turbo4": "turbo4,sliding=compress,k@global=q8_0",
    "windows q5_0, globals K q4_0 + V turbo4": "turbo4,sliding=compress,kv@sliding=q5_0,k@global=q4_0",
    "windows q8_0, globals K turbo4 + V q8_0": "turbo4,sliding=compress,kv@sliding=q8_0,v@global=q8_0",
    "turbo4 windows, globals q8_0": "turbo4,sliding=compress,kv@global=q8_0",
    "turbo4 everywhere (hadamard)": "turbo4,sliding=compress,rotation=hadamard",
    # rounds e-i (hadamard rotations: 524,288 B fewer than QR's at head_dim 256, the room for the levers below)
    "H, windows' last 128 rows fp16": "turbo4,sliding=compress,rotation=hadamard,srecent=128",
    "H, windows' last 64 rows fp16": "turbo4,sliding=compress,rotation=hadamard,srecent=64",
    "H, globals K pcaq4 (Gemma fit)": "turbo4,sliding=compress,rotation=hadamard,k@global=pcaq4,calib={calib}",
    "H, globals K pcaq5 (Gemma fit)": "turbo4,sliding=compress,rotation=hadamard,k@global=pcaq5,calib={calib}",
    "H, globals K q5_0": "turbo4,sliding=compress,rotation=hadamard,k@global=q5_0",
    "H, globals K q5_0 + V turbo3": "turbo4,sliding=compress,rotation=hadamard,k@global=q5_0,v@global=turbo3",
    "H, windows q5_0, globals K q5_0 + V turbo3":
        "turbo4,sliding=compress,rotation=hadamard,k@global=q5_0,v@global=turbo3,kv@sliding=q5_0",
    "H, globals K int4 per-channel": "turbo4,sliding=compress,rotation=hadamard,k@global=int4",
    "H, globals K int8 per-channel": "turbo4,sliding=compress,rotation=hadamard,k@global=int8",
    "windows' last 64 rows fp16, globals K int4 + V turbo3":
        "turbo4,sliding=compress,k@global=int4,v@global=turbo3,srecent=64",
    "H, windows' last 128 rows fp16, globals K int4 + V turbo3":
        "turbo4,sliding=compress,rotation=hadamard,k@global=int4,v@global=turbo3,srecent=128",
    "H, windows' last 48 rows fp16, globals K int4": "turbo4,sliding=compress,rotation=hadamard,k@global=int4,srecent=48",
    "H, windows' last 32 rows fp16, globals K int4": "turbo4,sliding=compress,rotation=hadamard,k@global=int4,srecent=32",
    "H, windows' last 64 rows fp16, globals K int4 (64-row blocks)":
        "turbo4,sliding=compress,rotation=hadamard,k@global=int4,kblock=64,srecent=64",
    "H, windows' last 48 rows fp16, globals K int4 (64-row blocks): the default":
        "turbo4,sliding=compress,rotation=hadamard,k@global=int4,kblock=64,srecent=48",
    "H, windows' last 32 rows fp16, globals K int4 (64-row blocks)":
        "turbo4,sliding=compress,rotation=hadamard,k@global=int4,kblock=64,srecent=32",
}
#: texts neither model was fitted on (the shipped transforms were fitted on tqbench/data/calibration/): prose,
#: a maintenance manual, code. "tail:" takes the LAST n tokens, so the scored steps read the last text's kind.
TEXTS = ("corpus:rivers", "heldout:technical", "tail:heldout:technical+code")


def text_ids(tokenizer, name: str, n: int) -> torch.Tensor:
    tail = name.startswith("tail:")
    paths, _ = resolve_texts(name.removeprefix("tail:"))
    ids = torch.cat([tokenizer(p.read_text(encoding="utf-8"), return_tensors="pt")["input_ids"][0] for p in paths])
    if ids.shape[0] < n:
        raise SystemExit(f"error: {name} has {ids.shape[0]} tokens, fewer than the {n} needed")
    return (ids[-n:] if tail else ids[:n])[None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--candidates", default=None, help="';'-separated candidate names (default: all)")
    ap.add_argument("--texts", default=",".join(TEXTS))
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--mode", default="simulate")
    ap.add_argument("--lengths", default="1024,8192,32768")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calib", default=None, help="a transforms file for the candidates with calib={calib} "
                    "(calibrated keys fitted on this model: tqbench calibrate / allocate --fit-transforms)")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    con = Console()
    t0 = time.time()
    engine = Engine.load(args.model, threads=args.threads)
    geo = KVGeometry.from_config(engine.model.config)
    hybrid = is_hybrid(geo.layer_types)
    lengths = [int(x) for x in args.lengths.split(",")]
    names = args.candidates.split(";") if args.candidates else list(CANDIDATES)
    cands: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for name in names:
        text = CANDIDATES.get(name, name)
        if "{calib}" in text:
            if not args.calib:
                skipped[name] = "calibrated keys: give --calib FILE (transforms fitted on this model)"
                continue
            text = text.replace("{calib}", args.calib)
        if any(w in text for w in ("@sliding", "@global", "sliding=dense")) and not hybrid:
            skipped[name] = "the model has no sliding-window layers: the same as turbo4 everywhere"
            continue
        cands[name] = text
    bytes_rows = []
    for name, pol in cands.items():
        row = {"candidate": name, "policy": pol}
        for n in lengths:
            est = estimate_kv(pol, geo, n)  # against the model's own fp16 cache (its windows hold their rows)
            row[str(n)] = {"total_bytes": est.total_bytes, "dense_fp16_bytes": est.dense_fp16_bytes,
                           "bits_per_element": round(est.bits_per_element, 3), "saved_pct": round(est.saved_pct, 2)}
        bytes_rows.append(row)
    out = {"model": engine.loaded.name, "threads": torch.get_num_threads(), "mode": args.mode,
           "prefill": args.prefill, "steps": args.steps, "hybrid": hybrid, "skipped": skipped,
           "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                       "torch": torch.__version__, "load_start": os.getloadavg()},
           "bytes": bytes_rows, "quality": []}
    for text in args.texts.split(","):
        ids = text_ids(engine.tokenizer, text, args.prefill + args.steps + 1)
        base = baseline_logprobs(engine, ids, args.prefill)
        for name, pol in cands.items():
            t1 = time.time()
            r = teacher_forced(engine, ids, args.prefill, pol, args.mode, baseline=base)
            out["quality"].append({"text": text, "candidate": name, **r.to_dict(),
                                   "wall_s": round(time.time() - t1, 1), "load": os.getloadavg()[0]})
            con.print(f"{text:30s} {name:32s} bits@{args.prefill + args.steps}={r.bits_per_element:.3f} "
                      f"KL={r.kl_mean:.5f} top1={r.top1_agreement:.3f} ppl={r.ppl_candidate:.3f}/"
                      f"{r.ppl_baseline:.3f} ({time.time() - t1:.0f} s, load {os.getloadavg()[0]:.1f})")
            out["wall_s"], out["load_end"] = round(time.time() - t0, 1), os.getloadavg()
            write_json(args.json, out, console=con)
    # mean KL over texts per candidate
    summary = []
    for name in cands:
        rows = [q for q in out["quality"] if q["candidate"] == name]
        summary.append({"candidate": name, "kl_mean": sum(q["kl_mean"] for q in rows) / len(rows),
                        "kl_max_text": max(q["kl_mean"] for q in rows), "texts": len(rows)})
        con.print(f"{name:32s} mean KL {summary[-1]['kl_mean']:.5f} (worst text {summary[-1]['kl_max_text']:.5f}) "
                  + "  ".join(f"{n}: {b[str(n)]['bits_per_element']} bits, saved {b[str(n)]['saved_pct']}%"
                              for b in bytes_rows if b["candidate"] == name for n in lengths))
    out["summary"] = summary
    write_json(args.json, out, console=con)


if __name__ == "__main__":
    main()
