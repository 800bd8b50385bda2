"""Scan and Compare tabs on the tiny model; headless validate/scan/compare sessions open in the workbench."""

import pytest
from textual.widgets import DataTable, Input, Label, Select, TabbedContent
from tui_helpers import notes, plain, wait_for

from tqbench.sessions import Session
from tqbench.tui.app import WorkbenchApp, WorkbenchOptions

pytestmark = pytest.mark.anyio


async def test_scan_shows_heatmaps_cells_and_a_suggested_policy(data_dir, steady_engine):
    from tqbench.engine.scan import scan

    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("f4")
        pane = app.scan_pane
        pane.query_one("#scan-codecs", Input).value = "int8,turbo4,turbo2"
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: pane.status == "done", what="the scan")
        expected = scan(steady_engine, pane.query_one("#scan-prompt", Input).value, codecs=["int8", "turbo4", "turbo2"])
        assert pane.result.metrics == expected.metrics
        assert pane.result.suggest_policy() == expected.suggest_policy()
        heat = pane.query_one("#heatmap", DataTable)
        assert heat.row_count == 4 and len(heat.columns) == 1 + steady_engine.config.num_key_value_heads
        assert heat.border_title == "K error (rel. MSE) · int8 · layers x KV heads"
        pane.query_one("#codec", Select).value = "turbo2"
        await pilot.pause()
        assert heat.border_title == "K error (rel. MSE) · turbo2 · layers x KV heads"
        heat.focus()
        heat.move_cursor(row=2, column=2)
        await pilot.pause()
        detail = plain(pane.query_one("#cell-detail"))
        k_mse = expected.metrics["k_rel_mse"]["turbo2"][2][1]
        assert detail.startswith("layer 2, KV head 1")
        assert f"turbo2    {k_mse:7.4f}" in detail
        assert app.session.scans == [pane.result]
        pane.action_use_suggested()
        await pilot.pause()
        assert app.query_one(TabbedContent).active == "run"
        assert app.run_pane.query_one("#candidate", Input).value == expected.suggest_policy()


async def test_escape_cancels_a_scan_and_keeps_nothing(data_dir, steady_engine, monkeypatch):
    import threading

    import tqbench.engine.scan as scan_module
    from tqbench.engine.events import ScanLayerDone

    # the scan's worker holds after its first layer until escape has been pressed: no race with the clock
    first_layer, gate, real_scan = threading.Event(), threading.Event(), scan_module.scan

    def gated_scan(*args, on_event, **kwargs):
        def event(ev):
            on_event(ev)
            if isinstance(ev, ScanLayerDone):
                first_layer.set()
                gate.wait()
        return real_scan(*args, on_event=event, **kwargs)

    monkeypatch.setattr(scan_module, "scan", gated_scan)
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("f4")
        pane = app.scan_pane
        pane.query_one("#scan-codecs", Input).value = "int8,turbo4"
        await pilot.press("ctrl+r")
        try:
            await wait_for(pilot, first_layer.is_set, what="the first layer")
            assert pane.running
            await pilot.press("escape")
        finally:
            gate.set()
        await wait_for(pilot, lambda: not pane.running, what="the cancelled scan to stop")
        assert pane.status == "cancelled" and pane.result is None and app.session.scans == []
        assert plain(pane.query_one("#scan-status", Label)) == "cancelled: nothing was kept"
        pane.query_one("#scan-codecs", Input).value = "int8"
        pane.query_one("#scan-prompt", Input).value = "hello"
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: pane.status == "done", what="a scan after the cancel")
        assert pane.result.codecs == ["int8"]


async def test_compare_sorts_recommends_and_opens_a_row_in_run(data_dir, steady_engine):
    from tqbench.engine.validate import compare_policies

    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("f5")
        pane = app.compare_pane
        pane.query_one("#cmp-policies", Input).value = "turbo4;q8k-q8v;turbo2"
        pane.query_one("#cmp-tokens", Input).value = "6"
        pane.query_one("#cmp-prompts").text = "Why is the sky blue?"
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: pane.status == "done", what="the comparison")
        expected = compare_policies(steady_engine, ["turbo4", "q8k-q8v", "turbo2"], pane.prompts(), max_new_tokens=6)
        assert [r.verdict for r in pane.result.rows] == [r.verdict for r in expected.rows]
        assert pane.result.recommendation["recommended_policy"] == expected.recommendation["recommended_policy"]
        rec = plain(pane.query_one("#recommendation"))
        assert rec.startswith(f"recommendation: {expected.recommendation['recommended_policy']} (")
        table = pane.query_one("#cmp-table", DataTable)
        assert [str(k.value) for k in table.rows] == ["turbo4", "q8k-q8v", "turbo2"]
        cols = list(table.columns.values())
        x = 1 + sum(c.get_render_width(table) for c in cols[:2]) + 2  # inside the "saved %" header
        await pilot.click("#cmp-table", offset=(x, 1))  # highest saving first
        await pilot.pause()
        assert pane.sort_key == "memory_saved_pct"
        saved = [r.memory_saved_pct for r in pane.sorted_rows()]
        assert saved == sorted(saved, reverse=True)
        assert [str(k.value) for k in table.rows] == [r.policy for r in pane.sorted_rows()]
        labels = [c.label.plain for c in table.columns.values()]
        assert labels[2].endswith(" ↓") and sum(lab.endswith(("↑", "↓")) for lab in labels) == 1  # the sorted one
        table.focus()
        table.move_cursor(row=0)
        await pilot.press("enter")
        await pilot.pause()
        top = pane.sorted_rows()[0]
        assert app.query_one(TabbedContent).active == "run"
        assert app.run_pane.query_one("#candidate", Input).value == top.policy_string
        assert app.run_pane.query_one("#max-tokens", Input).value == "6"
        assert app.session.compares == [pane.result]


@pytest.mark.parametrize("command,extra,code", [
    # turbo4 (validate's default candidate) diverges from fp16 within 6 tokens on the tiny model: the gate fails
    ("validate", ["--max-new-tokens", "6", "--collect-logits", "--prompt", "hello"], 1),
    ("scan", ["--prompt", "hello", "--codecs", "int8,turbo3"], 0),
    ("compare-policies", ["--policies", "turbo4;turbo2", "--prompt", "hello", "--max-new-tokens", "4"], 0),
])
async def test_headless_sessions_open_in_the_workbench(command, extra, code, data_dir, steady_engine, tmp_path):
    from click.testing import CliRunner

    from tqbench.cli import main

    path = tmp_path / f"{command}.json"
    r = CliRunner().invoke(main, ["--headless", command, "--model", "tiny", "--threads", "1", *extra,
                                  "--save-session", str(path)])
    assert r.exit_code == code, r.output  # 1: a quality gate failed, the session is still written
    assert ("gate failed: verdict" in r.stderr) == (code == 1), r.stderr
    assert f"session saved to {path}" in r.stderr
    saved = Session.load(path)
    app = WorkbenchApp(WorkbenchOptions(session=str(path)), engine=steady_engine)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        active = app.query_one(TabbedContent).active
        if command == "validate":
            assert saved.validations and saved.runs[0].kind == "validate"
            assert active == "run"
            views = app.run_pane.token_views()
            assert views[0].token_ids == saved.validations[0]["token_ids"]["baseline"]
            assert views[1].token_ids == saved.validations[0]["token_ids"]["candidate"]
            assert views[1].divergent_steps == [i for i, s in enumerate(saved.runs[0].same_token) if not s]
        elif command == "scan":
            assert active == "scan" and app.scan_pane.result == saved.scans[0]
            assert app.scan_pane.query_one("#heatmap", DataTable).row_count == 4
        else:
            assert active == "compare" and app.compare_pane.result == saved.compares[0]
            assert app.compare_pane.query_one("#cmp-table", DataTable).row_count == 2
        assert any(m.startswith(f"opened {path.name}") for m in notes(app))
