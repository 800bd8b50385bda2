"""Run a sweep: expand the spec, skip finished cells (``resume``), run the rest in-process (one model loaded at
a time) or on Ray (``sweep.ray_runner``), write each cell as it finishes, build the report.

Both runners share ``worker.run_cells`` (what one worker does: load the model once, run its cells, send each
result); only the driver writes files, so on a cluster the workers need no shared disk. A raising cell is
recorded (its error, type and traceback tail) and the sweep goes on; ``Cancelled`` stops it.
"""

from __future__ import annotations

import platform
from pathlib import Path

from tqbench.engine.events import CancelFlag, OnEvent, Progress, emit
from tqbench.engine.sweep.cells import Cell, expand
from tqbench.engine.sweep.events import SweepCellFinished, SweepCellStarted, SweepModelLoaded, SweepPlanned
from tqbench.engine.sweep.report import SweepReport, build_report
from tqbench.engine.sweep.spec import SweepSpec
from tqbench.engine.sweep.store import SweepDir
from tqbench.engine.sweep.worker import run_cells


class Driver:
    """The driver's side: receives what workers send, writes each cell, emits events."""

    def __init__(self, store: SweepDir, cells: list[Cell], reused: int, on_event: OnEvent | None) -> None:
        self.store = store
        self.by_id = {c.cell_id: c for c in cells}
        self.total = len(cells)
        self.done = reused
        self.finished: set[str] = set()
        self.on_event = on_event

    def __call__(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "loaded":
            emit(self.on_event, SweepModelLoaded(msg[1], msg[2], msg[3]))
        elif kind == "started":
            emit(self.on_event, SweepCellStarted(msg[1], self.by_id[msg[1]].label, msg[2]))
        elif kind == "finished":
            cell_id, doc, arrays = msg[1], msg[2], msg[3]
            self.store.write_cell(cell_id, doc, arrays)
            self.done += 1
            self.finished.add(cell_id)
            label = self.by_id[cell_id].label
            err = doc.get("error", {}).get("message") if doc["status"] != "ok" else None
            emit(self.on_event, SweepCellFinished(cell_id, label, doc["status"], self.done, self.total,
                                                  doc.get("seconds", 0.0), err))
            emit(self.on_event, Progress("sweep", self.done, self.total,
                                         f"{label}: {doc['status']}" + (f" ({err})" if err else "")))


def plan(spec: SweepSpec, store: SweepDir, resume: bool) -> tuple[list[Cell], list[Cell], dict[str, dict]]:
    """(every cell, the cells to run, finished documents reused)."""
    cells = expand(spec)
    done, todo = {}, []
    for c in cells:
        doc = store.read_cell(c.cell_id) if resume else None
        if doc is not None and doc.get("status") == "ok" and doc.get("cell") == c.key(spec):
            done[c.cell_id] = doc
        else:
            todo.append(c)
    return cells, todo, done


def run_sweep(
    spec: SweepSpec,
    out: str | Path,
    *,
    resume: bool = False,
    ray: bool = False,
    ray_address: str | None = None,
    on_event: OnEvent | None = None,
    cancel: CancelFlag | None = None,
    engines: dict | None = None,
) -> SweepReport:
    """Run ``spec`` into the folder ``out`` and return the report (also written as ``out/report.json``).

    ``ray``: schedule one task per (model, shard of cells) on a Ray cluster (``ray_address``, else a running
    one, else a local one started here). ``engines``: model spec -> an already loaded ``Engine`` the in-process
    runner uses instead of loading that model when the spec leaves its dtype and device on auto (the workbench
    passes its own). Raises ``Cancelled`` when ``cancel()`` turns true (finished cells stay
    on disk; ``resume`` continues)."""
    store = SweepDir(out)
    spec_text = Path(spec.source).read_text(encoding="utf-8") if spec.source and Path(spec.source).is_file() else ""
    if ray:
        from tqbench.engine.sweep.ray_runner import check_ray

        check_ray()
    store.prepare(spec.to_dict(), spec_text, resume)
    cells, todo, done = plan(spec, store, resume)
    driver = Driver(store, cells, len(done), on_event)
    if ray and not todo:  # every cell reused: no cluster needed
        emit(on_event, SweepPlanned(len(cells), 0, len(done), "ray (nothing to run)"))
    elif ray:
        from tqbench.engine.sweep.ray_runner import run_on_ray

        run_on_ray(spec, todo, driver, ray_address, cancel,
                   lambda shards: emit(on_event, SweepPlanned(len(cells), len(todo), len(done),
                                                              f"ray ({shards} shard{'s' if shards != 1 else ''})")))
    else:
        emit(on_event, SweepPlanned(len(cells), len(todo), len(done), "in-process"))
        emit(on_event, Progress("sweep", len(done), len(cells), f"{len(done)} cells reused" if done else "start"))
        for model in spec.models:
            mine = [c for c in todo if c.model == model]
            if mine:
                run_cells(spec, model, mine, driver, cancel, where=f"in-process ({platform.node()})",
                          engine=(engines or {}).get(model.spec) if (model.dtype, model.device) == ("auto", "auto")
                          else None)
    return finish(spec, store, cells)


def finish(spec: SweepSpec, store: SweepDir, cells: list[Cell]) -> SweepReport:
    """Build the report from what the folder holds for the spec's cells, and write ``report.json``."""
    docs = {}
    for c in cells:
        doc = store.read_cell(c.cell_id)
        if doc is not None and doc.get("cell") == c.key(spec):
            docs[c.cell_id] = doc
    report = build_report(spec, cells, docs)
    store.write_report(report.to_dict())
    return report
