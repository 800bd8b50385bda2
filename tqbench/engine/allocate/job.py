"""``allocate_policy``: measure, solve, verify. The one allocation job the CLI and the workbench run.

1. sensitivity (``sensitivity.measure_sensitivity``) on a calibration text, every cell persisted to a partial
   results file as it is measured, so a cancelled or killed job resumes where it stopped (and another budget
   or codec list for the same calibration and token protection reuses every cell it shares);
2. the exact-bytes solve (``solver.solve_allocation``) at the stated context;
3. verification (``verify.frontier``) teacher-forced on a shipped text that was not the calibration text.
Events: ``SensitivityMeasured`` per cell, ``Progress("solve"|"verify", ...)``, ``TeacherForcedStep``;
``cancel`` is checked every step (``Cancelled``).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tqbench.constants import CORPUS_DIR
from tqbench.engine.allocate.sensitivity import SensitivityTable, measure_sensitivity
from tqbench.engine.allocate.solver import Allocation, solve_allocation
from tqbench.engine.allocate.verify import FrontierPoint, frontier
from tqbench.engine.atomic import atomic_write
from tqbench.engine.codecs import canonical_spec
from tqbench.engine.events import CancelFlag, OnEvent, Progress, emit
from tqbench.engine.models.fingerprint import model_config_summary
from tqbench.engine.policy.artifact import PolicyArtifact
from tqbench.engine.policy.spec import Policy, parse_policy

DEFAULT_CODECS = ("turbo1", "turbo2", "turbo3", "turbo4")
GRANULARITIES = ("layer",)
PARTIAL_FORMAT = "tqbench-allocate-partial/1"


@dataclass
class AllocationReport:
    model: str
    fingerprint: str | None
    setup: dict  # what the sensitivity depends on (calibration, codecs, token protection, codec options)
    allocation: Allocation
    table: SensitivityTable
    verified: FrontierPoint | None
    measured_cells: int
    resumed_cells: int
    seconds: dict = field(default_factory=dict)
    partial_path: str | None = None

    def to_dict(self) -> dict:
        return {"model": self.model, "fingerprint": self.fingerprint, "setup": self.setup,
                "allocation": self.allocation.to_dict(), "bits_grid": self.allocation.bits_grid(),
                "verified": self.verified.to_dict() if self.verified else None,
                "measured_cells": self.measured_cells, "resumed_cells": self.resumed_cells,
                "seconds": self.seconds, "partial_path": self.partial_path,
                "sensitivity": self.table.to_rows()}

    def to_artifact(self, geometry) -> PolicyArtifact:
        a = self.allocation
        model = {"name": self.model, "fingerprint": self.fingerprint, "num_layers": geometry.num_layers,
                 "kv_heads": geometry.kv_heads, "head_dim": geometry.head_dim}
        alloc = {"budget_bits": a.budget_bits, "context_tokens": a.estimate.seq_len,
                 "bits_per_element": a.bits_per_element, "total_bytes": a.estimate.total_bytes,
                 "dense_fp16_bytes": a.estimate.dense_fp16_bytes, "predicted_kl": a.predicted_kl,
                 "k_codecs": list(a.k), "v_codecs": list(a.v), **self.setup}
        tensors = {"sensitivity": self.table.as_tensor(),
                   "layers": torch.tensor(self.table.layers, dtype=torch.int64)}
        return PolicyArtifact(a.policy, model, alloc, self.verified.to_dict() if self.verified else {}, tensors)


def calibration_ids(tokenizer, calibration: str, n: int) -> tuple[torch.Tensor, str]:
    """The first ``n`` tokens of a shipped corpus text (by name) or of a UTF-8 text file; and its label."""
    path = Path(calibration)
    if path.suffix and path.is_file():
        ids = tokenizer(path.read_text(encoding="utf-8"), return_tensors="pt")["input_ids"]
        label = f"file:{path.name}"
    elif (CORPUS_DIR / f"{calibration}.txt").is_file():
        ids = tokenizer((CORPUS_DIR / f"{calibration}.txt").read_text(encoding="utf-8"),
                        return_tensors="pt")["input_ids"]
        label = f"corpus:{calibration}"
    else:
        names = ", ".join(sorted(p.stem for p in CORPUS_DIR.glob("*.txt")))
        raise ValueError(f"calibration {calibration!r} is neither a text file nor a shipped text ({names})")
    if ids.shape[1] < n:
        raise ValueError(f"calibration {label} has {ids.shape[1]} tokens, fewer than the {n} needed "
                         "(prefill + steps): give a longer text or lower --calib-prefill / --calib-steps")
    return ids[:, :n], label


def _read_partial(path: str, setup: dict) -> dict[str, float]:
    if not os.path.isfile(path):
        return {}
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"partial results file {path!r} is not valid JSON ({exc}): delete it to start over") from None
    if data.get("format") != PARTIAL_FORMAT:
        raise ValueError(f"{path!r} is not an allocate partial results file: give another --resume path")
    old = data.get("setup", {})
    diff = sorted(k for k in set(setup) | set(old) if k != "codecs" and setup.get(k) != old.get(k))
    if diff:  # cells are keyed by codec: another codec list reuses the cells of the codecs it shares
        raise ValueError(f"partial results file {path!r} was measured with another setup ({', '.join(diff)} "
                         "differ): delete it, or give another --resume path")
    return {k: float(v) for k, v in data.get("cells", {}).items()}


def _write_partial(path: str, setup: dict, cells: dict[str, float]) -> None:
    codecs = sorted({key.split("/")[2] for key in cells})
    doc = {"format": PARTIAL_FORMAT, "setup": setup | {"codecs": codecs}, "cells": cells}
    atomic_write(Path(path), json.dumps(doc).encode("utf-8"))


def allocate_policy(
    engine,
    budget: float,
    *,
    calibration: str = "lighthouses",
    calib_prefill: int = 1024,
    calib_steps: int = 64,
    codecs: list[str] | tuple[str, ...] = DEFAULT_CODECS,
    granularity: str = "layer",
    base: Policy | str = "sink=4,recent=16",
    context: int = 1024,
    verify_text: str | None = "rivers",
    verify_prefill: int = 1024,
    verify_steps: int = 256,
    name: str | None = None,
    partial_path: str | None = None,
    partial_dir: str | None = None,
    on_event: OnEvent | None = None,
    cancel: CancelFlag | None = None,
) -> AllocationReport:
    """The least-KL policy within ``budget`` bits/element at ``context`` tokens, verified on ``verify_text``.

    ``base`` gives the token protection (sink, recent) and codec options every layer shares; ``codecs`` the
    choices per layer and role. ``verify_text=None`` skips verification. ``partial_path``: the partial results
    file (read if present, updated per cell); or ``partial_dir``: a folder holding one such file per setup.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity {granularity!r} is not available: only per-layer allocation is implemented "
                         "(the cache store keeps one codec width per layer); use --granularity layer")
    specs = [canonical_spec(c) for c in codecs]
    if len(set(specs)) != len(specs) or not specs:
        raise ValueError(f"--codecs {','.join(codecs)!r} is invalid: give distinct codecs, e.g. turbo1,turbo2,turbo4")
    base_pol = parse_policy(base)
    if calib_prefill < 1 or calib_steps < 1:
        raise ValueError("--calib-prefill and --calib-steps must be at least 1")
    ids, calib_label = calibration_ids(engine.tokenizer, calibration, calib_prefill + calib_steps)
    if verify_text is not None and f"corpus:{verify_text}" == calib_label:
        raise ValueError(f"the verification text {verify_text!r} is the calibration text: verify on text the "
                         "allocator did not see (another --verify-text)")
    setup = {"calibration": calib_label, "calib_prefill": calib_prefill, "calib_steps": calib_steps,
             "codecs": specs, "granularity": granularity, "sink": base_pol.sink, "recent": base_pol.recent,
             "codec_options": base_pol.to_string(), "model_fingerprint": engine.loaded.fingerprint,
             "measure": "one-layer chunk KL"}
    if partial_path is None and partial_dir is not None:
        digest = hashlib.sha256(json.dumps(setup, sort_keys=True).encode()).hexdigest()[:12]
        os.makedirs(partial_dir, exist_ok=True)
        partial_path = os.path.join(partial_dir, f"{digest}.partial.json")
    known = _read_partial(partial_path, setup) if partial_path else {}
    cells = dict(known)

    def persist(key: str, kl: float) -> None:
        cells[key] = kl
        if partial_path:
            _write_partial(partial_path, setup, cells)

    t0 = time.perf_counter()
    table = measure_sensitivity(engine, ids, calib_prefill, specs, base_pol, known=known, on_cell=persist,
                                on_event=on_event, cancel=cancel)
    t1 = time.perf_counter()
    emit(on_event, Progress("solve", 0, 1, f"{budget:g} bits at {context} tokens"))
    alloc = solve_allocation(table, engine.geometry, budget, context, base_pol,
                             name or f"alloc-{budget:g}bit")
    emit(on_event, Progress("solve", 1, 1, f"{alloc.bits_per_element:.3f} bits/element"))
    t2 = time.perf_counter()
    verified = None
    if verify_text is not None:
        (verified,) = frontier(engine, [alloc.policy], text=verify_text, prefill=verify_prefill, steps=verify_steps,
                               context=context, on_event=on_event, cancel=cancel)
    t3 = time.perf_counter()
    n_cells = len(table.layers) * 2 * len(specs)
    resumed = sum(1 for k in known if k in {f"{la}/{r}/{c}" for la in table.layers for r in "kv" for c in specs})
    return AllocationReport(
        engine.name, engine.loaded.fingerprint, setup | {"config": _geometry_summary(engine)}, alloc, table, verified,
        n_cells - resumed, resumed,
        {"sensitivity": round(t1 - t0, 2), "solve": round(t2 - t1, 2), "verify": round(t3 - t2, 2),
         "threads": torch.get_num_threads()},
        partial_path,
    )


def _geometry_summary(engine) -> dict:
    s = model_config_summary(engine.config)
    return {k: s[k] for k in ("model_type", "num_layers", "num_kv_heads", "head_dim")}
