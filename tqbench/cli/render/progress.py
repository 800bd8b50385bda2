"""Engine events drawn on stderr: a rich progress bar (``EventProgress``) and streamed text (``TokenPrinter``)."""

from __future__ import annotations

import sys

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tqbench.cli.render.console import err


class EventProgress:
    """An ``on_event`` callback that draws engine events as a rich progress bar on stderr.

    ``lines``: plain progress lines instead (``ProgressLines``): what a redirected stderr (a log file, ``--json``
    runs) can show; a rich bar draws nothing there."""

    def __init__(self, enabled: bool = True, total: float | None = None, label: str = "work",
                 lines: bool = False) -> None:
        self.enabled = enabled
        self.total = total
        self.label = label
        self.progress = None
        self.task = None
        self.tasks: dict[str, int] = {}
        self.lines = ProgressLines(label) if lines and enabled else None

    def __enter__(self) -> EventProgress:
        if self.enabled and self.lines is None:
            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), console=err, transient=True)
            self.progress.__enter__()
            self.task = self.progress.add_task(self.label, total=self.total)
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.__exit__(*exc)

    def __call__(self, ev: object) -> None:
        if self.lines is not None:
            self.lines(ev)
            return
        if self.progress is None:
            return
        from tqbench.engine import events as E

        p = self.progress
        if isinstance(ev, E.PairStep):
            p.update(self.task, completed=ev.step + 1, description=f"{self.label}: step {ev.step + 1}")
        elif isinstance(ev, E.Progress):
            if ev.task in ("baseline", "candidate"):  # teacher-forced steps
                if ev.task not in self.tasks:
                    self.tasks[ev.task] = p.add_task(f"teacher-forced {ev.task}", total=ev.total)
                p.update(self.tasks[ev.task], completed=ev.done, total=ev.total)
            else:
                p.update(self.task, completed=ev.done, total=ev.total,
                         description=f"{self.label}: {ev.message}" if ev.message else self.label)
        elif isinstance(ev, E.ScanLayerDone):
            p.update(self.task, completed=ev.index + 1, total=ev.total, description=f"scan: layer {ev.layer}")


class ProgressLines:
    """Engine ``Progress`` events as plain lines on stderr: one when a phase (the event's ``task``) starts or ends,
    otherwise at most one every ``every`` seconds, each with the seconds since the first event."""

    def __init__(self, label: str, every: float = 10.0, stream=None) -> None:
        self.label = label
        self.every = every
        self.stream = stream
        self.start: float | None = None
        self.last = 0.0
        self.phase: str | None = None

    def __call__(self, ev: object) -> None:
        import time

        from tqbench.engine import events as E

        if not isinstance(ev, E.Progress):
            return
        now = time.monotonic()
        if self.start is None:
            self.start = now
        new_phase = ev.task != self.phase
        final = ev.total is not None and ev.done >= ev.total
        if not (new_phase or final or now - self.last >= self.every):
            return
        self.phase, self.last = ev.task, now
        count = f" {ev.done:g}/{ev.total:g}" if ev.total is not None else ""
        message = f" {ev.message}" if ev.message else ""
        stream = self.stream or sys.stderr
        stream.write(f"{self.label}: {ev.task}{count}{message} [{now - self.start:.0f} s]\n")
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
