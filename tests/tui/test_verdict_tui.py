"""The workbench shows the engine's verdicts: a candidate that saves nothing at the run's length (the same
``Savings`` message validate and the server give), the sample-size caveat of a comparison, and a run cancelled
before the candidate produced a token (no divergence, no match ratio)."""

import pytest
from textual.widgets import Input
from tui_helpers import plain, wait_for

from tqbench.tui.app import WorkbenchApp, WorkbenchOptions

pytestmark = pytest.mark.anyio
#: stores more bytes than fp16 below 211 tokens on the tiny model (a 200-token full-precision window)
LONG_WINDOW = "k=turbo4,v=turbo4,sink=4,recent=200"


async def test_run_strip_says_the_candidate_saves_nothing_and_from_when(data_dir, steady_engine):
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(200, 40)) as pilot:
        pane = app.run_pane
        pane.query_one("#candidate", Input).value = LONG_WINDOW
        pane.query_one("#max-tokens", Input).value = "4"
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: pane.status in ("done", "failed", "cancelled"), what="the run to finish")
        assert pane.status == "done"
        tokens = pane.record.candidate.cache_report["tokens"]
        want = steady_engine.savings(LONG_WINDOW, "fp16", tokens)
        assert not want.saves and want.break_even_tokens == 211
        strip = plain(pane.query_one("#strip"))
        assert want.message in strip and "it starts to save at 211 tokens" in strip


async def test_a_run_cancelled_before_the_candidate_produced_a_token(data_dir, steady_engine, monkeypatch):
    from tqbench.engine.events import TokenGenerated

    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    real = steady_engine.stream

    def stream(*args, **kwargs):
        for ev in real(*args, **kwargs):
            if isinstance(ev, TokenGenerated) and ev.run == "baseline":
                app.run_pane._cancel.set()  # before the candidate's first step checks it (no wall time involved)
            yield ev

    monkeypatch.setattr(steady_engine, "stream", stream)
    async with app.run_test(size=(200, 40)) as pilot:
        pane = app.run_pane
        pane.query_one("#max-tokens", Input).value = "8"
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: pane.status in ("done", "failed", "cancelled"), what="the cancel")
        assert pane.status == "cancelled"
        assert pane.record.candidate.token_ids == [] and len(pane.record.baseline.token_ids) == 1
        strip = plain(pane.query_one("#strip"))
        assert "cancelled before the candidate produced a token" in strip
        assert "first divergence" not in strip and "token match" not in strip and "no divergence" not in strip
        pane.show_record(pane.record)  # the saved run reads the same
        strip = plain(pane.query_one("#strip"))
        assert "cancelled before the candidate produced a token" in strip and "first divergence" not in strip


async def test_compare_pane_shows_saves_nothing_and_the_caveat(data_dir, steady_engine):
    from tqbench.engine.validate import compare_policies

    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(200, 50)) as pilot:
        await pilot.press("f5")
        pane = app.compare_pane
        pane.query_one("#cmp-policies", Input).value = f"{LONG_WINDOW};q8k-q8v"
        pane.query_one("#cmp-tokens", Input).value = "4"
        pane.query_one("#cmp-prompts").text = "Why is the sky blue?"
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: pane.status == "done", what="the comparison")
        expected = compare_policies(steady_engine, [LONG_WINDOW, "q8k-q8v"], pane.prompts(), max_new_tokens=4)
        rec = expected.recommendation
        assert rec["saves_nothing_policies"][0]["policy"] == LONG_WINDOW
        assert rec["recommended_policy"] != LONG_WINDOW and rec["caveat"]
        text = plain(pane.query_one("#recommendation"))
        assert f"saves nothing: {LONG_WINDOW}: {rec['saves_nothing_policies'][0]['note']}" in text
        assert f"caveat: {rec['caveat']}" in text
