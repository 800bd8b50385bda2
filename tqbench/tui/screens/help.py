"""Help: every key binding of the workbench, collected from the bindings themselves."""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static


def binding_owners(app) -> list[tuple[str, list[Binding]]]:
    """(where, bindings) for the app and every class of the workbench's own widgets that defines keys, found in the
    main screen's widgets (every tab's, shown or not): help lists what the bindings are, so it cannot drift."""
    owners = [("everywhere", [b for b in type(app).BINDINGS if isinstance(b, Binding)])]
    seen = set()
    for node in app.screen_stack[0].walk_children(with_self=False):
        cls = type(node)
        if cls in seen or not cls.__module__.startswith("tqbench.") or "BINDINGS" not in cls.__dict__:
            continue
        seen.add(cls)
        owners.append((getattr(cls, "HELP_SCOPE", cls.__name__),
                       [b for b in cls.__dict__["BINDINGS"] if isinstance(b, Binding)]))
    return owners


def binding_by_id(app, binding_id: str) -> Binding:
    for _, bindings in binding_owners(app):
        for b in bindings:
            if b.id == binding_id:
                return b
    raise KeyError(f"no binding with id {binding_id!r}")


def binding_rows(app) -> list[tuple[str, str, str, str]]:
    """(where, key, action, description): every binding of the app and its panes, then Textual's own keys the
    workbench relies on (the command palette, focus moves), read from where Textual defines them."""
    rows = [(where, app.get_key_display(b), b.description, b.tooltip or "")
            for where, bindings in binding_owners(app) for b in bindings]
    rows.append(("everywhere", app.get_key_display(Binding(app.COMMAND_PALETTE_BINDING, "command_palette")),
                 "Command palette", "Every action by name"))
    focus = {b.action: b for b in app.screen_stack[0].BINDINGS if isinstance(b, Binding)}
    if "app.focus_next" in focus and "app.focus_previous" in focus:
        keys = f"{app.get_key_display(focus['app.focus_next'])} / {app.get_key_display(focus['app.focus_previous'])}"
        rows.append(("everywhere", keys, "Next / previous field", "Mouse works too"))
    return rows


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,q,f1", "dismiss", "Close", id="help.close")]
    AUTO_FOCUS = "*"  # the app turns auto-focus off for its main screen only
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 150; max-width: 95%; height: auto; max-height: 90%;
        border: thick $primary; background: $surface; padding: 0 1; }
    """

    def compose(self) -> ComposeResult:
        t = Table(title="tqbench workbench · key bindings", expand=True, box=None, title_style="bold")
        for col in ("where", "key", "action", "what it does"):  # one line per binding where the width allows
            t.add_column(col, style="bold" if col == "key" else None, no_wrap=col != "what it does",
                         ratio=1 if col == "what it does" else None)
        for row in binding_rows(self.app):
            t.add_row(*row)
        key = self.app.key_for
        with VerticalScroll():
            yield Static(t)
            yield Static(
                "\n[b]Run[/b]: baseline and candidate decode in lockstep; candidate tokens that differ from the "
                "baseline are highlighted, [b #ffd700]▶[/] marks the first divergence. A dense-shadow candidate "
                "reads exact K/V: its output equals fp16 by construction (storage-only).\n"
                f"[b]Sessions[/b]: {key('app.save')} saves everything (JSON + safetensors) to the data dir "
                f"($TQBENCH_DATA_DIR or --session-dir); {key('app.open')} opens one; {key('app.rerun')} re-runs the "
                f"shown run and diffs it against the saved tokens. {key('app.cancel')} cancels long work. "
                f"{' / '.join(k.strip() for k in self.BINDINGS[0].key.split(','))} closes this list."
            )
