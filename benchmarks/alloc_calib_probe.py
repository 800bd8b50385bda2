"""Does the allocator's calibration objective rank candidate allocations as unseen text does?

For each protection option (sink, recent, srecent) the allocator's additive solve at the budget (the sensitivity
cells measured once at the base protection, as ``allocate`` does), then each candidate measured jointly on one or
more calibration sets (``JointMeasure``, as the allocator's protection stage measures) and verified teacher-forced
on unseen texts (``frontier_texts``, as ``allocate`` verifies). The joint KL is also split by scored position
(quarters of the chunk), to see whether the steps nearest the prefill end rank the options as the later ones do.

    python benchmarks/alloc_calib_probe.py --model gemma3-270m --threads 1 --budget 2.5 \\
        --calib mix:32 --calib mix:128 --json benchmarks/results/allocate/i39-calib/probe.json
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from _common import cpu_model, write_json

from tqbench.engine.allocate.chunk import ChunkRunner
from tqbench.engine.allocate.exchange import JointMeasure, protection_text
from tqbench.engine.allocate.job import calibrated_k_choices
from tqbench.engine.allocate.sensitivity import measure_sensitivity
from tqbench.engine.allocate.solver import solve_allocation
from tqbench.engine.allocate.texts import calibration_set
from tqbench.engine.allocate.verify import frontier_texts
from tqbench.engine.engine import Engine
from tqbench.engine.metrics import kl_from_logits
from tqbench.engine.policy.files import parse_policy


class PositionRunner(ChunkRunner):
    """A ``ChunkRunner`` that keeps the last call's KL per (sequence, position)."""

    def kl(self, keys, values, start=0):
        with torch.inference_mode():
            logits = self._forward(keys, values, start)
            per = kl_from_logits(self._p, self._base_logits, self._base_lse, logits)
            self.last = per.detach().clone()
            return float(per.mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--budget", type=float, default=2.5)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--cell-steps", type=int, default=32, help="scored steps of the sensitivity cells")
    ap.add_argument("--calib", action="append", default=None,
                    help="NAME:STEPS calibration sets the candidates are measured jointly on (repeatable)")
    ap.add_argument("--protections", default="4:16:-1,4:16:8,4:16:32,4:32:-1,4:8:-1",
                    help="sink:recent:srecent options, comma-separated")
    ap.add_argument("--reprice", action="store_true",
                    help="also re-measure, at each option's protection, the cells of the layers whose fp16 rows it "
                         "changes (sliding layers: srecent; full-attention layers: recent) and solve again")
    ap.add_argument("--extra", action="append", default=[], help="more candidate policies (texts)")
    ap.add_argument("--texts", default="rivers,heldout:technical")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--code-steps", type=int, default=220, help="heldout:code steps (0: skip)")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    engine = Engine.load(args.model, threads=args.threads)
    out = {"model": engine.loaded.name, "threads": torch.get_num_threads(), "budget": args.budget,
           "cpu": cpu_model(), "load_start": os.getloadavg(), "rows": [], "seconds": {}}
    base = parse_policy("k=fp16,v=fp16,sink=4,recent=16,rotation=hadamard")
    specs = ["turbo1", "turbo2", "turbo3", "turbo4", "q8_0", "fp16"]
    extra, _ = calibrated_k_choices(engine, base)
    c0 = time.process_time()
    cal = calibration_set(engine.tokenizer, "mix", args.prefill, args.cell_steps)
    runner = ChunkRunner(engine, cal.ids, args.prefill)
    table = measure_sensitivity(engine, cal.ids, args.prefill, specs, base, granularity="head",
                                k_codecs=specs + list(extra), runner=runner)
    out["seconds"]["sensitivity_cpu"] = round(time.process_time() - c0, 1)
    cands = []
    for opt in args.protections.split(","):
        s, r, sr = (int(x) for x in opt.split(":"))
        pol = parse_policy(base.to_string())
        from dataclasses import replace
        pol = replace(pol, sink=s, recent=r, srecent=sr)
        try:
            alloc = solve_allocation(table, engine.geometry, args.budget, args.context, pol)
        except ValueError as exc:
            print(f"{protection_text(s, r, sr)}: {exc}", flush=True)
            continue
        cands.append({"protection": protection_text(s, r, sr), "policy": alloc.policy.to_string(),
                      "bits": alloc.bits_per_element, "predicted": alloc.predicted_kl, "choice": alloc.choice,
                      "pol": pol})
        if args.reprice and (s, r, sr) != (base.sink, base.recent, base.srecent):
            c1 = time.process_time()
            windows = runner.windows
            same = {k: v for u, row in table.kl.items() for k, v in
                    ((f"{u[0]}.{u[2]}/{u[1]}/{c}", x) for c, x in row.items())
                    if s == base.sink and ((windows[u[0]] is not None and pol.sliding_recent == base.sliding_recent)
                                           or (windows[u[0]] is None and r == base.recent))}
            t2 = measure_sensitivity(engine, cal.ids, args.prefill, specs, pol, granularity="head",
                                     k_codecs=specs + list(extra), runner=runner, known=same)
            alloc = solve_allocation(t2, engine.geometry, args.budget, args.context, pol)
            cands.append({"protection": protection_text(s, r, sr) + " repriced", "policy": alloc.policy.to_string(),
                          "bits": alloc.bits_per_element, "predicted": alloc.predicted_kl, "choice": alloc.choice,
                          "pol": pol, "reprice_cpu": round(time.process_time() - c1, 1),
                          "repriced_cells": sum(len(row) for row in t2.kl.values()) - len(same)})
    for text in args.extra:
        p = parse_policy(text)
        cands.append({"protection": protection_text(p.sink, p.recent, p.srecent), "policy": p.to_string(),
                      "bits": None, "predicted": None, "choice": None, "pol": p})
    if args.reprice:  # the options' first solves are another run's rows
        cands = [c for c in cands if c["protection"].endswith("repriced") or c["choice"] is None]
    for c in cands:
        print(f"{c['protection']}: {c['policy']}", flush=True)
    for spec in args.calib or ["mix:32"]:
        name, steps = spec.rsplit(":", 1)
        c0 = time.process_time()
        cs = calibration_set(engine.tokenizer, name, args.prefill, int(steps))
        pr = PositionRunner(engine, cs.ids, args.prefill)
        meas = JointMeasure(pr)
        for c in cands:
            if c["choice"] is None:
                continue
            m = meas(c["choice"], c["pol"])
            q = pr.last.shape[1] // 4
            c.setdefault("joint", {})[spec] = m
            c.setdefault("joint_quarters", {})[spec] = [float(pr.last[:, i * q:(i + 1) * q].mean()) for i in range(4)]
            c.setdefault("joint_per_seq", {})[spec] = [float(x) for x in pr.last.mean(1)]
            print(f"joint {spec} {c['protection']}: {m:.4f} quarters "
                  + " ".join(f"{x:.3f}" for x in c["joint_quarters"][spec])
                  + " per seq " + " ".join(f"{x:.3f}" for x in c["joint_per_seq"][spec]), flush=True)
        out["seconds"][f"joint {spec} cpu"] = round(time.process_time() - c0, 1)
        del pr, meas
    pols = [c["policy"] for c in cands]
    c0 = time.process_time()
    res = frontier_texts(engine, pols, texts=args.texts.split(","), prefill=args.prefill, steps=args.steps,
                         context=args.context)
    for t, pts in res.items():
        for c, p in zip(cands, pts):
            c.setdefault("unseen", {})[t] = p.kl_mean
            c["bits"] = p.bits_per_element
    if args.code_steps:
        res = frontier_texts(engine, pols, texts=["heldout:code"], prefill=args.prefill, steps=args.code_steps,
                             context=args.context)
        for c, p in zip(cands, res["heldout:code"]):
            c.setdefault("unseen", {})["heldout:code"] = p.kl_mean
    out["seconds"]["verify_cpu"] = round(time.process_time() - c0, 1)
    for c in cands:
        c.pop("pol")
        c["choice"] = None if c["choice"] is None else {"/".join(map(str, u)): s for u, s in c["choice"].items()}
        out["rows"].append(c)
        print(f"{c['protection']:<28} bits {c['bits']:.3f} pred {c['predicted'] if c['predicted'] is None else round(c['predicted'], 4)} "
              + " ".join(f"{k} {v:.4f}" for k, v in c.get("joint", {}).items()) + " | "
              + " ".join(f"{k} {v:.4f}" for k, v in c["unseen"].items()), flush=True)
    out["load_end"] = os.getloadavg()
    write_json(args.json, out, console=None)


if __name__ == "__main__":
    main()
