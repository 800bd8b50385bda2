"""Snapshots of the allocation panel: the per-layer bits heatmap of an allocation and the frontier plot (KL vs
bits for presets and allocations), computed on the snapshot model (SmolLM2's tokenizer and KV geometry, see
tests/tui/words_model.py: 30 layers, so the heatmap and the shipped SmolLM2 policies' bits are real figures);
no worker timing involved."""

from __future__ import annotations

import pytest

from tests.tui.test_allocate_pane import SIZE
from tests.tui.test_snapshots import compare, settle, steady_screen  # noqa: F401 (an autouse fixture)
from tqbench.tui.app import WorkbenchApp, WorkbenchOptions
from tqbench.tui.panes.allocate import SOLVER

pytestmark = pytest.mark.anyio
#: small on purpose: 30 layers x K/V x 4 codecs are 240 measured cells
FRONTIER = {"text": "rivers", "prefill": 24, "steps": 4}
CALIBRATION = {"calibration": "bread", "calib_prefill": 16, "calib_steps": 2}


@pytest.fixture(scope="module")
def measured(words_engine):
    from tqbench.engine import allocate_policy, frontier

    rep = allocate_policy(words_engine, 3.5, base="sink=2,recent=4", context=96, name="alloc-3.5bit",
                          verify_prefill=FRONTIER["prefill"], verify_steps=FRONTIER["steps"], **CALIBRATION, **SOLVER)
    rep.resumed_cells = 0
    presets = frontier(words_engine, ["turbo2", "turbo3", "turbo4", "q8k-int4v"], context=96, **FRONTIER)
    return rep, presets


async def test_allocation_heatmap_and_frontier(measured, words_engine, data_dir):
    rep, presets = measured
    assert (rep.measured_cells, rep.resumed_cells) == (240, 0)  # 30 layers x {K, V} x 4 codecs, none reused
    app = WorkbenchApp(WorkbenchOptions(model="tiny-words"), engine=words_engine)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f3")
        panel = app.policies_pane.query_one("#allocate-panel")
        panel.frontier = dict(FRONTIER)
        for p in presets:
            panel.points["rivers"][p.kv_policy] = (p, "preset")
        panel.show_result(rep)
        await settle(pilot)
        compare(app, "policies_allocation_160x50")
