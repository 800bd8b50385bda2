"""The workbench shows "fitted on another model" when a run uses a saved policy fitted elsewhere."""

import re

import pytest
from textual.widgets import Input
from tui_helpers import notes, wait_for

from tqbench.engine.policy import shipped_policy_path
from tqbench.tui.app import WorkbenchApp, WorkbenchOptions

pytestmark = pytest.mark.anyio
SHIPPED = "smollm2-alloc-2.5bit"


async def _run(app, pilot, candidate: str) -> None:
    pane = app.run_pane
    pane.query_one("#candidate", Input).value = candidate
    pane.query_one("#max-tokens", Input).value = "3"
    await pilot.press("ctrl+r")
    await wait_for(pilot, lambda: pane.status in ("done", "failed", "cancelled"), what="the run to finish")


async def test_the_run_pane_warns_for_a_policy_fitted_on_another_model(data_dir, steady_engine):
    warning = steady_engine.policy_warning(SHIPPED)
    assert warning.startswith("this policy was fitted on SmolLM2-135M-Instruct (fingerprint fd81e99705258ac1)")
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(120, 40)) as pilot:
        await _run(app, pilot, str(shipped_policy_path(SHIPPED)))
        toasts = notes(app)
        assert warning in toasts  # the warning toast, before the run
        # the allocation names layers the tiny model lacks: the run's refusal says where it was fitted
        refusal = [m for m in toasts if m.startswith("layer index 12 is out of range")]
        assert refusal and refusal[0].endswith(warning)
        assert app.run_pane.status == "failed"


async def test_no_warning_for_a_preset(data_dir, steady_engine):
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(120, 40)) as pilot:
        await _run(app, pilot, "turbo4")
        assert app.run_pane.status == "done"
        assert not [m for m in notes(app) if "fitted on" in m]


async def test_the_policies_list_marks_allocations_fitted_on_another_model(data_dir, steady_engine):
    from textual.widgets import OptionList, Static

    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(160, 40)) as pilot:
        await pilot.press("f3")
        await pilot.pause()
        pane = app.policies_pane
        ol = pane.query_one("#policy-list", OptionList)

        def line(name: str) -> str:
            return str(ol.get_option(f"p:{name}").prompt)

        assert not line("turbo4").endswith("*[/dim]")  # a preset was fitted on nothing
        # estimates for a named model's geometry (no weights: the geometry rule alone), either way round
        bits = re.compile(r"\d\.\d\d b")
        pane.query_one("#geometry-model", Input).value = "default"
        pane.reload_list()
        await pilot.pause()
        assert ol.border_subtitle == "* fitted on another model"
        assert not line("smollm2-head-2.5bit").endswith("*[/dim]") and bits.search(line("smollm2-head-2.5bit"))
        # Gemma's 18-layer allocation has an estimate on SmolLM2's 30 layers, and is marked
        assert line("gemma3-270m-head-2.5bit").endswith("*[/dim]") and bits.search(line("gemma3-270m-head-2.5bit"))
        ol.highlighted = next(i for i in range(ol.option_count) if ol.get_option_at_index(i).id == "p:gemma3-270m-head-2.5bit")
        await pilot.pause()
        shown = str(pane.query_one("#estimate", Static).render())
        assert "this policy was fitted on gemma-3-270m" in shown and "18 layers x 1 KV heads x head_dim 256" in shown
        pane.query_one("#geometry-model", Input).value = "gemma3-270m"
        pane.reload_list()
        await pilot.pause()
        assert not line("gemma3-270m-head-2.5bit").endswith("*[/dim]") and bits.search(line("gemma3-270m-head-2.5bit"))
        assert "not for this model" in line("smollm2-head-2.5bit")  # 30 layers named, 18 here


async def test_the_builder_keeps_the_keys_it_has_no_field_for(data_dir, steady_engine):
    """Loading a policy into the builder and running it loses nothing: srecent, budget, kblock ... are carried."""
    from tqbench.engine.policy import parse_policy

    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(160, 40)) as pilot:
        await pilot.press("f3")
        await pilot.pause()
        pane = app.policies_pane
        text = "turbo4,rotation=hadamard,k@global=int4,kblock=64,srecent=48,keep=0.5,score=kvzip,budget=global"
        pane.kept["mine"] = text
        pane.load_into_builder("mine")
        await pilot.pause()
        assert parse_policy(pane.current) == parse_policy(text)
        pane.query_one("#recent", Input).value = "32"  # a field the builder has: changed, the rest carried
        await pilot.pause()
        assert parse_policy(pane.current) == parse_policy(text + ",recent=32")
