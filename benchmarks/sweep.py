"""The shipped example sweep run twice, in-process and on a local Ray cluster: the same numbers, and the wall
time of each way.

    flock /tmp/tqbench-bench.lock python benchmarks/sweep.py                 # examples/sweep.toml, default model
    python benchmarks/sweep.py --spec my.toml --json /tmp/s.json             # any spec

Every cell's numbers (verdicts, token match, KL, teacher-forced KL/perplexity/top-1, NIAH, bytes, per-step
arrays) must be equal between the two runs; timings (``speed``, seconds) are measured, not compared. Writes
benchmarks/results/sweep-example.json with the command, threads, load average and both wall times.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from _common import cpu_model, write_json
from rich.console import Console
from rich.table import Table

from tqbench.engine.sweep import SweepDir, SweepPlanned, load_spec, numbers, run_sweep

ROOT = Path(__file__).resolve().parents[1]


def _arrays_equal(a: SweepDir, b: SweepDir, cell_id: str) -> bool:
    x, y = a.read_arrays(cell_id), b.read_arrays(cell_id)
    keys = sorted(k for k in x if not k.startswith("speed."))
    import numpy as np

    return keys == sorted(k for k in y if not k.startswith("speed.")) and all(
        np.array_equal(x[k], y[k], equal_nan=True) for k in keys)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default=str(ROOT / "examples" / "sweep.toml"))
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "sweep-example.json"))
    ap.add_argument("--keep", default=None, help="keep both sweep folders under this folder (default: a temp dir)")
    args = ap.parse_args()
    con = Console()
    spec = load_spec(args.spec)
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="tqbench-sweep-"))
    load_before = os.getloadavg()
    runs = {}
    for name, ray in (("in-process", False), ("ray", True)):
        planned = []
        t0 = time.perf_counter()
        report = run_sweep(spec, base / name, ray=ray, ray_address="local" if ray else None,
                           on_event=lambda e, p=planned: p.append(e) if isinstance(e, SweepPlanned) else None)
        runs[name] = {"report": report, "seconds": round(time.perf_counter() - t0, 1),
                      "runner": planned[0].runner if planned else name, "loadavg_after": os.getloadavg()}
        con.print(f"{name}: {len(report.cells)} cells in {runs[name]['seconds']} s ({runs[name]['runner']})")
    a, b = runs["in-process"]["report"], runs["ray"]["report"]
    da, db = SweepDir(base / "in-process"), SweepDir(base / "ray")
    ids = [c["cell_id"] for c in a.cells]
    same = [i for i, (x, y) in enumerate(zip(a.cells, b.cells))
            if x["cell_id"] == y["cell_id"] and numbers(x) == numbers(y) and _arrays_equal(da, db, x["cell_id"])]
    differ = [ids[i] for i in range(len(ids)) if i not in same]
    t = Table(title=f"sweep {spec.name}: in-process vs Ray (local cluster)")
    for col in ("runner", "cells", "failed", "wall s", "cells with equal numbers"):
        t.add_column(col, justify="left" if col == "runner" else "right")
    for r in runs.values():
        t.add_row(r["runner"], str(len(r["report"].cells)), str(len(r["report"].failed)), f"{r['seconds']:.1f}",
                  f"{len(same)}/{len(ids)}")
    con.print(t)
    for m_a, m_b in zip(a.models, b.models):
        con.print(f"{m_a['model']}: recommendation in-process {m_a['recommendation'].get('recommended_policy')}, "
                  f"on Ray {m_b['recommendation'].get('recommended_policy')}")
    import torch

    write_json(args.json, {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]), "spec": spec.to_dict(),
        "threads_per_cell_runner": spec.threads or torch.get_num_threads(), "cpus": os.cpu_count(),
        "cpu": cpu_model(), "torch": torch.__version__, "loadavg_before": load_before,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "runs": {n: {"runner": r["runner"], "seconds": r["seconds"], "loadavg_after": r["loadavg_after"],
                     "models": r["report"].models} for n, r in runs.items()},
        "cells": len(ids), "cells_with_equal_numbers": len(same), "cells_that_differ": differ,
        "folders": str(base),
    }, con)
    if differ:
        con.print(f"[red]numbers differ in {len(differ)} cells: {differ}[/]")
        sys.exit(1)


if __name__ == "__main__":
    main()
