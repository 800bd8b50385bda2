"""A sweep directory: the spec it ran, one result per cell, the final report. Never pickle.

```
DIR/sweep.json                 the normalized spec (and the spec file's text)
DIR/cells/<cell id>.json       one cell: its key, status ("ok" or "error"), results or the error
DIR/cells/<cell id>.safetensors   that cell's per-step arrays (written first; the JSON names its sha256)
DIR/report.json, DIR/report.md the ranking and recommendation per model (written at the end)
```
Every file is written atomically (``engine.atomic``), so a killed sweep leaves whole cells or none: a cell
counts as finished when its JSON exists with status "ok" and the same key as the current spec's cell.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np

from tqbench.engine.atomic import atomic_write
from tqbench.engine.request import RequestError

CELL_FORMAT = "tqbench-sweep-cell"
SWEEP_FORMAT = "tqbench-sweep"
VERSION = 1


def _json(doc: dict) -> bytes:
    return (json.dumps(doc, indent=1, allow_nan=False, default=_default) + "\n").encode()


def _default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    raise TypeError(f"not JSON-serializable: {type(x).__name__}")


class SweepDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.cells = self.path / "cells"

    @staticmethod
    def is_sweep(path: str | Path) -> bool:
        return (Path(path) / "sweep.json").is_file()

    def prepare(self, spec_dict: dict, spec_text: str, resume: bool) -> None:
        """Create the folder; refuse to mix a new sweep into one with results unless ``resume``."""
        if self.path.exists() and not self.path.is_dir():
            raise RequestError("out", str(self.path), "it is a file: give a folder for the sweep's results")
        existing = sorted(self.cells.glob("*.json")) if self.cells.is_dir() else []
        if existing and not resume:
            raise RequestError("out", str(self.path), f"it already holds {len(existing)} cell result(s): resume "
                                                      "that sweep, or give another folder")
        self.cells.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path / "sweep.json", _json({"format": SWEEP_FORMAT, "version": VERSION,
                                                      "written": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                                      "spec": spec_dict, "spec_text": spec_text}))

    def read_spec(self) -> dict:
        try:
            doc = json.loads((self.path / "sweep.json").read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{self.path}/sweep.json cannot be read ({exc}): is this a sweep directory?") from None
        if doc.get("format") != SWEEP_FORMAT:
            raise ValueError(f"{self.path}/sweep.json is not a tqbench sweep")
        return doc

    # ---- cells ---------------------------------------------------------------------------------------
    def write_cell(self, cell_id: str, doc: dict, arrays: dict[str, np.ndarray] | None = None) -> Path:
        """Arrays first (safetensors), then the JSON that names them: a crash never leaves a dangling JSON."""
        doc = {"format": CELL_FORMAT, "version": VERSION, "cell_id": cell_id, **doc}
        if arrays:
            from safetensors.numpy import save

            blob = save({k: np.ascontiguousarray(v) for k, v in arrays.items()})
            name = f"{cell_id}.safetensors"
            atomic_write(self.cells / name, blob)
            doc["arrays"] = {"file": name, "sha256": hashlib.sha256(blob).hexdigest(), "names": sorted(arrays)}
        path = self.cells / f"{cell_id}.json"
        atomic_write(path, _json(doc))
        return path

    def read_cell(self, cell_id: str) -> dict | None:
        path = self.cells / f"{cell_id}.json"
        if not path.is_file():
            return None
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            return None  # unreadable: the cell runs again
        return doc if doc.get("format") == CELL_FORMAT else None

    def read_arrays(self, cell_id: str) -> dict[str, np.ndarray]:
        doc = self.read_cell(cell_id)
        if not doc or "arrays" not in doc:
            return {}
        blob = (self.cells / doc["arrays"]["file"]).read_bytes()
        if hashlib.sha256(blob).hexdigest() != doc["arrays"]["sha256"]:
            raise ValueError(f"{doc['arrays']['file']} does not match {cell_id}.json (changed or corrupt)")
        from safetensors.numpy import load

        return load(blob)

    def all_cells(self) -> list[dict]:
        out = []
        for p in sorted(self.cells.glob("*.json")) if self.cells.is_dir() else []:
            doc = self.read_cell(p.stem)
            if doc is not None:
                out.append(doc)
        return out

    def write_report(self, report: dict, markdown: str | None = None) -> None:
        atomic_write(self.path / "report.json", _json(report))
        if markdown is not None:
            atomic_write(self.path / "report.md", markdown.encode())
