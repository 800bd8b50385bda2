"""The workbench on a family that cannot run fused (Falcon): the refusal is shown, the app stays usable."""

import dataclasses

import pytest
from textual.widgets import Input
from tui_helpers import notes, plain, wait_for

from tqbench.engine.engine import Engine
from tqbench.engine.models.families import family_model
from tqbench.tui.app import WorkbenchApp, WorkbenchOptions

pytestmark = pytest.mark.anyio


async def _run(app, pilot, mode: str) -> None:
    pane = app.run_pane
    pane.query_one("#mode").value = mode
    pane.query_one("#candidate", Input).value = "turbo4"
    pane.query_one("#max-tokens", Input).value = "4"
    await pilot.press("ctrl+r")
    await wait_for(pilot, lambda: pane.status in ("done", "failed", "cancelled"), what=f"the {mode} run to end")


async def test_falcon_fused_is_refused_in_the_workbench_and_compressed_still_runs(data_dir):
    loaded = family_model("falcon")
    engine = Engine(dataclasses.replace(loaded, load_seconds=1.0, threads=1))
    app = WorkbenchApp(WorkbenchOptions(model="tiny-falcon"), engine=engine)
    async with app.run_test(size=(120, 40)) as pilot:
        await _run(app, pilot, "fused")
        assert app.run_pane.status == "failed"
        shown = [m for m in notes(app) if "cannot run the fused cache mode" in m]
        assert shown and shown[0].startswith("FalconForCausalLM cannot run the fused cache mode: its attention "
                                             "does not go through transformers' AttentionInterface")
        assert "use --cache-mode compressed / simulate / dense-shadow" in shown[0]
        await _run(app, pilot, "compressed")
        assert app.run_pane.status == "done" and app.is_running
        assert "cache mode compressed" in plain(app.run_pane.query_one("#strip"))
