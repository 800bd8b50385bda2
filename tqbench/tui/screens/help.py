"""Help: every key binding of the workbench, collected from the bindings themselves."""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static


def binding_rows(app) -> list[tuple[str, str, str, str]]:
    """(where, key, action, description) for the app and every pane, in order."""
    from tqbench.tui.panes.policies import PoliciesPane

    rows = []
    for where, owner in (("everywhere", type(app)), ("Policies", PoliciesPane)):
        for b in owner.BINDINGS:
            if isinstance(b, Binding):
                rows.append((where, app.get_key_display(b), b.description, b.tooltip or ""))
    rows.append(("everywhere", "ctrl+p", "Command palette", "Every action by name"))
    rows.append(("everywhere", "tab / shift+tab", "Next / previous field", "Mouse works too"))
    return rows


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,q,f1", "dismiss", "Close", id="help.close")]
    AUTO_FOCUS = "*"  # the app turns auto-focus off for its main screen only
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 96; max-width: 95%; height: auto; max-height: 90%;
        border: thick $primary; background: $surface; padding: 0 1; }
    """

    def compose(self) -> ComposeResult:
        t = Table(title="tqbench workbench · key bindings", expand=True, box=None, title_style="bold")
        for col in ("where", "key", "action", "what it does"):
            t.add_column(col, style="bold" if col == "key" else None)
        for row in binding_rows(self.app):
            t.add_row(*row)
        with VerticalScroll():
            yield Static(t)
            yield Static(
                "\n[b]Run[/b]: baseline and candidate decode in lockstep; candidate tokens that differ from the "
                "baseline are highlighted, [b #ffd700]▶[/] marks the first divergence. A dense-shadow candidate "
                "reads exact K/V: its output equals fp16 by construction (storage-only).\n"
                "[b]Sessions[/b]: ctrl+s saves everything (JSON + safetensors) to the data dir "
                "($TQBENCH_DATA_DIR or --session-dir); ctrl+o opens one; ctrl+e re-runs the shown run and diffs "
                "it against the saved tokens. Escape cancels long work. Press escape to close."
            )
