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
        assert {r["policy"] for r in pane.result.rows} == {
            f"{p} @ {t} [tiny]" for p in ("turbo4", "turbo2", "q8k-q8v") for t in ("capital", "sky")}
        # the verdicts shown are the cells' own
        by_id = {c["cell_id"]: c for c in report.cells}
        for r in pane.result.rows:
            assert r["verdict"] == by_id[r["row_key"]]["results"]["validate"]["verdict"]
        cols = list(table.columns.values())
        x = 1 + sum(c.get_render_width(table) for c in cols[:4]) + 2  # inside the "token match" header
        await pilot.click("#cmp-table", offset=(x, 1))
        await pilot.pause()
        assert pane.sort_key == "token_match_ratio"
        shown = [r["token_match_ratio"] for r in pane.sorted_rows()]
        assert shown == sorted(shown, reverse=True)
        assert [str(k.value) for k in table.rows] == [r["row_key"] for r in pane.sorted_rows()]
        table.focus()
        table.move_cursor(row=5)
        await pilot.press("enter")
        await pilot.pause()
        last = pane.sorted_rows()[5]
        cell = by_id[last["row_key"]]["cell"]
        assert app.query_one(TabbedContent).active == "run"
        assert app.run_pane.query_one("#candidate", Input).value == cell["policy_string"]
        assert app.run_pane.query_one("#prompt", TextArea).text == cell["text"]["prompt"]
        assert app.run_pane.query_one("#max-tokens", Input).value == "6"
