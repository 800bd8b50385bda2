"""A soft-wrapped text box whose undo and redo survive a scrollbar that appears or disappears.

Textual 8.2.8's ``TextArea._undo_batch`` (and ``_redo_batch``) restore the document, re-wrap it and call
``_refresh_size()`` *before* ``Edit.after`` moves the cursor back to where it was before the edit. When the
restored document no longer needs the vertical scrollbar (a box of fixed height: End, Enter, Enter adds a line
past the box, ctrl+z takes it away), ``_refresh_size`` hides the scrollbar, and its watcher
(``_watch_show_vertical_scrollbar``) calls ``scroll_cursor_visible()`` with the cursor still on the row the undo
just removed: ``WrappedDocument.get_offsets`` raises ``ValueError: The document line index 2 is out of bounds``
and the app exits. ``edit()`` calls ``Edit.after`` before ``_refresh_size``, so typing never meets it.

``PromptBox`` holds back scrolling to the cursor while an undo or redo batch is replayed, and scrolls once the
batch has put the cursor back (the document and its wrapping are consistent by then). Nothing is caught or
dropped: the edit is undone (or redone) in full, exactly as Textual would have done it.
"""

from __future__ import annotations

from contextlib import contextmanager

from textual.geometry import Offset
from textual.widgets import TextArea


class PromptBox(TextArea):
    """The prompt boxes of Run and Compare: a soft-wrapped ``TextArea`` with a safe undo/redo."""

    def __init__(self, text: str = "", **kwargs) -> None:
        kwargs.setdefault("soft_wrap", True)
        kwargs.setdefault("show_line_numbers", False)
        super().__init__(text, **kwargs)
        self._replaying = False
        self._scroll_wanted: tuple[bool, bool] | None = None

    @contextmanager
    def _replay(self):
        """While undo/redo restores edits, the cursor may point past the document: scroll only at the end."""
        if self._replaying:  # nested (an undo from inside a redo): the outer one scrolls
            yield
            return
        self._replaying, self._scroll_wanted = True, None
        try:
            yield
        finally:
            self._replaying = False
            wanted, self._scroll_wanted = self._scroll_wanted, None
        if wanted is not None:
            self.scroll_cursor_visible(*wanted)

    def undo(self) -> None:
        with self._replay():
            super().undo()

    def redo(self) -> None:
        with self._replay():
            super().redo()

    def scroll_cursor_visible(self, center: bool = False, animate: bool = False) -> Offset:
        if self._replaying:
            self._scroll_wanted = (center, animate)
            return Offset(0, 0)
        return super().scroll_cursor_visible(center, animate)
