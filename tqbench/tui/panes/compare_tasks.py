"""The Compare tab's task suite: the long-context tasks (``engine.tasks.run_tasks``, what ``tqbench --headless
tasks`` runs) on every policy listed in the tab, against the tab's baseline and cache mode. The baseline's answers
come from the suite's cache after the first policy; a row per policy appears as it finishes."""

from __future__ import annotations

from textual import on, work
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import Button, DataTable, Input, Label, Select

from tqbench.constants import DEFAULT_TASK_CONTEXT
from tqbench.engine.tasks.spec import CONTEXT_CHOICES
from tqbench.tui.panes.jobs import run_engine_job


def task_columns(tasks: list[str]) -> list[tuple[str, str]]:
    """(label, key) of the table: policy, compression ratio, a score per task, overall, delta, agreement."""
    return ([("policy", "policy"), ("compression", "compression_ratio")] + [(t, t) for t in tasks]
            + [("overall", "overall"), ("delta", "delta"), ("agreement", "agreement")])


def policy_cells(result, side: str) -> list[str]:
    """One table row of a ``TasksResult``: the candidate's (``side`` "candidate") or the baseline's."""
    board = {(r["task"], r["method"]): r for r in result.leaderboard()}
    method = getattr(result, side)
    overall = result.task_row(None)
    cells = [method, f"{board['overall', method]['compression_ratio']:.3f}"]
    cells += [f"{result.task_row(t)[f'{side}_score']:.1f}" for t in result.tasks]
    cells.append(f"{overall[f'{side}_score']:.1f}")
    cells += [f"{overall['delta']:+.1f}", f"{overall['agreement']:.0f}%"] if side == "candidate" else ["", ""]
    return cells


class CompareTasks(Vertical):
    """Context, samples per task and tasks; ``ComparePane.action_tasks`` (ctrl+t or the button) starts it.
    ``results`` holds one ``TasksResult`` per policy of the last run."""

    DEFAULT_CSS = """
    CompareTasks { height: auto; }
    CompareTasks .controls { height: 1; }
    CompareTasks .controls Label { padding: 0 1; color: $text-muted; }
    CompareTasks #cmp-tasks-context { width: 12; }
    CompareTasks #cmp-tasks-samples { width: 5; }
    CompareTasks #cmp-tasks-names { width: 1fr; }
    CompareTasks #cmp-tasks-button { margin-left: 1; }
    CompareTasks #cmp-tasks-table { height: auto; max-height: 9; border: round $panel; display: none; }
    CompareTasks #cmp-tasks-table.shown { display: block; }
    """

    class _Result(Message):
        def __init__(self, result) -> None:
            super().__init__()
            self.result = result

    class _Event(Message):
        def __init__(self, event) -> None:
            super().__init__()
            self.event = event

    class _Finished(Message):
        def __init__(self, error: str | None, cancelled: bool) -> None:
            super().__init__()
            self.error, self.cancelled = error, cancelled

    def __init__(self, pane, **kwargs) -> None:
        super().__init__(**kwargs)
        self._pane = pane  # the ComparePane that composed this row (its policies, baseline and status)
        self.running = False
        self.results: list = []

    def compose(self) -> ComposeResult:
        from tqbench.engine.tasks import DEFAULT_SAMPLES

        with Horizontal(classes="controls"):
            yield Label("tasks at")
            yield Select([(str(c), c) for c in CONTEXT_CHOICES], value=DEFAULT_TASK_CONTEXT, id="cmp-tasks-context", compact=True,
                         allow_blank=False, tooltip="the long-context task suite's context in tokens")
            yield Label("samples")
            yield Input(str(DEFAULT_SAMPLES), id="cmp-tasks-samples", compact=True, type="integer")
            yield Label("tasks")
            yield Input("", placeholder="the default set (or e.g. niah_single,qa)", id="cmp-tasks-names",
                        compact=True)
            yield Button("Tasks ^t", id="cmp-tasks-button", compact=True)
        yield DataTable(id="cmp-tasks-table", cursor_type="row", zebra_stripes=True)

    @on(Button.Pressed, "#cmp-tasks-button")
    def _pressed(self) -> None:
        self.parent_pane().action_tasks()

    def parent_pane(self):
        return self._pane

    def start(self, engine, policies: list[str], baseline: str, mode: str, cancel) -> bool:
        """Check the fields (a toast says what is wrong) and run the suite on ``policies``; False if it did not start."""
        from tqbench.engine.tasks import check_tasks

        try:
            context = int(self.query_one("#cmp-tasks-context", Select).value)
            samples = int(self.query_one("#cmp-tasks-samples", Input).value or "0")
            names = [n.strip() for n in self.query_one("#cmp-tasks-names", Input).value.split(",") if n.strip()]
            specs = check_tasks(names or None, context, samples, engine.max_context, engine.name)
        except ValueError as exc:
            self.app.notify(str(exc).splitlines()[0], title="cannot run the tasks", severity="error")
            return False
        self.running = True
        self._table([t.name for t in specs], f"long-context tasks at {context} tokens vs {baseline} ({mode}): scores "
                    "in points")
        self._run(engine, policies, context, names or None, samples, baseline, mode, cancel)
        return True

    def _table(self, tasks: list[str], title: str) -> DataTable:
        self.results = []
        table = self.query_one("#cmp-tasks-table", DataTable)
        table.clear(columns=True)
        for label, key in task_columns(tasks):
            table.add_column(label, key=key)
        table.border_title = title
        table.add_class("shown")
        return table

    def show_saved(self, results: list) -> None:
        """A saved session's task-suite results (``TasksResult``), one row per policy after the baseline's."""
        first = results[0]
        self._table(first.tasks, f"saved: long-context tasks at {first.context} tokens vs {first.baseline} "
                                 f"({first.cache_mode}): scores in points")
        for r in results:
            if r.tasks == first.tasks and r.baseline == first.baseline and r.context == first.context:
                self.show_result(r)

    @work(thread=True, exclusive=True, group="compare-tasks", exit_on_error=False)
    def _run(self, engine, policies, context, names, samples, baseline, mode, cancel) -> None:
        from tqbench.engine import run_tasks

        def every_policy():
            for pol in policies:
                self.post_message(self._Result(run_tasks(
                    engine, pol, context, tasks=names, samples=samples, baseline=baseline, cache_mode=mode,
                    on_event=lambda ev, pol=pol: self.post_message(self._Event((pol, ev))), cancel=cancel)))

        _, error, cancelled = run_engine_job(every_policy)
        self.post_message(self._Finished(error, cancelled))

    @on(_Event)
    def _event(self, msg: _Event) -> None:
        from textual.widgets import ProgressBar

        from tqbench.engine.events import Progress

        pol, ev = msg.event
        if isinstance(ev, Progress):
            pane = self.parent_pane()
            count = f"{ev.done:g}/{ev.total:g} " if ev.total else ""
            pane.query_one("#cmp-status", Label).update(f"tasks, {pol}: {count}{ev.message}")
            if ev.total:
                pane.query_one("#cmp-bar", ProgressBar).update(total=ev.total, progress=ev.done)

    @on(_Result)
    def _result(self, msg: _Result) -> None:
        self.show_result(msg.result)
        self.app.session.tasks.append(msg.result)  # saved with the session (ctrl+s)

    def show_result(self, result) -> None:
        table = self.query_one("#cmp-tasks-table", DataTable)
        if not self.results:
            table.add_row(*policy_cells(result, "baseline"), key="baseline")
        self.results.append(result)
        table.add_row(*policy_cells(result, "candidate"), key=result.candidate)

    @on(_Finished)
    def _finished(self, msg: _Finished) -> None:
        self.running = False
        pane = self.parent_pane()
        pane.running = False
        status = pane.query_one("#cmp-status", Label)
        if msg.error:
            status.update(f"[red]tasks failed[/]: {msg.error}")
            self.app.notify(msg.error, title="tasks failed", severity="error")
        elif msg.cancelled:
            status.update(f"tasks cancelled after {len(self.results)} policies (their rows stay)")
        else:
            r = self.results[-1]
            cached = f"; baseline answers cached for {r.baseline_cached}" if r.baseline_cached else ""
            status.update(f"tasks done: {len(self.results)} policies on {r.dataset} vs {r.baseline}{cached}")
