"""A sweep directory opens in the workbench as a session: the Compare tab shows every cell, sorts by a column
header and opens the selected cell in Run (its own prompt and policy)."""

import textwrap

import pytest
from textual.widgets import DataTable, Input, TabbedContent, TextArea
from tui_helpers import notes, wait_for

from tqbench.tui.app import WorkbenchApp, WorkbenchOptions

pytestmark = pytest.mark.anyio

SPEC = """
name = "tui"
models = ["tiny"]
policies = ["turbo4", "turbo2", "q8k-q8v"]
threads = 1
measure = ["validate", "speed", "bytes"]
[[texts]]
name = "capital"
prompt = "What is the capital of France?"
[[texts]]
name = "sky"
prompt = "Why is the sky blue?"
[validate]
max_new_tokens = 6
"""


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    from tqbench.engine.sweep import load_spec, run_sweep

    tmp = tmp_path_factory.mktemp("tui-sweep")
    (tmp / "spec.toml").write_text(textwrap.dedent(SPEC), encoding="utf-8")
    report = run_sweep(load_spec(tmp / "spec.toml"), tmp / "out")
    return tmp / "out", report


async def test_a_sweep_opens_in_compare_sorts_and_opens_a_cell_in_run(data_dir, steady_engine, sweep_dir):
    out, report = sweep_dir
    app = WorkbenchApp(WorkbenchOptions(session=str(out)), engine=steady_engine)
    async with app.run_test(size=(140, 40)) as pilot:
        await wait_for(pilot, lambda: app.compare_pane.result is not None, what="the sweep to open")
        await pilot.pause()
        assert app.model_spec == "tiny"
        assert app.query_one(TabbedContent).active == "compare"
        assert any(m.startswith("opened sweep out: 6 cells") for m in notes(app))
        pane = app.compare_pane
        table = pane.query_one("#cmp-table", DataTable)
        ids = [c["cell_id"] for c in report.cells]
        assert sorted(str(k.value) for k in table.rows) == sorted(ids) and table.row_count == 6
        assert {r.policy for r in pane.result.rows} == {
            f"{p} @ {t} [tiny]" for p in ("turbo4", "turbo2", "q8k-q8v") for t in ("capital", "sky")}
        # the verdicts shown are the cells' own
        by_id = {c["cell_id"]: c for c in report.cells}
        for r in pane.result.rows:
            assert r.verdict == by_id[r.row_key]["results"]["validate"]["verdict"]
        cols = list(table.columns.values())
        x = 1 + sum(c.get_render_width(table) for c in cols[:4]) + 2  # inside the "token match" header
        await pilot.click("#cmp-table", offset=(x, 1))
        await pilot.pause()
        assert pane.sort_key == "token_match_ratio"
        shown = [r.token_match_ratio for r in pane.sorted_rows()]
        assert shown == sorted(shown, reverse=True)
        assert [str(k.value) for k in table.rows] == [r.row_key for r in pane.sorted_rows()]
        table.focus()
        table.move_cursor(row=5)
        await pilot.press("enter")
        await pilot.pause()
        last = pane.sorted_rows()[5]
        cell = by_id[last.row_key]["cell"]
        assert app.query_one(TabbedContent).active == "run"
        assert app.run_pane.query_one("#candidate", Input).value == cell["policy_string"]
        assert app.run_pane.query_one("#prompt", TextArea).text == cell["text"]["prompt"]
        assert app.run_pane.query_one("#max-tokens", Input).value == "6"


async def _palette(app, pilot, title: str) -> None:
    from textual.command import CommandPalette

    await pilot.press("ctrl+p")
    await wait_for(pilot, lambda: isinstance(app.screen, CommandPalette), what="the command palette")
    await pilot.press(*title)

    def top() -> str:
        commands = app.screen.query_one("CommandList")
        return str(commands.get_option_at_index(0).prompt) if commands.option_count else ""

    await wait_for(pilot, lambda: top().startswith(title), what=f"'{title}' at the top of the palette")
    await pilot.press("enter")
    await wait_for(pilot, lambda: not isinstance(app.screen, CommandPalette), what="the palette to close")


async def _start_from_palette(app, pilot, spec, out) -> None:
    from tqbench.tui.screens.sweep import SweepScreen

    await _palette(app, pilot, "Run sweep")
    await wait_for(pilot, lambda: isinstance(app.screen, SweepScreen), what="the sweep screen")
    await pilot.press(*str(spec))
    await pilot.press("tab")
    await pilot.press(*str(out))
    await pilot.press("enter")
    await wait_for(pilot, lambda: not isinstance(app.screen, SweepScreen), what="the sweep screen to close")


async def test_a_sweep_runs_from_the_palette_and_streams_into_compare(data_dir, steady_engine, tmp_path):
    from tqbench.engine.sweep import SweepDir

    spec = tmp_path / "spec.toml"
    spec.write_text(textwrap.dedent(SPEC), encoding="utf-8")
    out = tmp_path / "out"
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(140, 40)) as pilot:
        await _start_from_palette(app, pilot, spec, out)
        pane = app.compare_pane
        await wait_for(pilot, lambda: pane.status == "done", what="the sweep")
        assert app.query_one(TabbedContent).active == "compare"
        table = pane.query_one("#cmp-table", DataTable)
        cells = SweepDir(out).all_cells()
        assert table.row_count == 6 and sorted(str(k.value) for k in table.rows) == sorted(c["cell_id"] for c in cells)
        assert all(c["status"] == "ok" and c["model_name"] == "tiny-random" for c in cells)
        assert any(m.startswith("sweep done: 6 cells in") for m in notes(app))


async def test_escape_stops_a_running_sweep_and_keeps_the_finished_cells(data_dir, steady_engine, tmp_path,
                                                                         monkeypatch):
    import threading

    from textual.widgets import Label

    from tqbench.engine.sweep import SweepDir
    from tqbench.engine.sweep.measure import CellRunner

    started, release, calls = threading.Event(), threading.Event(), []
    real = CellRunner.run

    def held(self, cell):  # the second cell waits until the test has pressed escape
        calls.append(cell.cell_id)
        if len(calls) == 2:
            started.set()
            release.wait(600)
        return real(self, cell)

    monkeypatch.setattr(CellRunner, "run", held)
    spec = tmp_path / "spec.toml"
    spec.write_text(textwrap.dedent(SPEC), encoding="utf-8")
    out = tmp_path / "out"
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(140, 40)) as pilot:
        await _start_from_palette(app, pilot, spec, out)
        pane = app.compare_pane
        await wait_for(pilot, started.is_set, what="the second cell to start")
        await pilot.press("escape")
        release.set()
        await wait_for(pilot, lambda: pane.status == "cancelled", what="the sweep to stop")
        assert [c["cell_id"] for c in SweepDir(out).all_cells()] == calls[:1]
        assert "the finished cells stay in" in str(pane.query_one("#cmp-status", Label).render())
        assert pane.query_one("#cmp-table", DataTable).row_count == 1
