"""Whole policies with calibrated (pcaq) keys vs uniform turbo, teacher-forced KL on texts the fit never saw.

``python benchmarks/transforms_kl.py`` prefills ``--prefill`` tokens of each text, feeds the next ``--steps``
tokens one at a time through a dense baseline and through each policy (cache mode ``--mode``), and prints
mean KL(baseline || policy), top-1 agreement and the policy's exact bits/element (transform bytes included),
with threads and load average. JSON: ``benchmarks/results/transforms-kl.json``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

from _common import cpu_model, write_json

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOKENS = "sink=4,recent=16"
POLICIES = (
    f"k=turbo2.5,v=turbo2.5,{TOKENS}",
    f"k=pcaq2.5,v=turbo2.5,{TOKENS}",
    f"k=pcaq2,v=turbo3,{TOKENS}",
    f"k=turbo3,v=turbo3,{TOKENS}",
    f"k=pcaq3,v=turbo3,{TOKENS}",
    f"k=pcaq2.5,v=turbo3.5,{TOKENS}",
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--texts", default="heldout:code,corpus:rivers")
    p.add_argument("--policies", default=";".join(POLICIES), help="';'-separated policies")
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--mode", default="simulate")
    p.add_argument("--calib", default="", help="transforms file (default: the shipped fit)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/transforms-kl.json"))
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = parse_args(argv)
    import torch

    from tqbench.engine import Engine
    from tqbench.engine.calibrate import text_path
    from tqbench.engine.validate.quality import baseline_logprobs, teacher_forced

    torch.set_num_threads(a.threads)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    engine = Engine.load(threads=a.threads)
    policies = [p.strip() + (f",calib={a.calib}" if a.calib and "pcaq" in p else "") for p in a.policies.split(";")]
    rows = []
    for text in a.texts.split(","):
        ids = engine.tokenizer(text_path(text).read_text(encoding="utf-8"), return_tensors="pt")["input_ids"]
        n = a.prefill + a.steps + 1
        if ids.shape[1] < n:
            raise SystemExit(f"{text} has {ids.shape[1]} tokens, fewer than {n}")
        ids = ids[:, :n]
        base = baseline_logprobs(engine, ids, a.prefill)
        for pol in policies:
            r = teacher_forced(engine, ids, a.prefill, pol, a.mode, baseline=base)
            rows.append({"text": text, "policy": pol, "kl_mean": r.kl_mean, "kl_max": r.kl_max,
                         "top1": r.top1_agreement, "bits_per_element": r.bits_per_element,
                         "bytes": r.compressed_storage_bytes, "load": os.getloadavg()[0]})
            print(f"{text:16} {pol:48} KL {r.kl_mean:.5f} top1 {r.top1_agreement:.3f} "
                  f"bits/el {r.bits_per_element:.3f}  load {os.getloadavg()[0]:.1f}", flush=True)
    payload = {"benchmark": "transforms-kl", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "cpu": cpu_model(), "threads": a.threads, "load_before": load0, "load_after": os.getloadavg(),
               "prefill": a.prefill, "steps": a.steps, "mode": a.mode, "calib": a.calib or "shipped",
               "seconds": round(time.perf_counter() - t0, 1), "command": sys.argv, "rows": rows}
    write_json(a.out, payload)


if __name__ == "__main__":
    main()
