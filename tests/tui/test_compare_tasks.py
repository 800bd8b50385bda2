"""The task suite from the Compare tab, driven with keys (tiny model, 1K context, one task, one sample): f5, the
policies typed in, the tasks row's context, samples and tasks set from the keyboard, ctrl+t; a bad task name is a
toast; the table holds the baseline's row and one per policy, the scores ``run_tasks`` gives."""

from __future__ import annotations

import pytest
from textual.widgets import DataTable, Input, Select
from tui_helpers import notes, plain, wait_for

from tqbench.engine.tasks import run_tasks
from tqbench.tui.app import WorkbenchApp, WorkbenchOptions

pytestmark = pytest.mark.anyio


async def type_into(pilot, app, widget_id: str, text: str) -> None:
    """Tab to the field (from the one focused), clear it and type, as a person does."""
    for _ in range(12):
        if app.focused is not None and app.focused.id == widget_id:
            break
        await pilot.press("tab")
    assert app.focused.id == widget_id
    await pilot.press("end", "shift+home", "backspace", *text)


async def test_ctrl_t_runs_the_suite_on_every_listed_policy(data_dir, steady_engine, tmp_path, monkeypatch):
    monkeypatch.setenv("TQBENCH_CACHE_DIR", str(tmp_path))  # the baseline's answers are cached here
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(140, 44)) as pilot:
        await pilot.press("f5")
        await wait_for(pilot, lambda: app.focused is not None and app.focused.id == "cmp-policies", what="Compare")
        await type_into(pilot, app, "cmp-policies", "turbo4;turbo2")
        await type_into(pilot, app, "cmp-tasks-context", "")
        await pilot.press("enter", "home", "enter")  # the context list: its first entry
        assert app.query_one("#cmp-tasks-context", Select).value == 1024
        await type_into(pilot, app, "cmp-tasks-samples", "1")
        await type_into(pilot, app, "cmp-tasks-names", "niah_single,nope")
        await pilot.press("ctrl+t")
        await pilot.pause()
        assert any("unknown task nope: choose from" in n for n in notes(app)) and not app.compare_pane.running
        await pilot.press("backspace", "backspace", "backspace", "backspace", "backspace")  # ",nope"
        assert app.query_one("#cmp-tasks-names", Input).value == "niah_single"
        tasks = app.query_one("#cmp-tasks")
        await pilot.press("ctrl+t")  # (on a quiet machine the tiny suite may finish before a check could see it run)
        await wait_for(pilot, lambda: len(tasks.results) == 2 and not app.compare_pane.running,
                       what="the suite to finish")
        table = app.query_one("#cmp-tasks-table", DataTable)
        assert [str(k.value) for k in table.rows] == ["baseline", "turbo4", "turbo2"]
        assert [c.label.plain for c in table.columns.values()] == [
            "policy", "compression", "niah_single", "overall", "delta", "agreement"]
        assert [r.candidate for r in tasks.results] == ["turbo4", "turbo2"]
        assert tasks.results[1].baseline_cached == 1  # the second policy reused the first one's baseline answers
        for r in tasks.results:  # the engine's own scores, as `tqbench --headless tasks` gives them
            alone = run_tasks(steady_engine, r.candidate, 1024, tasks=["niah_single"], samples=1, cache=False)
            assert r.samples == alone.samples
            row = table.get_row(r.candidate)
            assert row[2] == f"{alone.task_row('niah_single')['candidate_score']:.1f}"
            assert row[1] == f"{alone.leaderboard()[-1]['compression_ratio']:.3f}"
        assert table.get_row("baseline")[:2] == ["fp16", "0.000"]
        assert "tasks done: 2 policies on tqbench-ruler-1024 vs fp16" in plain(app.query_one("#cmp-status"))
