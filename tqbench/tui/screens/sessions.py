"""Open a saved session from a list (newest first); unreadable files are listed with their error."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option


class OpenSessionScreen(ModalScreen):
    """Dismisses with the chosen session's path, or None."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Close", id="open.close")]
    AUTO_FOCUS = "#session-list"  # the app turns auto-focus off for its main screen only
    DEFAULT_CSS = """
    OpenSessionScreen { align: center middle; }
    OpenSessionScreen > Vertical { width: 100; max-width: 95%; height: auto; max-height: 80%;
        border: thick $primary; background: $surface; padding: 0 1; }
    OpenSessionScreen OptionList { height: auto; max-height: 24; }
    """

    def __init__(self, directory: str | None = None) -> None:
        super().__init__()
        self.directory = directory

    def compose(self) -> ComposeResult:
        from tqbench.sessions import list_sessions, session_dir

        self.entries = list_sessions(self.directory)
        with Vertical():
            yield Label(f"[b]open a session[/b] from {session_dir(self.directory)}  (enter opens, escape closes)")
            options = []
            for i, e in enumerate(self.entries):
                if e.error:
                    options.append(Option(f"[red]✗ {e.path.name}[/]: {e.error}", id=f"s{i}"))
                else:
                    options.append(Option(f"{e.path.name:<44} {e.model} · {e.runs} run(s) · saved {e.saved}",
                                          id=f"s{i}"))
            if not options:
                options.append(Option("no saved sessions yet: ctrl+s saves one", id="none", disabled=True))
            yield OptionList(*options, id="session-list")

    @on(OptionList.OptionSelected)
    def _chosen(self, event: OptionList.OptionSelected) -> None:
        if event.option.id and event.option.id.startswith("s"):
            self.dismiss(self.entries[int(event.option.id[1:])].path)


class SaveAsScreen(ModalScreen):
    """"Save session as": a file name (enter saves, escape closes). Dismisses with the path typed, or None. The
    overwrite rule is the store's (``sessions.store.keep_backup``): an existing session is kept as a backup, any
    other existing file is refused."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Close", id="saveas.close")]
    AUTO_FOCUS = "#save-as-path"
    DEFAULT_CSS = """
    SaveAsScreen { align: center middle; }
    SaveAsScreen > Vertical { width: 100; max-width: 95%; height: auto; border: thick $primary;
        background: $surface; padding: 0 1; }
    """

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def compose(self) -> ComposeResult:
        from textual.widgets import Input

        with Vertical():
            yield Label("[b]save the session as[/b] (enter saves, escape closes; an existing session is kept as "
                        "NAME.bak.json, any other file is not overwritten)")
            yield Input(self.path, id="save-as-path")

    def on_input_submitted(self, event) -> None:
        value = event.value.strip()
        if value:
            self.dismiss(value)
