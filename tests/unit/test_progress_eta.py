"""The one ETA rule (``events.eta_seconds``) and the plain progress lines a piped stderr gets."""

from __future__ import annotations

import io

from tqbench.cli.render.progress import ProgressLines
from tqbench.engine.events import Progress, eta_seconds, eta_text, format_duration


def test_eta_is_the_mean_pace_so_far_and_nothing_before_the_first_unit():
    assert eta_seconds(10.0, 1, 5) == 40.0
    assert eta_seconds(30.0, 3, 3) == 0.0
    assert eta_seconds(0.0, 0, 5) is None and eta_seconds(5.0, 1, None) is None
    assert [format_duration(s) for s in (4.4, 65, 3725)] == ["4 s", "1 min 05 s", "1 h 02 min"]
    assert eta_text(10.0, 1, 5) == "about 40 s left" and eta_text(1.0, 0, 5) == ""


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_progress_lines_say_units_and_time_left_per_phase():
    clock, stream = Clock(), io.StringIO()
    lines = ProgressLines("tasks", every=10.0, stream=stream, clock=clock)
    lines(Progress("tasks", 0, None, "building 9 samples"))  # held until the job goes on
    assert stream.getvalue() == ""
    clock.t = 104.0
    lines(Progress("tasks", 1, 18, "niah_single"))  # the job's own phase: its name is not repeated
    clock.t = 106.0
    lines(Progress("tasks", 2, 18))  # under `every` seconds: no line
    clock.t = 108.0
    lines(Progress("baseline", 1, 4))  # a new phase: its pace starts where the last phase's last unit ended
    clock.t = 110.0
    lines(Progress("baseline", 4, 4))  # the end of a phase: no time left
    clock.t = 111.0
    lines(Progress("baseline", 1, 2))  # the count starts again: a new run
    assert stream.getvalue().splitlines() == [
        "tasks: building 9 samples [0 s]",
        "tasks: 1/18 niah_single [4 s, about 1 min 08 s left]",
        "tasks: baseline 1/4 [8 s, about 6 s left]",
        "tasks: baseline 4/4 [10 s]",
        "tasks: baseline 1/2 [11 s, about 1 s left]",
    ]


def test_phase_eta_restarts_per_phase_and_when_a_count_starts_again():
    from tqbench.engine.events import PhaseEta

    clock = Clock()
    eta = PhaseEta(clock)
    clock.t = 110.0
    assert eta.update("sensitivity", 1, 11) == "about 1 min 40 s left" and eta.new_phase
    clock.t = 120.0
    assert eta.update("sensitivity", 2, 11) == "about 1 min 30 s left" and not eta.new_phase
    clock.t = 130.0
    assert eta.update("measure", 1, 3) == "about 20 s left" and eta.new_phase  # paced from 120 s
    assert eta.update("measure", 3, 3) == ""
