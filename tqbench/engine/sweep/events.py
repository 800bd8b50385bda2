"""The events a sweep emits (besides a generic ``Progress("sweep", done, total, message)`` per finished cell,
which any progress bar draws). Kept in the sweep room; the long-job protocol is ``tqbench.engine.events``'."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SweepPlanned:
    """The spec expanded to ``total`` cells; ``reused`` finished ones were found (``--resume``), ``todo`` run."""

    total: int
    todo: int
    reused: int
    runner: str  # "in-process" or "ray (N shards)"


@dataclass(frozen=True)
class SweepModelLoaded:
    model: str  # the spec's model entry
    name: str  # the loaded model's name
    where: str  # "in-process" or the Ray node


@dataclass(frozen=True)
class SweepCellStarted:
    cell_id: str
    label: str
    where: str


@dataclass(frozen=True)
class SweepCellFinished:
    cell_id: str
    label: str
    status: str  # "ok" or "error"
    done: int  # cells finished so far (reused ones included)
    total: int
    seconds: float
    error: str | None = None
