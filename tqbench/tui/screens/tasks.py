"""The long-context task suite (``engine.tasks``) from the workbench: context, candidate, tasks, samples; the suite
runs in a worker (escape cancels, then closes) and fills a table of baseline vs candidate scores per task."""

from __future__ import annotations

import threading

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable, Input, Label, Select

from tqbench.constants import DEFAULT_CACHE_MODE, DEFAULT_TASK_CONTEXT, DEFAULT_TASK_SAMPLES
from tqbench.engine.tasks.spec import CONTEXT_CHOICES
from tqbench.tui.panes.jobs import run_engine_job

COLUMNS = ("task", "samples", "chance", "baseline", "candidate", "agreement", "delta")


def table_cells(row: dict) -> tuple[str, ...]:
    return (row["task"], str(row["samples"]), f"{row['chance']:.0f}", f"{row['baseline_score']:.1f}",
            f"{row['candidate_score']:.1f}", f"{row['agreement']:.0f}%", f"{row['delta']:+.1f}")


class TasksScreen(ModalScreen):
    """Runs ``run_tasks`` on the app's engine; ``result`` holds the last ``TasksResult``."""

    BINDINGS = [Binding("escape", "close", "Cancel/close", id="tasks.close")]
    AUTO_FOCUS = "#tasks-candidate"
    DEFAULT_CSS = """
    TasksScreen { align: center middle; }
    TasksScreen > Vertical { width: 110; max-width: 95%; height: 30; border: thick $primary;
        background: $surface; padding: 0 1; }
    TasksScreen Horizontal { height: auto; }
    TasksScreen Label { padding: 0 1; color: $text-muted; }
    TasksScreen #tasks-candidate { width: 1fr; }
    TasksScreen #tasks-context { width: 14; }
    TasksScreen #tasks-samples { width: 6; }
    TasksScreen #tasks-names { width: 1fr; }
    TasksScreen #tasks-table { height: 1fr; border: round $panel; }
    """

    class _Event(Message):
        def __init__(self, event) -> None:
            super().__init__()
            self.event = event

    class _Finished(Message):
        def __init__(self, result, error: str | None, cancelled: bool) -> None:
            super().__init__()
            self.result, self.error, self.cancelled = result, error, cancelled

    def __init__(self, candidate: str = "turbo4", baseline: str = "fp16", cache_mode: str = DEFAULT_CACHE_MODE) -> None:
        super().__init__()
        self.candidate, self.baseline, self.cache_mode = candidate, baseline, cache_mode
        self.running = False
        self.result = None
        self._cancel = threading.Event()

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("[b]long-context tasks[/b] (RULER-style): enter or the button runs baseline and candidate; "
                        "escape cancels, then closes")
            with Horizontal():
                yield Label("candidate")
                yield Input(self.candidate, id="tasks-candidate", compact=True)
                yield Label("context")
                yield Select([(str(c), c) for c in CONTEXT_CHOICES], value=DEFAULT_TASK_CONTEXT, id="tasks-context", compact=True,
                             allow_blank=False)
                yield Label("samples")
                yield Input(str(DEFAULT_TASK_SAMPLES), id="tasks-samples", compact=True, type="integer")
            with Horizontal():
                yield Label("tasks")
                yield Input("", placeholder="the default set (or e.g. niah_single,qa)", id="tasks-names", compact=True)
                yield Button("Run tasks", id="tasks-run", compact=True, variant="primary")
            yield Label("ready", id="tasks-status")
            yield DataTable(id="tasks-table", cursor_type="row", zebra_stripes=True)

    def on_mount(self) -> None:
        table = self.query_one("#tasks-table", DataTable)
        for col in COLUMNS:
            table.add_column(col, key=col)

    @on(Input.Submitted)
    @on(Button.Pressed, "#tasks-run")
    def action_run_tasks(self) -> None:
        from tqbench.engine.policy import parse_policy
        from tqbench.engine.tasks import check_tasks

        engine = getattr(self.app, "engine", None)
        if self.running or engine is None:
            self.app.notify("the suite is running" if self.running else "the model is still loading",
                            severity="warning")
            return
        try:
            candidate = self.query_one("#tasks-candidate", Input).value.strip()
            parse_policy(candidate)
            context = int(self.query_one("#tasks-context", Select).value)
            samples = int(self.query_one("#tasks-samples", Input).value or "0")
            text = self.query_one("#tasks-names", Input).value
            names = [n.strip() for n in text.split(",") if n.strip()] or None
            check_tasks(names, context, samples, engine.max_context, engine.name)
        except ValueError as exc:
            self.app.notify(str(exc).splitlines()[0], title="cannot run the tasks", severity="error")
            return
        self.running = True
        self._cancel.clear()
        self.query_one("#tasks-table", DataTable).clear()
        self.query_one("#tasks-status", Label).update("building samples ...")
        self._run(engine, candidate, context, names, samples)

    @work(thread=True, exclusive=True, group="tasks", exit_on_error=False)
    def _run(self, engine, candidate, context, names, samples) -> None:
        from tqbench.engine import run_tasks

        result, error, cancelled = run_engine_job(lambda: run_tasks(
            engine, candidate, context, tasks=names, samples=samples, baseline=self.baseline,
            cache_mode=self.cache_mode, on_event=lambda ev: self.post_message(self._Event(ev)),
            cancel=self._cancel.is_set))
        self.post_message(self._Finished(result, error, cancelled))

    @on(_Event)
    def _event(self, msg: _Event) -> None:
        from tqbench.engine.events import Progress

        ev = msg.event
        if isinstance(ev, Progress):
            count = f"{ev.done:g}/{ev.total:g} " if ev.total else ""
            self.query_one("#tasks-status", Label).update(f"{count}{ev.message}")

    @on(_Finished)
    def _finished(self, msg: _Finished) -> None:
        self.running = False
        status = self.query_one("#tasks-status", Label)
        if msg.error:
            status.update(f"[red]tasks failed[/]: {msg.error}")
            self.app.notify(msg.error, title="tasks failed", severity="error")
        elif msg.cancelled:
            status.update("cancelled: nothing was kept")
        else:
            self.show_result(msg.result)
            self.app.session.tasks.append(msg.result)  # saved with the session (ctrl+s)

    def show_result(self, result) -> None:
        self.result = result
        table = self.query_one("#tasks-table", DataTable)
        table.clear()
        for task in result.tasks:
            table.add_row(*table_cells(result.task_row(task)), key=task)
        table.add_row(*table_cells(result.task_row(None)), key="overall")
        cached = f"; baseline answers cached for {result.baseline_cached}" if result.baseline_cached else ""
        self.query_one("#tasks-status", Label).update(
            f"{result.dataset}: {result.candidate} vs {result.baseline} ({result.cache_mode}){cached}")

    def action_close(self) -> None:
        if self.running:
            self._cancel.set()
            self.query_one("#tasks-status", Label).update("cancelling ...")
            return
        self.dismiss(self.result)
