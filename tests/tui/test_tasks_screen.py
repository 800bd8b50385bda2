"""The long-context task suite from the workbench (tiny model): the palette opens it on Run's candidate, a bad
input is a toast, the run fills the table (per task and overall) with the engine's own scores."""

from __future__ import annotations

import pytest
from textual.widgets import DataTable, Input, Label, Select
from tui_helpers import notes, plain, wait_for

from tqbench.tui.app import WorkbenchApp, WorkbenchOptions

pytestmark = pytest.mark.anyio


async def test_the_palette_runs_the_suite_and_fills_the_table(data_dir, steady_engine, tmp_path, monkeypatch):
    from test_sweep_open import _palette

    from tqbench.tui.screens.tasks import TasksScreen

    monkeypatch.setenv("TQBENCH_CACHE_DIR", str(tmp_path))  # the baseline's answers are cached here
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(140, 40)) as pilot:
        app.run_pane.query_one("#candidate", Input).value = "turbo2"
        await _palette(app, pilot, "Task suite")
        await wait_for(pilot, lambda: isinstance(app.screen, TasksScreen), what="the tasks screen")
        screen = app.screen
        assert screen.query_one("#tasks-candidate", Input).value == "turbo2"
        screen.query_one("#tasks-names", Input).value = "niah_single,nope"
        screen.action_run_tasks()
        await pilot.pause()
        assert any("unknown task nope" in n for n in notes(app)) and not screen.running
        screen.query_one("#tasks-names", Input).value = "niah_single"
        screen.query_one("#tasks-samples", Input).value = "1"
        screen.query_one("#tasks-context", Select).value = 1024
        await pilot.click("#tasks-run")
        await wait_for(pilot, lambda: screen.result is not None and not screen.running, what="the suite to finish")
        table = screen.query_one("#tasks-table", DataTable)
        assert [str(k.value) for k in table.rows] == ["niah_single", "overall"]
        row = screen.result.task_row("niah_single")
        assert table.get_row("niah_single")[3] == f"{row['baseline_score']:.1f}"
        assert screen.result.candidate == "turbo2" and screen.result.context == 1024
        assert "tqbench-ruler-1024: turbo2 vs fp16" in plain(screen.query_one("#tasks-status", Label))
        await pilot.press("escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, TasksScreen), what="the screen to close")
