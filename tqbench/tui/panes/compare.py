"""Compare: several policies against one baseline over prompts, in a worker; a sortable table + recommendation."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import Button, DataTable, Input, Label, ProgressBar, Select, Static, TextArea

from tqbench.constants import COMPARE_PROMPTS, DEFAULT_CACHE_MODE
from tqbench.tui.panes.compare_tasks import CompareTasks
from tqbench.tui.panes.jobs import (
    cancel_job,
    engine_for_job,
    finish_job,
    notify_policy_warnings,
    run_engine_job,
)
from tqbench.tui.widgets.prompt_box import PromptBox

if TYPE_CHECKING:
    from tqbench.engine.validate import CompareResult, CompareRow

DEFAULT_POLICIES = "turbo4;turbo3;turbo2;q8k-q8v;k4v2"
DEFAULT_PROMPTS = "\n".join(COMPARE_PROMPTS)
#: (column label, row key, format)
COLUMNS = (
    ("policy", "policy", "{}"),
    ("verdict", "verdict", "{}"),
    ("saved %", "memory_saved_pct", "{:.1f}"),
    ("bits/el", "bits_per_element", "{:.2f}"),
    ("token match", "token_match_ratio", "{:.3f}"),
    ("prefix match", "prefix_match_ratio", "{:.3f}"),
    ("top-1", "top1_match_ratio", "{:.3f}"),
    ("KL mean", "kl_mean", "{:.4f}"),
    ("speed ratio", "throughput_ratio", "{:.2f}"),
)
VERDICT_STYLE = {"exact-match": "bold green", "near-stable": "green", "prefix-stable-then-diverged": "yellow",
                 "diverged": "bold red"}


def _policy_list(text: str) -> list[str]:
    from tqbench.engine import split_policies  # the rule every front end splits a policy list by

    return split_policies(text)


class CompareTable(DataTable):
    """The comparison's rows: enter opens one in Run; s / r sort by the next column / reverse (or click a header)."""

    HELP_SCOPE = "Compare · results table"
    BINDINGS = [
        Binding("enter", "select_cursor", "Open in Run", tooltip="Open the highlighted row's policy in Run with its "
                "prompt", id="compare.open"),
        Binding("s", "sort_next", "Sort", tooltip="Sort by the next column (a click on a header sorts by it)",
                id="compare.sort"),
        Binding("r", "sort_reverse", "Reverse sort", tooltip="Reverse the order of the sorted column",
                id="compare.reverse"),
    ]

    class SortAsked(Message):
        """``step`` columns on from the sorted one (0: the same column, order reversed)."""

        def __init__(self, step: int) -> None:
            super().__init__()
            self.step = step

    def action_sort_next(self) -> None:
        self.post_message(self.SortAsked(1))

    def action_sort_reverse(self) -> None:
        self.post_message(self.SortAsked(0))


class ComparePane(Vertical):
    HELP_SCOPE = "Compare"
    BINDINGS = [
        Binding("ctrl+t", "tasks", "Task suite", tooltip="Run the long-context task suite on every listed policy "
                "against the baseline (context, samples and tasks on the tasks row)", id="compare.tasks",
                priority=True),
    ]
    DEFAULT_CSS = """
    ComparePane { height: 1fr; }
    ComparePane .controls { height: 1; }
    ComparePane .controls Label { padding: 0 1; color: $text-muted; }
    ComparePane #cmp-policies { width: 1fr; }
    ComparePane #cmp-baseline { width: 12; }
    ComparePane #cmp-tokens { width: 7; }
    ComparePane #cmp-mode { width: 18; }
    ComparePane #cmp-button { margin-left: 1; }
    ComparePane #cmp-prompts { height: 4; border: round $panel; }
    ComparePane #cmp-progress { height: auto; }
    ComparePane #cmp-progress ProgressBar { width: 40; }
    ComparePane #cmp-status { width: 1fr; height: auto; padding: 0 1; }
    ComparePane #cmp-table { height: 1fr; border: round $panel; }
    ComparePane #recommendation { height: auto; max-height: 8; padding: 0 1; background: $boost; }
    """

    class Finished(Message):
        def __init__(self, result, error: str | None, cancelled: bool) -> None:
            super().__init__()
            self.result = result
            self.error = error
            self.cancelled = cancelled

    class _Event(Message):
        def __init__(self, event) -> None:
            super().__init__()
            self.event = event

    class OpenInRun(Message):
        """Open a compared policy in Run (with the first prompt)."""

        def __init__(self, policy: str, prompt: str, max_new_tokens: int, cache_mode: str) -> None:
            super().__init__()
            self.policy = policy
            self.prompt = prompt
            self.max_new_tokens = max_new_tokens
            self.cache_mode = cache_mode

    def __init__(self, params: dict | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.initial = params or {}
        self.running = False
        self.status = "idle"
        self.result: CompareResult | None = None
        self.sort_key: str | None = None
        self.sort_reverse = False
        self._cancel = threading.Event()

    def compose(self) -> ComposeResult:
        p = self.initial
        with Horizontal(classes="controls"):
            yield Label("policies")
            yield Input(p.get("policies") or DEFAULT_POLICIES, id="cmp-policies", compact=True,
                        tooltip="';' between policies (',' too between names: a compact policy keeps its commas)")
            yield Label("baseline")
            yield Input(p.get("baseline", "fp16"), id="cmp-baseline", compact=True)
        with Horizontal(classes="controls"):
            yield Label("max tokens")
            yield Input(str(p.get("max_new_tokens", 32)), id="cmp-tokens", compact=True, type="integer")
            yield Label("cache mode")
            yield Select([(m, m) for m in ("compressed", "simulate", "dense-shadow", "fused")],
                         value=p.get("cache_mode", DEFAULT_CACHE_MODE), id="cmp-mode", compact=True, allow_blank=False)
            yield Button("Compare ^r", id="cmp-button", compact=True, variant="primary")
        yield CompareTasks(self, id="cmp-tasks")
        yield PromptBox(p.get("prompts") or DEFAULT_PROMPTS, id="cmp-prompts")
        with Horizontal(id="cmp-progress"):
            yield ProgressBar(total=1, show_eta=False, id="cmp-bar")  # idle: an empty bar (no total animates)
            yield Label("ready: one prompt per line; ctrl+r compares every policy against the baseline",
                        id="cmp-status")
        yield CompareTable(id="cmp-table", cursor_type="row", zebra_stripes=True)
        yield Static("", id="recommendation")

    def on_mount(self) -> None:
        table = self.query_one("#cmp-table", DataTable)
        for label, key, _ in COLUMNS:
            table.add_column(label, key=key)
        keys = {b.id: self.app.get_key_display(b) for b in CompareTable.BINDINGS}
        table.border_title = (f"{keys['compare.sort']} sorts by the next column, {keys['compare.reverse']} reverses "
                              f"(or click a header) · {keys['compare.open']} opens the row in Run")

    # ---- running ---------------------------------------------------------------------------------
    def prompts(self) -> list[str]:
        return [line.strip() for line in self.query_one("#cmp-prompts", TextArea).text.splitlines() if line.strip()]

    @on(Button.Pressed, "#cmp-button")
    def action_compare(self) -> None:
        from tqbench.engine import check_max_new_tokens
        from tqbench.engine.policy import parse_policy

        engine = engine_for_job(self, "comparison")
        if engine is None:
            return
        try:
            policies = _policy_list(self.query_one("#cmp-policies", Input).value)
            if not policies:
                raise ValueError("no policies to compare: list them in the policies field, ';' between them")
            for pol in policies:
                parse_policy(pol)
            baseline = self.query_one("#cmp-baseline", Input).value.strip() or "fp16"
            parse_policy(baseline)
            prompts = self.prompts()
            if not prompts:
                raise ValueError("no prompts: write one prompt per line")
            tokens = check_max_new_tokens(int(self.query_one("#cmp-tokens", Input).value or "32"))
        except ValueError as exc:
            self.app.notify(str(exc).splitlines()[0], title="cannot compare", severity="error")
            return
        mode = str(self.query_one("#cmp-mode", Select).value)
        notify_policy_warnings(self.app, engine, baseline, *policies)
        self.running = True
        self.status = "running"
        self._cancel.clear()
        self.query_one("#cmp-table", DataTable).clear()
        self.query_one("#recommendation", Static).update("")
        self.query_one("#cmp-bar", ProgressBar).update(total=len(prompts) * (len(policies) + 1), progress=0)
        self._compare(engine, policies, prompts, baseline, mode, tokens)

    def action_tasks(self) -> None:
        """The long-context task suite on every listed policy (``compare_tasks``), against the baseline, in the
        chosen cache mode."""
        engine = engine_for_job(self, "comparison or task suite")
        if engine is None:
            return
        try:
            policies = _policy_list(self.query_one("#cmp-policies", Input).value)
            if not policies:
                raise ValueError("no policies to run the tasks on: list them in the policies field, ';' between them")
            baseline = self.query_one("#cmp-baseline", Input).value.strip() or "fp16"
            for pol in (baseline, *policies):
                engine.check_policy(pol)
        except ValueError as exc:
            self.app.notify(str(exc).splitlines()[0], title="cannot run the tasks", severity="error")
            return
        mode = str(self.query_one("#cmp-mode", Select).value)
        self._cancel.clear()
        if self.query_one(CompareTasks).start(engine, policies, baseline, mode, self._cancel.is_set):
            notify_policy_warnings(self.app, engine, baseline, *policies)
            self.running = True
            self.status = "tasks"
            self.query_one("#cmp-bar", ProgressBar).update(total=None)

    @work(thread=True, exclusive=True, group="compare", exit_on_error=False)
    def _compare(self, engine, policies, prompts, baseline, mode, tokens) -> None:
        from tqbench.engine.validate import compare_policies

        result, error, cancelled = run_engine_job(lambda: compare_policies(
            engine, policies, prompts, baseline=baseline, cache_mode=mode, max_new_tokens=tokens,
            on_event=lambda ev: self.post_message(self._Event(ev)), cancel=self._cancel.is_set))
        self.post_message(self.Finished(result, error, cancelled))

    def action_cancel(self) -> bool:
        return cancel_job(self, "#cmp-status")

    @on(_Event)
    def _event(self, msg: _Event) -> None:
        from tqbench.engine.events import CompareCell, Progress

        ev = msg.event
        if isinstance(ev, Progress):
            bar = self.query_one("#cmp-bar", ProgressBar)
            bar.update(total=ev.total, progress=ev.done)
            self.query_one("#cmp-status", Label).update(ev.message)
        elif isinstance(ev, CompareCell):
            self.query_one("#cmp-status", Label).update(
                f"{ev.policy} on prompt {ev.prompt_index + 1}: {ev.verdict}, token match {ev.token_match_ratio:.2f}")

    @on(Finished)
    def _finished(self, msg: Finished) -> None:
        finish_job(self, msg, "#cmp-status", "compare")

    # ---- showing ---------------------------------------------------------------------------------
    def show_result(self, result: CompareResult, note: str = "") -> None:
        self.result = result
        rows = result.rows
        with self.prevent(Select.Changed):  # the form shows what was compared
            self.query_one("#cmp-policies", Input).value = ";".join(dict.fromkeys(r.sweep_policy or r.policy
                                                                                 for r in rows))
            self.query_one("#cmp-baseline", Input).value = str(result.baseline)
            self.query_one("#cmp-tokens", Input).value = str(result.max_new_tokens)
            if result.cache_mode in ("compressed", "simulate", "dense-shadow", "fused"):
                self.query_one("#cmp-mode", Select).value = result.cache_mode
            prompts = [p for p in (result.prompts or []) if isinstance(p, str)]
            if prompts:
                self.query_one("#cmp-prompts", TextArea).text = "\n".join(p.replace("\n", " ") for p in prompts)
        n = len(result.prompts or []) * (len(rows) + 1)
        self.query_one("#cmp-bar", ProgressBar).update(total=n or 1, progress=n or 1)
        self.query_one("#cmp-status", Label).update(
            note or f"done: {len(rows)} policies x {len(result.prompts or [])} prompts vs "
            f"{result.baseline} ({result.cache_mode})")
        self.fill_table()
        rec = result.recommendation
        text = f"recommendation: [b]{rec.get('recommended_policy')}[/b] ({rec.get('status')}"
        if rec.get("memory_saved_pct"):
            text += f", {rec['memory_saved_pct']:.1f}% saved"
        text += ")"
        if rec.get("best_risky_policy"):
            text += f" · best risky candidate: [b]{rec['best_risky_policy']}[/b]"
        if rec.get("note"):
            text += f" · [yellow]{rec['note']}[/]"
        for nothing in rec.get("saves_nothing_policies") or ():  # the engine's rule: never recommended
            text += f"\n[yellow]saves nothing: {nothing['policy']}: {nothing['note']}[/]"
        if rec.get("caveat"):
            text += f"\n[yellow]caveat: {rec['caveat']}[/]"
        self.query_one("#recommendation", Static).update(text)

    def fill_cells(self, result: CompareResult) -> None:
        """A running sweep's cells so far (the form and the status line stay as they are)."""
        self.result = result
        self.fill_table()

    def sorted_rows(self) -> list[CompareRow]:
        rows = list(self.result.rows) if self.result else []
        if self.sort_key:
            def key(r):
                v = getattr(r, self.sort_key)
                return (v is None, v if v is not None else 0)
            rows.sort(key=key, reverse=self.sort_reverse)
        return rows

    def fill_table(self) -> None:
        table = self.query_one("#cmp-table", DataTable)
        table.clear()
        for r in self.sorted_rows():
            cells = []
            for _, key, fmt in COLUMNS:
                v = getattr(r, key)
                s = "-" if v is None else fmt.format(v)
                style = VERDICT_STYLE.get(v, "") if key == "verdict" else ""
                cells.append(Text(s, style=style, justify="left" if key in ("policy", "verdict") else "right"))
            table.add_row(*cells, key=r.key)  # a sweep's rows are cells (keyed by cell id)

    @on(DataTable.HeaderSelected, "#cmp-table")
    def _sort(self, event: DataTable.HeaderSelected) -> None:
        self.sort_by(str(event.column_key.value))

    @on(CompareTable.SortAsked)
    def _sort_key(self, event: CompareTable.SortAsked) -> None:
        keys = [key for _, key, _ in COLUMNS]
        if event.step == 0:
            self.sort_by(self.sort_key or keys[0])
        else:
            now = keys.index(self.sort_key) if self.sort_key in keys else -1
            self.sort_by(keys[(now + event.step) % len(keys)])

    def sort_by(self, key: str) -> None:
        """Sort by ``key`` (again: the other way); numbers start with the best (largest, KL smallest)."""
        self.sort_reverse = not self.sort_reverse if self.sort_key == key else key not in ("policy", "verdict",
                                                                                             "kl_mean")
        self.sort_key = key
        label = next(label for label, k, _ in COLUMNS if k == key)
        arrow = "↓" if self.sort_reverse else "↑"
        table = self.query_one("#cmp-table", DataTable)
        table.border_subtitle = f"sorted by {label} {arrow}"
        for name, k, _ in COLUMNS:  # the sorted column's header carries the arrow
            if k in table.columns:
                table.columns[k].label = Text(f"{name} {arrow}" if k == key else name)
        self.fill_table()

    @on(DataTable.RowSelected, "#cmp-table")
    def _open(self, event: DataTable.RowSelected) -> None:
        if not self.result:
            return
        key = str(event.row_key.value)
        row = next(r for r in self.result.rows if r.key == key)
        prompts = [p for p in (self.result.prompts or []) if isinstance(p, str)] or self.prompts()
        prompt = row.prompt or (prompts[0] if prompts else "")  # a sweep cell carries its own prompt
        self.post_message(self.OpenInRun(row.policy_string, prompt,
                                         int(self.result.max_new_tokens), self.result.cache_mode))
