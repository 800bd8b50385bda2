"""Auto-policy in the Policies tab (tiny model): budget + enter allocates in a worker, the bits heatmap, the
frontier of presets and allocations (ctrl+t), escape cancels, a budget that cannot fit is named."""

from __future__ import annotations

import threading

import pytest
from textual.widgets import DataTable, Label

from tests.tui.tui_helpers import notes, plain, wait_for
from tqbench.tui.app import WorkbenchApp, WorkbenchOptions
from tqbench.tui.panes.allocate import SOLVER

pytestmark = pytest.mark.anyio
SIZE = (160, 50)
SMALL_FRONTIER = {"text": "rivers", "prefill": 48, "steps": 6}
SMALL_CALIBRATION = {"calibration": "bread", "calib_prefill": 48, "calib_steps": 8}


async def open_panel(pilot, app):
    await pilot.press("f3")
    panel = app.policies_pane.query_one("#allocate-panel")
    panel.frontier = dict(SMALL_FRONTIER)
    panel.calibration = dict(SMALL_CALIBRATION)
    pane = app.policies_pane
    for field, value in (("context", "96"), ("sink", "2"), ("recent", "4")):
        await pilot.click(f"#{field}")
        await pilot.press("end", "shift+home", *value)  # typing replaces the selected text
    await pilot.click("#budget")
    await pilot.press("end", "shift+home", "backspace")  # (ctrl+u is the Policies tab's "use as candidate")
    await pilot.pause()
    return pane, panel


async def test_budget_enter_allocates_shows_bits_and_the_frontier(data_dir, steady_engine):
    from tqbench.engine import allocate_policy, frontier

    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=SIZE) as pilot:
        pane, panel = await open_panel(pilot, app)
        await pilot.press("4", ".", "5", "enter")
        await wait_for(pilot, lambda: panel.status in ("done", "failed"), what="the allocation")
        assert panel.status == "done", plain(panel.query_one("#alloc-status", Label))
        expected = allocate_policy(steady_engine, 4.5, base="sink=2,recent=4", context=96, name="alloc-4.5bit",
                                   verify_text="rivers", verify_prefill=48, verify_steps=6, **SMALL_CALIBRATION, **SOLVER)
        a = panel.result.allocation
        assert a.policy == expected.allocation.policy and a.bits_per_element <= 4.5
        hm = panel.query_one("#alloc-heatmap", DataTable)
        assert hm.row_count == 4 and [c.label.plain for c in hm.columns.values()] == ["layer", "K bits", "V bits"]
        assert panel.query_one("#alloc-heatmap").values == a.bits_grid()
        assert pane.kept["alloc-4.5bit"] == a.policy.to_string()
        assert app.session.policies["alloc-4.5bit"] == a.policy.to_string()
        assert panel.points["rivers"]["alloc-4.5bit"] == (expected.verified, "layer")
        assert panel.points["heldout:technical"]["alloc-4.5bit"] == (expected.unseen, "layer")
        status = plain(panel.query_one("#alloc-status", Label))
        assert "verified KL" in status and f"{expected.unseen.kl_mean:.4f} on heldout:technical" in status
        await pilot.press("ctrl+t")
        await wait_for(pilot, lambda: not panel.running, what="the frontier")
        assert panel.status == "done" and len(panel.points["rivers"]) == 9, plain(panel.query_one("#alloc-status", Label))
        (turbo4,) = frontier(steady_engine, ["turbo4"], context=96, **SMALL_FRONTIER)
        assert panel.points["rivers"]["turbo4"] == (turbo4, "preset")
        plot = panel.query_one("#frontier-plot")
        assert set(plot.points) == set(panel.points["rivers"]) and plot.points["alloc-4.5bit"][2] == "layer"
        # the plot's text: the allocation's point on the second unseen text (no presets measured there yet)
        panel.query_one("#frontier-text").value = "heldout:technical"
        await pilot.pause()
        assert plot.points == {"alloc-4.5bit": (expected.unseen.bits_per_element, expected.unseen.kl_mean, "layer")}
        assert plot.border_subtitle.startswith("heldout:technical: 48 prefill + 6 steps · 1 points")


async def test_per_head_granularity_allocates_one_width_per_kv_head(data_dir, steady_engine):
    from tqbench.engine import allocate_policy

    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=SIZE) as pilot:
        pane, panel = await open_panel(pilot, app)
        panel.query_one("#granularity").value = "head"
        await pilot.click("#budget")
        await pilot.press("4", ".", "5", "enter")
        await wait_for(pilot, lambda: panel.status in ("done", "failed"), what="the allocation")
        assert panel.status == "done", plain(panel.query_one("#alloc-status", Label))
        expected = allocate_policy(steady_engine, 4.5, base="sink=2,recent=4", context=96, name="alloc-4.5bit-head",
                                   granularity="head", verify_text="rivers", verify_prefill=48, verify_steps=6,
                                   **SMALL_CALIBRATION, **SOLVER)
        a = panel.result.allocation
        assert panel.result.setup["granularity"] == "head" and a.policy == expected.allocation.policy
        assert "|" in a.policy.to_string()  # heads of one layer got different widths (K0 turbo3|turbo4 here)
        assert panel.query_one("#alloc-heatmap").values == a.bits_grid()  # a per-head layer: its mean bits
        assert pane.kept["alloc-4.5bit-head"] == a.policy.to_string()
        assert panel.points["rivers"]["alloc-4.5bit-head"] == (expected.verified, "head")


async def test_tokens_axis_allocates_keep_fractions_and_says_where_the_bytes_went(data_dir, steady_engine):
    from tqbench.engine import allocate_policy

    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=SIZE) as pilot:
        pane, panel = await open_panel(pilot, app)
        panel.query_one("#axes").value = "tokens"
        await pilot.click("#budget")
        await pilot.press("1", "2", "enter")
        await wait_for(pilot, lambda: panel.status in ("done", "failed"), what="the allocation")
        assert panel.status == "done", plain(panel.query_one("#alloc-status", Label))
        expected = allocate_policy(steady_engine, 12.0, base="sink=2,recent=4", context=96, name="alloc-12bit",
                                   axes="tokens", verify_text="rivers", verify_prefill=48, verify_steps=6,
                                   **SMALL_CALIBRATION, **SOLVER)
        a = panel.result.allocation
        assert a.policy == expected.allocation.policy and a.policy.evicts and a.bits_per_element <= 12.0
        status = plain(panel.query_one("#alloc-status", Label))
        assert f"by eviction {expected.axes['saved_by_eviction']}" in status and "keep per layer" in status
        assert panel.points["rivers"]["alloc-12bit"] == (expected.verified, "evict")


async def test_escape_cancels_an_allocation_and_keeps_nothing(data_dir, steady_engine, monkeypatch):
    import tqbench.engine.allocate as allocate_module

    first, gate, real = threading.Event(), threading.Event(), allocate_module.allocate_policy

    def gated(*args, on_event, **kwargs):
        def event(ev):
            on_event(ev)
            first.set()
            gate.wait(600)

        return real(*args, on_event=event, **kwargs)

    monkeypatch.setattr(allocate_module, "allocate_policy", gated)
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=SIZE) as pilot:
        pane, panel = await open_panel(pilot, app)
        await pilot.press("4", "enter")
        await wait_for(pilot, first.is_set, what="the first sensitivity cell")
        await pilot.press("escape")
        gate.set()
        await wait_for(pilot, lambda: not panel.running, what="the cancelled allocation to stop")
        assert panel.status == "cancelled" and panel.result is None and "alloc-4bit" not in pane.kept
        assert plain(panel.query_one("#alloc-status", Label)) == "cancelled: nothing was kept"


async def test_a_budget_that_cannot_fit_is_named(data_dir, steady_engine):
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=SIZE) as pilot:
        _, panel = await open_panel(pilot, app)
        await pilot.press("1", ".", "2", "enter")  # inside the bounds (above turbo1's 1 bit): the solver names it
        await wait_for(pilot, lambda: panel.status in ("done", "failed"), what="the failed allocation")
        text = plain(panel.query_one("#alloc-status", Label))
        assert text.startswith("allocation failed: budget 1.2 bits/element does not fit at 96 tokens")


@pytest.mark.parametrize("budget", ["0", "16", "100"])
async def test_a_budget_out_of_bounds_is_refused_before_any_work(data_dir, steady_engine, budget, monkeypatch):
    """The panel checks the engine's bounds (``check_budget``, as the CLI does): a notice, and no job starts."""
    import tqbench.engine.allocate.job as job

    def refuse(*args, **kwargs):
        raise AssertionError("an allocation started for a budget out of bounds")

    monkeypatch.setattr(job, "allocate_policy", refuse)
    monkeypatch.setattr("tqbench.engine.allocate_policy", refuse, raising=False)
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=SIZE) as pilot:
        _, panel = await open_panel(pilot, app)
        await pilot.press(*budget, "enter")
        await wait_for(pilot, lambda: notes(app), what="the refusal")
        assert any(f"budget {budget} bits/element is out of range: give a number above 1 (the cheapest codec, "
                   "turbo1, needs more) and below 16" in n for n in notes(app)), notes(app)
        assert panel.status != "running"


async def test_the_frontier_marks_allocations_by_speed_class(data_dir, steady_engine):
    """An allocation made with a minimum speed is drawn with its speed class's marker: ``^`` at or above the
    minimum, ``v`` below (its measured ratio under it); presets keep ``o``; the border title names the classes."""
    from dataclasses import replace

    from tqbench.engine import allocate_policy, frontier
    from tqbench.engine.allocate.speed import DecodeCosts
    from tqbench.tui.panes.allocate import speed_suffix

    row = {"turbo1": 0.4e-3, "turbo2": 0.6e-3, "turbo3": 0.8e-3, "turbo4": 1.0e-3}
    costs = DecodeCosts(96, steady_engine.geometry.kv_heads, {"k": dict(row), "v": dict(row)}, 0.0, 10e-3, 11e-3)
    small = dict(base="sink=2,recent=4", context=96, verify_text="rivers", verify_prefill=48, verify_steps=6,
                 unseen_text=None, decode_costs=costs, **SMALL_CALIBRATION)
    fast = allocate_policy(steady_engine, 4.5, name="fast", min_speed="turbo4", **small)
    assert fast.speed.predicted_ratio >= fast.speed.min_ratio and speed_suffix(fast.speed) == "@fast"
    slow = allocate_policy(steady_engine, 5.0, name="slow", min_speed=0.5, **small)
    slow.speed = replace(slow.speed, measured={"ratio": 0.4, "dense_tok_s": 10.0, "policy_tok_s": 4.0, "steps": 4})
    assert speed_suffix(slow.speed) == "@slow" and speed_suffix(None) == ""
    (turbo4,) = frontier(steady_engine, ["turbo4"], context=96, **SMALL_FRONTIER)
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=SIZE) as pilot:
        _, panel = await open_panel(pilot, app)
        panel.points["rivers"]["turbo4"] = (turbo4, "preset")
        panel.show_result(fast)
        panel.show_result(slow)
        await pilot.pause()
        plot = panel.query_one("#frontier-plot")
        assert {k: v[2] for k, v in plot.points.items()} == {"turbo4": "preset", "fast": "layer@fast",
                                                             "slow": "layer@slow"}
        assert plot.border_title.endswith("· ^: at or above the minimum speed · v: below the minimum speed")
        drawn = plot.render().plain
        assert "^" in drawn and "v" in drawn.replace("bits/element", "") and "o" in drawn
        plot.set_points({"turbo4": plot.points["turbo4"]})  # no speed classes: the title says nothing of them
        assert "minimum speed" not in plot.border_title


async def test_min_speed_is_typed_checked_inline_and_passed_to_the_allocation(data_dir, steady_engine, monkeypatch):
    """The min-speed field, as a person uses it: a bad value shows the engine's error beside the field and starts
    nothing (the typed values stay); a ratio reaches ``allocate_policy`` (the CLI's engine call) and binds: the
    allocation differs from the one without it and is predicted at or above it; the frontier marks its speed class.
    The decode costs are a fixed table (no timing): the allocation without a minimum is predicted at 1.32x dense."""
    import tqbench.engine.allocate as allocate_module
    import tqbench.engine.allocate.speed as speed
    from tqbench.engine import allocate_policy
    from tqbench.engine.allocate.speed import DecodeCosts

    row = {"turbo1": 0.4e-3, "turbo2": 0.6e-3, "turbo3": 0.8e-3, "turbo4": 1.0e-3}
    costs = DecodeCosts(96, steady_engine.geometry.kv_heads, {"k": dict(row), "v": dict(row)}, 0.0, 10e-3, 11e-3)
    monkeypatch.setattr(speed, "cached_costs", lambda *args, **kwargs: (costs, False))
    asked, real = [], allocate_module.allocate_policy

    def spy(*args, **kwargs):
        asked.append(kwargs.get("min_speed", "not given"))
        return real(*args, **kwargs)

    monkeypatch.setattr(allocate_module, "allocate_policy", spy)
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=SIZE) as pilot:
        pane, panel = await open_panel(pilot, app)
        await pilot.press("4", ".", "5")
        field, note = panel.query_one("#min-speed"), panel.query_one("#min-speed-note", Label)
        assert field.value == "none" and plain(note) == "no minimum decode speed"
        why = "give a ratio of decode tokens/s to a dense cache above 0 (e.g. 0.8), turbo4 or none"
        for typed, error in (("fast", f"min speed='fast' is invalid: {why}"), ("0", f"min speed=0 is invalid: {why}"),
                             ("-1", f"min speed=-1 is invalid: {why}")):
            await pilot.click("#min-speed")
            await pilot.press("end", "shift+home", *typed)
            assert plain(note) == error and field.has_class("-invalid") and note.has_class("-error")
            await pilot.press("enter")  # enter in the field, in the budget, the button: none starts a job
            await pilot.click("#budget")
            await pilot.press("enter")
            await pilot.click("#allocate")
            await pilot.pause()
            assert plain(note) == error and panel.status == "idle" and asked == []  # nothing started, nothing lost
            assert (field.value, panel.query_one("#budget").value) == (typed, "4.5")
        await pilot.click("#min-speed")
        await pilot.press("end", "shift+home", "1", ".", "4")
        assert plain(note) == "at least 1.4x dense decode tokens/s at the context (predicted)"
        assert not field.has_class("-invalid")
        panel.query_one("#axes").value = "tokens"  # the cost model has no term for evicted rows: refused there
        await pilot.pause()
        assert plain(note) == ("min speed='1.4' is invalid: the decode-cost model has no term for evicted rows: give "
                               "none with the tokens axis")
        panel.query_one("#axes").value = "bits"
        await pilot.pause()
        assert not field.has_class("-invalid")
        await pilot.click("#min-speed")
        await pilot.press("enter")
        await wait_for(pilot, lambda: panel.status in ("done", "failed"), what="the allocation")
        assert panel.status == "done", plain(panel.query_one("#alloc-status", Label))
        assert asked == [1.4]
        same = dict(base="sink=2,recent=4", context=96, name="alloc-4.5bit", verify_text="rivers", verify_prefill=48,
                    verify_steps=6, decode_costs=costs, **SMALL_CALIBRATION, **SOLVER)
        expected = allocate_policy(steady_engine, 4.5, min_speed=1.4, **same)
        free = allocate_policy(steady_engine, 4.5, min_speed=None, **same)
        rep = panel.result
        assert rep.allocation.policy == expected.allocation.policy != free.allocation.policy
        assert rep.speed.min_ratio == 1.4 and rep.speed.predicted_ratio == expected.speed.predicted_ratio >= 1.4
        assert free.speed.predicted_ratio < 1.4  # the minimum bound the choice
        assert panel.points["rivers"]["alloc-4.5bit"] == (expected.verified, "layer@fast")
        assert panel.query_one("#frontier-plot").points["alloc-4.5bit"][2] == "layer@fast"
