"""Engine events drawn on stderr: a rich progress bar (``EventProgress``) and streamed text (``TokenPrinter``)."""

from __future__ import annotations

import sys

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from tqbench.cli.render.console import err


def unit_of(ev: object, label: str, total: float | None = None) -> tuple[str, float, float | None, str] | None:
    """``(phase, done, total, message)`` of an engine event that counts work units, else None: what both the
    rich bar and the plain lines draw."""
    from tqbench.engine import events as E

    if isinstance(ev, E.PairStep):
        return label, ev.step + 1, total, ""
    if isinstance(ev, E.Progress):
        return ev.task, ev.done, ev.total, ev.message
    if isinstance(ev, E.ScanLayerDone):
        return "scan", ev.index + 1, ev.total, f"layer {ev.layer}"
    return None


class EtaColumn(ProgressColumn):
    """Time left, by the engine's one ETA rule (``events.eta_text``): blank until the first unit ends."""

    def render(self, task) -> Text:
        from tqbench.engine.events import eta_text

        if task.finished:
            return Text("")
        return Text(eta_text(task.elapsed or 0.0, task.completed, task.total), style="progress.remaining")


class EventProgress:
    """An ``on_event`` callback that draws engine events on stderr: a rich progress bar with the units done of
    the total and the time left on a terminal; plain lines (``ProgressLines``) where stderr is not one (a pipe, a
    log file), since a rich bar draws nothing there. ``lines``: force one or the other (None: by the terminal)."""

    def __init__(self, enabled: bool = True, total: float | None = None, label: str = "work",
                 lines: bool | None = None) -> None:
        self.enabled = enabled
        self.total = total
        self.label = label
        self.progress = None
        self.task = None
        self.tasks: dict[str, int] = {}
        if lines is None:
            lines = not err.is_terminal
        self.lines = ProgressLines(label) if lines and enabled else None

    def __enter__(self) -> EventProgress:
        if self.enabled and self.lines is None:
            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), EtaColumn(), console=err, transient=True)
            self.progress.__enter__()
            self.task = self.progress.add_task(self.label, total=self.total)
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.__exit__(*exc)

    def __call__(self, ev: object) -> None:
        if self.lines is not None:
            self.lines(ev, self.total)
            return
        if self.progress is None:
            return
        unit = unit_of(ev, self.label, self.total)
        if unit is None:
            return
        phase, done, total, message = unit
        p = self.progress
        if phase in ("baseline", "candidate"):  # teacher-forced steps: one bar per run
            if phase not in self.tasks:
                self.tasks[phase] = p.add_task(f"teacher-forced {phase}", total=total)
            p.update(self.tasks[phase], completed=done, total=total)
            return
        what = message if phase in (self.label, "scan") else f"{phase} {message}".strip()
        p.update(self.task, completed=done, total=total,
                 description=f"{self.label}: {what}" if what and what != self.label else self.label)


class ProgressLines:
    """Engine progress as plain lines on stderr: one when a phase (the event's ``task``) starts or ends, otherwise
    at most one every ``every`` seconds, each with the units done of the total, the seconds since the job started
    and, after the phase's first unit, the time left (``events.PhaseEta``)."""

    def __init__(self, label: str, every: float = 10.0, stream=None, clock=None) -> None:
        from tqbench.engine.events import PhaseEta

        self.label = label
        self.every = every
        self.stream = stream
        self.eta = PhaseEta(clock)
        self.last = self.eta.start
        self.pending = ""  # a count-less opening message: written once the job goes on (an input error stays one line)

    def __call__(self, ev: object, total: float | None = None) -> None:
        unit = unit_of(ev, self.label, total)
        if unit is None:
            return
        phase, done, total, message = unit
        eta = self.eta.update(phase, done, total)
        now = self.eta.seen
        final = total is not None and done >= total
        if not (self.eta.new_phase or final or self.pending or now - self.last >= self.every):
            return
        self.last = now
        count = f" {done:g}/{total:g}" if total is not None else ""
        name = "" if phase == self.label else f" {phase}"
        text = f" {message}" if message else ""
        line = f"{self.label}:{name}{count}{text} [{now - self.eta.start:.0f} s{', ' + eta if eta else ''}]\n"
        if total is None and done == 0:
            self.pending = line
            return
        stream = self.stream or sys.stderr
        stream.write(self.pending + line)
        self.pending = ""
        stream.flush()


class TokenPrinter:
    """Streams generated text to stdout as it arrives."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.started = False

    def token(self, delta: str) -> None:
        if self.enabled and delta:
            if not self.started:
                err.rule("generated text")
                self.started = True
            sys.stdout.write(delta)
            sys.stdout.flush()

    def close(self) -> None:
        if self.enabled and self.started:
            sys.stdout.write("\n")
            err.rule()
