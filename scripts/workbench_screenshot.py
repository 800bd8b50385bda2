"""Write docs/workbench.svg: the workbench at 160x48 after a turbo2 run on the default model (one command).

    python scripts/workbench_screenshot.py [--policy turbo2] [--tokens 48] [--out docs/workbench.svg]
"""

from __future__ import annotations

import argparse
import asyncio
import time


async def shoot(policy: str, tokens: int, out: str, threads: int | None) -> None:
    from textual.widgets import Input

    from tqbench.engine.engine import Engine
    from tqbench.tui.app import WorkbenchApp, WorkbenchOptions

    engine = Engine.load("default", threads=threads)
    app = WorkbenchApp(WorkbenchOptions(model="default"), engine=engine)
    async with app.run_test(size=(160, 48)) as pilot:
        pane = app.run_pane
        pane.query_one("#candidate", Input).value = policy
        pane.query_one("#max-tokens", Input).value = str(tokens)
        await pilot.press("ctrl+r")
        t0 = time.monotonic()
        while pane.status != "done":
            if time.monotonic() - t0 > 1200:
                raise SystemExit("the run did not finish in 20 minutes")
            await pilot.pause(0.2)
        await pilot.pause(0.5)
        app.clear_notifications()
        app.save_screenshot(filename=out.split("/")[-1], path="/".join(out.split("/")[:-1]) or ".")
    print(f"wrote {out} ({policy}, {tokens} tokens, {time.monotonic() - t0:.0f}s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="turbo2")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--out", default="docs/workbench.svg")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    asyncio.run(shoot(a.policy, a.tokens, a.out, a.threads))


if __name__ == "__main__":
    main()
