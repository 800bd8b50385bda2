"""The advertised keys work from every widget a person can focus: every tab, focus in an Input, a TextArea, a Select and
a list; help is generated from the bindings; Tab order reaches what it should."""

import pytest
from textual.widgets import DataTable, Input, OptionList, Select, TabbedContent, TextArea
from tui_helpers import notes, wait_for

from tqbench.tui.app import TABS, WorkbenchApp, WorkbenchOptions
from tqbench.tui.panes.allocate import AllocatePanel
from tqbench.tui.panes.compare import CompareTable
from tqbench.tui.panes.policies import PoliciesPane
from tqbench.tui.screens.help import HelpScreen, binding_rows

pytestmark = pytest.mark.anyio
TAB_KEYS = {"run": "f2", "policies": "f3", "scan": "f4", "compare": "f5"}
KINDS = (Input, TextArea, Select, OptionList, DataTable)


def widgets_of_each_kind(app, tab: str) -> list:
    """The first focusable widget of each kind in ``tab`` (a text field, a text box, a choice, a list or table)."""
    pane = app.query_one(f"#{tab}")
    found = []
    for kind in KINDS:
        widget = next((w for w in pane.query(kind) if w.focusable
                       and not any(isinstance(a, Select) for a in w.ancestors)), None)  # not a Select's own list
        if widget is not None:
            found.append(widget)
    return found


async def focus_in(app, pilot, tab: str, widget) -> None:
    await pilot.press(TAB_KEYS[tab])
    await pilot.pause()
    app.screen.set_focus(widget)
    await pilot.pause()
    assert app.focused is widget


def field_values(app) -> dict:
    return {f"{w.id}": w.value for w in app.query(Input)} | {f"{w.id}": w.text for w in app.query(TextArea)}


@pytest.mark.parametrize("tab", TABS)
async def test_app_keys_act_from_every_kind_of_widget_on_every_tab(data_dir, steady_engine, tab, monkeypatch):
    """ctrl+r, ctrl+s, ctrl+o, ctrl+e reach the app (not the field's own ctrl+e / ...) and leave the field's text alone;
    f1 opens and closes help, f2-f5 switch tabs, from an Input, a text box, a Select and a list or table."""
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    called = []
    for action in ("run", "save_session", "open_session", "rerun"):
        monkeypatch.setattr(app, f"action_{action}", lambda action=action: called.append(action))
    async with app.run_test(size=(160, 48)) as pilot:
        kinds = widgets_of_each_kind(app, tab)
        assert len(kinds) >= 3, kinds
        for widget in kinds:
            await focus_in(app, pilot, tab, widget)
            before = field_values(app)
            for key, action in (("ctrl+r", "run"), ("ctrl+s", "save_session"), ("ctrl+o", "open_session"),
                                ("ctrl+e", "rerun")):
                called.clear()
                await pilot.press(key)
                await pilot.pause()
                assert called == [action], f"{key} with focus on {widget!r} in {tab}: {called}"
            await pilot.press("f1")  # help opens over any field, and f1 closes it again
            await pilot.pause()
            assert isinstance(app.screen, HelpScreen), f"f1 with focus on {widget!r} in {tab}"
            await pilot.press("f1")
            await pilot.pause()
            assert not isinstance(app.screen, HelpScreen)
            assert field_values(app) == before, f"a field changed under the app keys ({widget!r})"
            for target, key in TAB_KEYS.items():  # every tab key, from this widget
                await focus_in(app, pilot, tab, widget)
                await pilot.press(key)
                await pilot.pause()
                assert app.query_one(TabbedContent).active == target, f"{key} with focus on {widget!r} in {tab}"


@pytest.mark.parametrize("tab", TABS)
async def test_escape_cancels_from_every_kind_of_widget_on_every_tab(data_dir, steady_engine, tab):
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(160, 48)) as pilot:
        for widget in widgets_of_each_kind(app, tab):
            await focus_in(app, pilot, tab, widget)
            app.clear_notifications()
            await pilot.press("escape")
            await pilot.pause()
            assert "nothing is running" in notes(app), f"escape with focus on {widget!r} in {tab}"


async def test_policies_keys_use_and_keep_from_every_field_of_the_builder(data_dir, steady_engine):
    """ctrl+u used to erase the focused "protect layers" value; ctrl+k erased the name being typed."""
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(160, 48)) as pilot:
        pane = app.policies_pane
        pane.query_one("#protect", Input).value = "first1"
        await pilot.pause()
        built = pane.current
        assert "protect=first1" in built
        focusable = [w for w in pane.query("*") if w.focusable and isinstance(w, KINDS)
                     and not any(isinstance(a, Select) for a in w.ancestors)]
        assert {type(w) for w in focusable} >= {Input, Select, OptionList}
        for widget in focusable:
            await focus_in(app, pilot, "policies", widget)
            await pilot.press("ctrl+u")
            await wait_for(pilot, lambda: app.query_one(TabbedContent).active == "run", what="Run after ctrl+u")
            assert app.run_pane.query_one("#candidate", Input).value == built, widget
            assert pane.query_one("#protect", Input).value == "first1", f"ctrl+u edited a field ({widget!r})"
            app.run_pane.query_one("#candidate", Input).value = "turbo4"
        protect = pane.query_one("#protect", Input)
        await focus_in(app, pilot, "policies", protect)
        pane.query_one("#policy-name", Input).value = "mine"
        await pilot.press("ctrl+k")
        await wait_for(pilot, lambda: "mine" in pane.kept, what="the policy kept")
        assert pane.kept["mine"] == built and protect.value == "first1"


async def test_ctrl_t_measures_the_frontier_from_a_field_of_the_allocation_panel(data_dir, steady_engine, monkeypatch):
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(160, 48)) as pilot:
        panel = app.query_one(AllocatePanel)
        asked = []
        monkeypatch.setattr(panel, "action_frontier", lambda: asked.append(True))
        budget = panel.query_one("#budget", Input)
        await focus_in(app, pilot, "policies", budget)
        await pilot.press("ctrl+t")
        await pilot.pause()
        assert asked == [True] and budget.value == "3.0"


async def test_app_keys_wait_while_a_dialog_is_open(data_dir, steady_engine, monkeypatch):
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    called = []
    monkeypatch.setattr(app, "action_save_session", lambda: called.append("save"))
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.press("f1")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert called == [] and isinstance(app.screen, HelpScreen)


async def test_help_is_generated_from_every_binding_of_every_pane(data_dir, steady_engine):
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.press("f1")
        await pilot.pause()
        rows = binding_rows(app)
        listed = {(where, key) for where, key, _, _ in rows}
        for where, owner in (("everywhere", WorkbenchApp), ("Policies", PoliciesPane),
                             ("Policies · allocation", AllocatePanel), ("Compare · results table", CompareTable)):
            for b in owner.BINDINGS:
                assert (where, app.get_key_display(b)) in listed, (where, b.key)
        assert ("everywhere", app.get_key_display(app.screen_stack[0].BINDINGS[0])) != ("everywhere", "")
        help_text = "\n".join(" ".join(r) for r in rows)
        for text in ("Measure frontier", "Open in Run", "Sort", "Command palette", "Next / previous field"):
            assert text in help_text


async def test_compare_table_sorts_and_opens_rows_from_the_keyboard(data_dir, steady_engine):
    app = WorkbenchApp(WorkbenchOptions(model="tiny", screen="compare"), engine=steady_engine)
    async with app.run_test(size=(160, 48)) as pilot:
        pane = app.compare_pane
        pane.query_one("#cmp-policies", Input).value = "turbo4;turbo2"
        pane.query_one("#cmp-tokens", Input).value = "3"
        pane.query_one("#cmp-prompts", TextArea).text = "Why is the sky blue?"
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: pane.status == "done", what="the comparison")
        table = pane.query_one("#cmp-table", CompareTable)
        app.screen.set_focus(table)
        await pilot.press("s")
        assert pane.sort_key == "policy" and [r.policy for r in pane.sorted_rows()] == ["turbo2", "turbo4"]
        await pilot.press("r")
        assert pane.sort_key == "policy" and [r.policy for r in pane.sorted_rows()] == ["turbo4", "turbo2"]
        await pilot.press("s")
        assert pane.sort_key == "verdict" and "sorted by verdict" in str(table.border_subtitle)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.query_one(TabbedContent).active == "run", what="the row opened in Run")
        assert app.run_pane.query_one("#candidate", Input).value == pane.sorted_rows()[0].policy_string


async def test_first_tab_from_the_preset_list_reaches_a_field(data_dir, steady_engine):
    app = WorkbenchApp(WorkbenchOptions(model="tiny", screen="policies"), engine=steady_engine)
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.pause()
        assert app.focused.id == "policy-list"
        await pilot.press("tab")
        await pilot.pause()
        assert app.focused.id == "k-codec"
        containers = [w for w in app.screen.focus_chain if type(w).__name__ in ("VerticalScroll", "Vertical",
                                                                                 "Horizontal")]
        assert containers == []


async def test_run_suggested_policy_is_reached_by_tab_and_runs_it(data_dir, steady_engine):
    app = WorkbenchApp(WorkbenchOptions(model="tiny", screen="scan"), engine=steady_engine)
    async with app.run_test(size=(100, 30)) as pilot:
        pane = app.scan_pane
        # before a scan the button is reachable and says what to do
        app.screen.set_focus(pane.query_one("#heatmap"))
        await pilot.press("tab")
        assert app.focused.id == "use-suggested"
        await pilot.press("enter")
        await pilot.pause()
        assert any("run a scan first" in n for n in notes(app))
        pane.query_one("#scan-codecs", Input).value = "int8,turbo2"
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: pane.status == "done", what="the scan")
        # an old run's texts are on screen; they must not stay under the new candidate
        app.run_pane.query_one("#max-tokens", Input).value = "3"
        app.screen.set_focus(pane.query_one("#heatmap"))
        await pilot.press("tab")
        assert app.focused.id == "use-suggested"
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.query_one(TabbedContent).active == "run", what="Run")
        await wait_for(pilot, lambda: app.run_pane.status == "done", what="the suggested policy's run")
        assert app.run_pane.record.candidate.policy == pane.result.suggest_policy()


async def test_a_candidate_chosen_elsewhere_clears_the_texts_of_the_last_run(data_dir, steady_engine):
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(160, 48)) as pilot:
        run = app.run_pane
        run.query_one("#max-tokens", Input).value = "3"
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: run.status == "done", what="the run")
        base, cand = run.token_views()
        assert base.tokens and cand.tokens
        await pilot.press("f3")
        app.policies_pane.query_one("#k-codec", Select).value = "int8"
        await pilot.pause()
        await pilot.press("ctrl+u")
        await wait_for(pilot, lambda: app.query_one(TabbedContent).active == "run", what="Run")
        assert not base.tokens and not cand.tokens and run.steps == 0
        assert "not run yet" in str(cand.border_title) and run.status == "ready"


@pytest.mark.parametrize(("tab", "selector"), [("scan", "#suggested"), ("scan", "#scan-status"),
                                               ("compare", "#cmp-status"), ("compare", "#recommendation"),
                                               ("run", "#strip"), ("run", "#mode-note")])
@pytest.mark.parametrize("width", [100, 180])
async def test_long_texts_wrap_instead_of_being_cut(data_dir, steady_engine, tab, selector, width):
    app = WorkbenchApp(WorkbenchOptions(model="tiny", screen=tab), engine=steady_engine)
    async with app.run_test(size=(width, 48)) as pilot:
        widget = app.query_one(selector)
        words = " ".join(f"word{i:03d}" for i in range(60))  # 479 characters
        widget.update(words)
        await pilot.pause()
        region = widget.content_region
        assert region.right <= width, f"{selector} runs past the screen's edge: {region}"
        lines = widget.render_lines(widget.region.reset_offset)  # every row the widget draws
        drawn = " ".join("".join(seg.text for seg in strip) for strip in lines)
        assert all(w in drawn for w in words.split()), f"{selector} at {width} columns cut its text: {drawn!r}"


async def test_policies_tab_keys_and_builder_words(data_dir, steady_engine, monkeypatch):
    """Issue 42: ctrl+t measures the frontier from the builder too; a context beyond the model's is said; the
    export panel forgets the previous policy when the built one turns invalid."""
    from textual.widgets import Static

    from tqbench.tui.panes.policies import PoliciesPane

    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(160, 48)) as pilot:
        pane = app.query_one(PoliciesPane)
        panel = app.query_one(AllocatePanel)
        asked = []
        monkeypatch.setattr(panel, "action_frontier", lambda: asked.append(True))
        context = pane.query_one("#context", Input)
        await focus_in(app, pilot, "policies", context)
        await pilot.press("ctrl+t")
        await pilot.pause()
        assert asked == [True]
        assert pane.query_one("#policy-name", Input).placeholder == "a name to keep it as"
        context.value = "1025624"
        await wait_for(pilot, lambda: "beyond the model's context of" in str(pane.query_one("#estimate").render()),
                       what="the context warning")
        export = pane.query_one("#export", Static)
        await wait_for(pilot, lambda: str(export.render()).strip() != "", what="the export mapping")
        pane.query_one("#overrides", Input).value = "v@zz=nothing"
        await wait_for(pilot, lambda: "invalid policy" in str(pane.query_one("#estimate").render()),
                       what="the invalid policy")
        assert str(export.render()).strip() == ""
