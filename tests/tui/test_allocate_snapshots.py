"""Snapshots of the allocation panel: the per-layer bits heatmap of an allocation and the frontier plot (KL vs
bits for presets and allocations), from results computed on the tiny model (no worker timing involved)."""

from __future__ import annotations

import pytest

from tests.tui.test_allocate_pane import SIZE, SMALL_CALIBRATION, SMALL_FRONTIER
from tests.tui.test_snapshots import compare, settle, steady_screen  # noqa: F401 (an autouse fixture)
from tqbench.tui.app import WorkbenchApp, WorkbenchOptions

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def measured(tiny_engine):
    from tqbench.engine import allocate_policy, frontier

    rep = allocate_policy(tiny_engine, 4.5, base="sink=2,recent=4", context=96, name="alloc-4.5bit",
                          verify_prefill=SMALL_FRONTIER["prefill"], verify_steps=SMALL_FRONTIER["steps"],
                          **SMALL_CALIBRATION)
    rep.measured_cells, rep.resumed_cells = 24, 0
    presets = frontier(tiny_engine, ["turbo2", "turbo3", "turbo4", "q8k-int4v"], context=96, **SMALL_FRONTIER)
    return rep, presets


async def test_allocation_heatmap_and_frontier(measured, steady_engine, data_dir):
    rep, presets = measured
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f3")
        panel = app.policies_pane.query_one("#allocate-panel")
        panel.frontier = dict(SMALL_FRONTIER)
        for p in presets:
            panel.points[p.kv_policy] = (p, "preset")
        panel.show_result(rep)
        await settle(pilot)
        compare(app, "policies_allocation_160x50")
