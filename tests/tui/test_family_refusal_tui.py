"""The workbench on a family that cannot run fused (Falcon before transformers 5.25, ALiBi Falcon from it): the
refusal is shown, the app stays usable."""

import dataclasses

import pytest
from textual.widgets import Input
from tui_helpers import notes, plain, wait_for

from tests.unit.families.refused_falcon import WHY, refused_falcon
from tqbench.engine.engine import Engine
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
    loaded = refused_falcon()
    engine = Engine(dataclasses.replace(loaded, load_seconds=1.0, threads=1))
    app = WorkbenchApp(WorkbenchOptions(model="tiny-falcon"), engine=engine)
    async with app.run_test(size=(120, 40)) as pilot:
        await _run(app, pilot, "fused")
        assert app.run_pane.status == "failed"
        shown = [m for m in notes(app) if "cannot run the fused cache mode" in m]
        assert shown and shown[0].startswith(f"FalconForCausalLM cannot run the fused cache mode: {WHY}")
        assert "use cache mode compressed / simulate / dense-shadow" in shown[0]
        await _run(app, pilot, "compressed")
        assert app.run_pane.status == "done" and app.is_running
        assert "cache mode compressed" in plain(app.run_pane.query_one("#strip"))


async def test_policies_pane_estimates_a_family_from_a_local_config_json(data_dir, steady_engine, tmp_path):
    """Type a config.json path into "geometry of": the estimate uses that family's geometry (sliding layers
    counted at their window), the same bytes kv-estimate gives; a bad path says what is wrong."""
    import json

    from textual.widgets import Select

    from tqbench.engine.cache import model_geometry
    from tqbench.engine.cache.estimate import estimate_kv
    from tqbench.engine.models.families import family_config

    path = tmp_path / "gemma2" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(family_config("gemma2").to_dict()))
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("f3")
        pane = app.policies_pane
        pane.query_one("#geometry-model", Input).value = str(path)
        pane.query_one("#sliding", Select).value = "compress"
        await pilot.pause()
        want = estimate_kv("k=turbo4,v=turbo4,sink=4,recent=16,sliding=compress", model_geometry(str(path)).geometry,
                           1024)
        assert pane.current == "k=turbo4,v=turbo4,sink=4,recent=16,sliding=compress"
        assert pane.estimate.total_bytes == want.total_bytes
        text = plain(pane.query_one("#estimate"))
        assert "geometry: 4 layers, 2 sliding (window 8) × 2 KV heads × head_dim 32" in text
        pane.query_one("#geometry-model", Input).value = str(tmp_path / "nothing.json")
        await pilot.pause()
        shown = plain(pane.query_one("#estimate"))
        assert shown.startswith('no geometry for "geometry of": unknown model') and pane.current == ""
        assert app.is_running
