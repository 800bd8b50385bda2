"""What the workbench costs: lockstep tokens/s headless vs in the Textual app, and key-press latency while it runs.

``python benchmarks/tui.py [--model default] [--policy turbo4] [--new-tokens 32] [--repeats 2] [--threads N]``
Per repeat, interleaved: ``Engine.lockstep`` in a plain loop, then the same run driven from the app (worker
thread, live token views, strip and plotext graph, 160x48 headless screen). While the app run decodes, a key
callback is queued every 50 ms on the app's message queue (the path a key press takes) and the time until it
runs is recorded. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--policy", default="turbo4")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "tui.json"))
    return p.parse_args(argv)


PROMPT = "Explain in a few sentences why the sky is blue."


def headless(engine, policy: str, n: int) -> float:
    from tqbench.engine.events import PairStep

    t0 = time.perf_counter()
    steps = sum(isinstance(ev, PairStep) for ev in engine.lockstep(PROMPT, "fp16", policy, max_new_tokens=n,
                                                                    track_bytes=True))
    return steps / (time.perf_counter() - t0)


async def in_app(engine, policy: str, n: int) -> tuple[float, list[float]]:
    from textual.widgets import Input

    from tqbench.tui.app import WorkbenchApp, WorkbenchOptions

    app = WorkbenchApp(WorkbenchOptions(model="bench"), engine=engine)
    latencies: list[float] = []
    async with app.run_test(size=(160, 48)) as pilot:
        pane = app.run_pane
        pane.query_one("#candidate", Input).value = policy
        pane.query_one("#max-tokens", Input).value = str(n)
        t0 = time.perf_counter()
        await pilot.press("ctrl+r")
        while pane.status != "done":
            # a callback through the app's message queue (where key presses go) while the worker decodes
            k0 = time.perf_counter()
            handled = asyncio.Event()
            app.call_later(handled.set)
            await handled.wait()
            latencies.append((time.perf_counter() - k0) * 1000)
            await asyncio.sleep(0.05)
        elapsed = time.perf_counter() - t0
    return pane.steps / elapsed, latencies


def main(argv=None) -> None:
    a = parse_args(argv)
    import torch

    from tqbench.engine.engine import Engine

    engine = Engine.load(a.model, threads=a.threads)
    headless(engine, a.policy, 4)  # warm-up: codebooks, rotations
    rows = []
    for r in range(a.repeats):
        h = headless(engine, a.policy, a.new_tokens)
        t, lat = asyncio.run(in_app(engine, a.policy, a.new_tokens))
        rows.append({"repeat": r, "headless_steps_per_s": round(h, 3), "tui_steps_per_s": round(t, 3),
                     "key_latency_ms_median": round(statistics.median(lat), 2) if lat else None,
                     "key_latency_ms_max": round(max(lat), 2) if lat else None, "keys": len(lat)})
    summary = {
        "headless_steps_per_s": statistics.median(r["headless_steps_per_s"] for r in rows),
        "tui_steps_per_s": statistics.median(r["tui_steps_per_s"] for r in rows),
    }
    lat = [r["key_latency_ms_median"] for r in rows if r["keys"]]
    summary["key_latency_ms_median"] = statistics.median(lat) if lat else None  # None: runs too short to probe
    summary["tui_over_headless"] = round(summary["tui_steps_per_s"] / summary["headless_steps_per_s"], 3)
    print(f"workbench cost: {engine.name}, fp16 vs {a.policy}, {a.new_tokens} lockstep steps, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")
    print(f"{'repeat':>6} {'headless steps/s':>17} {'TUI steps/s':>12} {'key ms (median)':>16} {'key ms (max)':>13}")
    for r in rows:
        print(f"{r['repeat']:>6} {r['headless_steps_per_s']:>17.2f} {r['tui_steps_per_s']:>12.2f} "
              f"{str(r['key_latency_ms_median']):>16} {str(r['key_latency_ms_max']):>13}")
    print(f"median: TUI / headless = {summary['tui_over_headless']:.3f}, key latency "
          f"{summary['key_latency_ms_median']} ms")
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "model": engine.name, "policy": a.policy, "new_tokens": a.new_tokens, "threads": torch.get_num_threads(),
           "load_average": os.getloadavg(), "platform": platform.platform(), "rows": rows, "summary": summary}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
