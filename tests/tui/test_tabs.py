"""Every tab is reachable from every other tab, by its key and by the command palette, wherever focus is."""

import pytest
from textual.command import CommandPalette
from textual.widgets import Input, TabbedContent, TextArea
from tui_helpers import wait_for

from tqbench.tui.app import TABS, WorkbenchApp, WorkbenchOptions
from tqbench.tui.screens.help import HelpScreen

pytestmark = pytest.mark.anyio

KEYS = {"run": "f2", "policies": "f3", "scan": "f4", "compare": "f5"}
PALETTE = {"run": "Run tab", "policies": "Policies tab", "scan": "Scan tab", "compare": "Compare tab"}


def focus_targets(app, tab: str) -> list:
    """The widget the tab focuses when shown, the pane's first text input and its text box (all must let the keys
    through)."""
    pane = app.query_one(f"#{tab}")
    boxes = list(pane.query(TextArea))[:1]  # a text box has key bindings of its own (f6, f7 select)
    return [app.focused, pane.query(Input).first(), *boxes]


def top_command(app) -> str:
    """The first entry the open command palette lists ("" while it is still searching)."""
    commands = app.screen.query_one("CommandList")
    return str(commands.get_option_at_index(0).prompt) if commands.option_count else ""


async def go_to(app, pilot, tab: str) -> None:
    await pilot.press(KEYS[tab])
    await pilot.pause()
    assert app.query_one(TabbedContent).active == tab


def assert_on(app, tab: str, how: str) -> None:
    active = app.query_one(TabbedContent).active
    assert active == tab, f"{how}: expected the {tab} tab, {active} is shown"
    pane = app.query_one(f"#{tab}")
    assert app.focused is not None and pane in app.focused.ancestors, \
        f"{how}: focus stayed outside the {tab} tab ({app.focused!r})"


@pytest.mark.parametrize("source", TABS)
async def test_every_tab_key_works_from_every_tab_and_every_first_input(data_dir, steady_engine, source):
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(160, 48)) as pilot:
        for target in TABS:
            await go_to(app, pilot, source)
            for widget in focus_targets(app, source):
                await go_to(app, pilot, source)
                app.screen.set_focus(widget)
                await pilot.pause()
                await pilot.press(KEYS[target])
                await pilot.pause()
                assert_on(app, target, f"{KEYS[target]} from {source} with focus on {widget!r}")
                await pilot.pause()  # nothing switches back on a later refresh
                assert_on(app, target, f"{KEYS[target]} from {source}, one refresh later")


@pytest.mark.parametrize("source", TABS)
async def test_every_tab_opens_from_the_command_palette_on_every_tab(data_dir, steady_engine, source):
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(160, 48)) as pilot:
        for target in TABS:
            await go_to(app, pilot, source)
            await pilot.press("ctrl+p")
            await wait_for(pilot, lambda: isinstance(app.screen, CommandPalette), what="the command palette")
            title = PALETTE[target]
            await pilot.press(*title)
            await wait_for(pilot, lambda title=title: top_command(app).startswith(title),
                           what=f"'{title}' at the top of the palette")
            await pilot.press("enter")
            await wait_for(pilot, lambda: not isinstance(app.screen, CommandPalette), what="the palette to close")
            await pilot.pause()
            assert_on(app, target, f"palette '{PALETTE[target]}' from {source}")


async def test_tab_keys_close_help_and_f1_toggles_it(data_dir, steady_engine):
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(160, 48)) as pilot:
        await go_to(app, pilot, "policies")
        await pilot.press("f1")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("f1")
        await pilot.pause()
        assert not isinstance(app.screen, HelpScreen)
        for target in TABS:
            await pilot.press("f1")
            await pilot.pause()
            assert isinstance(app.screen, HelpScreen)
            await pilot.press(KEYS[target])
            await pilot.pause()
            assert not isinstance(app.screen, HelpScreen)
            assert_on(app, target, f"{KEYS[target]} over the help screen")


async def test_the_candidate_defaults_to_the_fastest_quality_mode_and_says_what_it_keeps(data_dir, steady_engine):
    from textual.widgets import Label, Select

    from tqbench.constants import CACHE_MODE_RESIDENT, CACHE_MODES, QUALITY_MODES, fastest_quality_mode

    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.pause()
        mode = app.run_pane.query_one("#mode", Select)
        note = app.run_pane.query_one("#mode-note", Label)
        assert mode.value == fastest_quality_mode("cpu") == "fused" and mode.value in QUALITY_MODES
        assert str(note.render()) == CACHE_MODE_RESIDENT["fused"]
        for m in CACHE_MODES:  # every mode stays selectable, and the note follows it
            mode.value = m
            await pilot.pause()
            assert str(note.render()) == CACHE_MODE_RESIDENT[m]
        app.run_pane.engine_ready("cpu")  # a mode the user chose is kept
        assert mode.value == CACHE_MODES[-1]


async def test_a_policy_from_the_command_line_gets_the_same_mode_as_the_default_candidate(data_dir, steady_engine):
    """``tqbench --kv-policy turbo4,keep=0.5`` (issue 42): the mode nobody chose is the device's, as for turbo4."""
    from textual.widgets import Select

    from tqbench.constants import DEFAULT_PROMPT, fastest_quality_mode
    from tqbench.tui.app import RunParams

    run = RunParams(prompt=DEFAULT_PROMPT, chat=True, max_new_tokens=48, temperature=0.0, top_p=1.0, seed=0,
                    baseline="fp16", candidate="turbo4,keep=0.5", cache_mode=None)
    app = WorkbenchApp(WorkbenchOptions(model="tiny", run=run), engine=steady_engine)
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.pause()
        assert app.run_pane.query_one("#mode", Select).value == fastest_quality_mode("cpu")
        assert app.run_pane.query_one("#candidate").value == "turbo4,keep=0.5"
