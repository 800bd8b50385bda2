"""What per-head keep cells cost against per-layer ones (``allocate --keep-granularity head``).

Records the calibration prefill of ``allocate`` (the ``mix`` set, 4 x (1024 + 32) tokens by default), then measures
every layer keep cell (``KeepCells.cell``) and every per-(layer, KV head) one (``KeepCells.head_cell``) at the
given keeps, timing each phase in wall and CPU seconds; prints a table and writes the JSON (with the cells' KL).

    python benchmarks/head_keep_cells.py --threads 1 --json benchmarks/results/allocate/head-keep-cells.json
"""

from __future__ import annotations

import argparse
import os
import time

import _common


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--keeps", default="0.75,0.5,0.25")
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--recent", type=int, default=16)
    ap.add_argument("--json", default="benchmarks/results/allocate/head-keep-cells.json")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from tqbench.engine.allocate.chunk import ChunkRunner
    from tqbench.engine.allocate.keeps import KeepCells
    from tqbench.engine.allocate.texts import calibration_set
    from tqbench.engine.engine import Engine

    keeps = [float(k) for k in args.keeps.split(",")]
    eng = Engine.load(args.model)
    calib = calibration_set(eng.tokenizer, "mix", args.prefill, args.steps)
    out = {"model": eng.name, "cpu": _common.cpu_model(), "threads": args.threads, "load_start": os.getloadavg(),
           "calibration": calib.label, "prefill": args.prefill, "steps": args.steps, "keeps": keeps}
    w, c = time.perf_counter(), time.process_time()
    runner = ChunkRunner(eng, calib.ids, args.prefill)
    cells = KeepCells(runner, "snapkv", 32)
    out["setup"] = {"wall_s": time.perf_counter() - w, "cpu_s": time.process_time() - c}
    layers, heads = len(runner.keys), runner.keys[0].shape[1]
    out.update(layers=layers, kv_heads=heads)
    w, c = time.perf_counter(), time.process_time()
    layer_kl = {f"{L}/{f:g}": cells.cell(L, f, args.sink, args.recent) for L in range(layers) for f in keeps}
    out["layer_cells"] = {"n": len(layer_kl), "wall_s": time.perf_counter() - w, "cpu_s": time.process_time() - c}
    w, c = time.perf_counter(), time.process_time()
    head_kl = {f"{L}.{h}/{f:g}": cells.head_cell(L, h, f, args.sink, args.recent)
               for L in range(layers) for h in range(heads) for f in keeps}
    out["head_cells"] = {"n": len(head_kl), "wall_s": time.perf_counter() - w, "cpu_s": time.process_time() - c}
    out["load_end"] = os.getloadavg()
    out["cells"] = {"layer": layer_kl, "head": head_kl}
    print(f"{'phase':<12} {'cells':>6} {'wall s':>8} {'CPU s':>8} {'CPU s/cell':>11}")
    print(f"{'setup':<12} {'':>6} {out['setup']['wall_s']:>8.1f} {out['setup']['cpu_s']:>8.1f}")
    for key in ("layer_cells", "head_cells"):
        r = out[key]
        print(f"{key:<12} {r['n']:>6} {r['wall_s']:>8.1f} {r['cpu_s']:>8.1f} {r['cpu_s'] / r['n']:>11.3f}")
    print(f"load average {out['load_start'][0]:.1f} -> {out['load_end'][0]:.1f}, {args.threads} thread(s)")
    _common.write_json(args.json, out)


if __name__ == "__main__":
    main()
