"""Undo and redo in the prompt boxes (Run's prompt, Compare's prompts): the edit is undone and the app keeps running.

Textual 8.2.8's TextArea replays an undo batch, refreshes its size (which may hide the vertical scrollbar and scroll
to the cursor) and only then moves the cursor back: in a box of fixed height the cursor still points at a row the
undo removed (``ValueError: The document line index 2 is out of bounds``). ``PromptBox`` scrolls after the cursor
moved back (tqbench/tui/widgets/prompt_box.py).
"""

import random

import pytest
from textual.app import App
from textual.widgets import TextArea
from tui_helpers import wait_for

from tqbench.constants import DEFAULT_PROMPT
from tqbench.tui.app import WorkbenchApp, WorkbenchOptions
from tqbench.tui.widgets.prompt_box import PromptBox

pytestmark = pytest.mark.anyio
ADD_LINES = ("end", "enter", "enter")


class Boxes(App):
    """A prompt box of the workbench's height beside a plain TextArea tall enough never to need a scrollbar."""

    CSS = "#short { height: 4; border: round $panel; } #tall { height: 40; }"

    def __init__(self, box_type=PromptBox) -> None:
        super().__init__()
        self.box_type = box_type

    def compose(self):
        yield self.box_type(DEFAULT_PROMPT, id="short", soft_wrap=True, show_line_numbers=False)
        yield TextArea(DEFAULT_PROMPT, id="tall", soft_wrap=True, show_line_numbers=False)


def cursor_shown(box: TextArea) -> bool:
    """The cursor's row lies inside the box's scrolled window."""
    _, y = box.wrapped_document.location_to_offset(box.cursor_location)
    return box.scroll_offset.y <= y < box.scroll_offset.y + box.scrollable_content_region.height


async def test_textual_still_has_the_undo_bug_the_prompt_box_works_around():
    """A plain TextArea of the same height fails on End, Enter, Enter, ctrl+z (when Textual fixes this, the test
    says so: PromptBox's workaround may then go)."""
    app = Boxes(box_type=TextArea)
    with pytest.raises(ValueError, match="out of bounds"):
        async with app.run_test(size=(100, 30)) as pilot:
            app.query_one("#short").focus()
            await pilot.press(*ADD_LINES, "ctrl+z")
            await pilot.pause()


async def test_undo_and_redo_after_adding_lines_restore_the_text():
    app = Boxes()
    async with app.run_test(size=(100, 30)) as pilot:
        box = app.query_one("#short", PromptBox)
        box.focus()
        await pilot.press(*ADD_LINES)
        assert box.text == DEFAULT_PROMPT + "\n\n" and box.cursor_location == (2, 0)
        await pilot.press("ctrl+z")
        assert app.is_running and box.text == DEFAULT_PROMPT + "\n" and box.cursor_location == (1, 0)
        assert cursor_shown(box)
        await pilot.press("ctrl+z")
        assert box.text == DEFAULT_PROMPT and box.cursor_location == (0, len(DEFAULT_PROMPT))
        await pilot.press("ctrl+y", "ctrl+y")  # redo both: the scrollbar comes back
        assert box.text == DEFAULT_PROMPT + "\n\n" and box.cursor_location == (2, 0) and cursor_shown(box)
        await pilot.press("backspace", "backspace", "ctrl+z", "ctrl+y")  # redo a deletion: the box shrinks again
        assert box.text == DEFAULT_PROMPT and app.is_running and cursor_shown(box)


async def test_any_edits_undo_and_redo_as_in_a_box_without_scrollbar():
    """Random key sequences give the short prompt box the same text and cursor as a tall plain TextArea."""
    keys = ("end", "home", "enter", "enter", "backspace", "delete", "up", "down", "left", "x", "y", "space",
            "shift+up", "shift+down", "f7", "ctrl+z", "ctrl+z", "ctrl+y")
    rng = random.Random(33)
    app = Boxes()
    async with app.run_test(size=(100, 30)) as pilot:
        short, tall = app.query_one("#short", PromptBox), app.query_one("#tall", TextArea)
        for _ in range(12):
            seq = [rng.choice(keys) for _ in range(14)]
            for box in (short, tall):
                box.load_text(DEFAULT_PROMPT)
                box.focus()
                await pilot.press(*seq)
            assert (short.text, short.selection) == (tall.text, tall.selection), seq
            assert cursor_shown(short), seq


@pytest.mark.parametrize(("tab", "box_id"), [("run", "#prompt"), ("compare", "#cmp-prompts")])
async def test_ctrl_z_after_adding_lines_keeps_the_workbench_and_its_work(data_dir, steady_engine, tab, box_id):
    app = WorkbenchApp(WorkbenchOptions(model="tiny", screen=tab), engine=steady_engine)
    async with app.run_test(size=(100, 30)) as pilot:
        box = app.query_one(box_id, PromptBox)
        before = box.text
        app.screen.set_focus(box)
        await pilot.pause()
        box.move_cursor(box.document.end)  # Compare's prompts: the last of several lines
        await pilot.press(*ADD_LINES, "ctrl+z")
        await pilot.pause()
        assert app.is_running and app.return_code is None
        assert box.text == before + "\n" and box.cursor_location[0] == before.count("\n") + 1
        await pilot.press("ctrl+z", "x")  # still editable: the undo went through whole
        assert box.text.endswith(before.splitlines()[-1] + "x")
        if tab == "run":  # and a run still starts from it
            app.run_pane.query_one("#max-tokens").value = "2"
            await pilot.press("ctrl+r")
            await wait_for(pilot, lambda: app.run_pane.status == "done", what="the run to finish")
            assert app.run_pane.record.prompt == before + "x"
