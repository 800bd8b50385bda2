"""Ask for a sweep to run from the workbench: the spec file, the result folder, Ray or not, resume or not."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Checkbox, Input, Label


class SweepScreen(ModalScreen):
    """Dismisses with ``{"spec", "out", "ray", "resume"}`` (enter in a field), or None (escape)."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Close", id="sweep.close")]
    AUTO_FOCUS = "#sweep-spec"
    DEFAULT_CSS = """
    SweepScreen { align: center middle; }
    SweepScreen > Vertical { width: 90; max-width: 95%; height: auto; border: thick $primary;
        background: $surface; padding: 0 1; }
    SweepScreen Horizontal { height: auto; }
    SweepScreen Label { padding: 0 1; color: $text-muted; }
    """

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("[b]run a sweep[/b]: enter starts it in the Compare tab, escape closes")
            yield Label("spec (.toml)")
            yield Input(placeholder="examples/sweep.toml", id="sweep-spec")
            yield Label("result folder (empty: sweeps/<name>)")
            yield Input(placeholder="sweeps/<name>", id="sweep-out")
            with Horizontal():
                yield Checkbox("on Ray", id="sweep-ray", compact=True)
                yield Checkbox("resume", id="sweep-resume", compact=True)

    @on(Input.Submitted)
    def _submit(self) -> None:
        spec = self.query_one("#sweep-spec", Input).value.strip()
        if not spec:
            self.app.notify("give the sweep's spec file", severity="warning")
            return
        self.dismiss({"spec": spec, "out": self.query_one("#sweep-out", Input).value.strip() or None,
                      "ray": self.query_one("#sweep-ray", Checkbox).value,
                      "resume": self.query_one("#sweep-resume", Checkbox).value})
