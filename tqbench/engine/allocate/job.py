"""``allocate_policy``: measure, solve, measure jointly, verify. The one allocation job the CLI and the workbench run.

1. sensitivity (``sensitivity.measure_sensitivity``) on the calibration sequences (``texts.calibration_set``:
   by default the shipped mix of four kinds), per layer or per KV head, every cell persisted to a partial results
   file as it is measured, so a cancelled or killed job resumes where it stopped (another budget, codec list or
   granularity for the same calibration and token protection reuses every cell it shares);
2. the exact-bytes additive solve (``solver.solve_allocation``) at each sink/recent option, then exchange steps,
   every candidate measured as the joint chunk KL of the whole policy (``exchange.improve``);
3. verification (``verify.frontier``) teacher-forced on two texts no step chose on (``rivers`` and
   ``heldout:technical`` by default; any overlap with the calibration texts is refused).
With ``min_speed`` (or ``verify_speed``) the solve also keeps the predicted decode speed relative to dense at or
above a minimum (``speed.py``: a cost model measured on this machine; the report's ``speed``).
Events: ``SensitivityMeasured`` per cell, ``Progress("solve"|"measure"|"verify"|"speed", ...)``, ``TeacherForcedStep``;
``cancel`` is checked every step (``Cancelled``).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from tqbench.engine.allocate.budget import check_budget
from tqbench.engine.allocate.chunk import ChunkRunner, build_codec
from tqbench.engine.allocate.demote import (
    DemoteTier,
    check_demote_codecs,
    demote_key,
    shared_specs,
    tier_options,
)
from tqbench.engine.allocate.exchange import (
    REPRICE_WITHIN,
    ExchangeStep,
    JointMeasure,
    as_protection,
    improve,
    protection_grid,
)
from tqbench.engine.allocate.head_job import NOTE as HEAD_NOTE
from tqbench.engine.allocate.head_job import head_keep_cells, needed_keys, solve_heads
from tqbench.engine.allocate.head_keeps import head_axis_split
from tqbench.engine.allocate.joint import axis_split, solve_joint
from tqbench.engine.allocate.keeps import (
    KeepCells,
    keep_key,
)
from tqbench.engine.allocate.operating import (
    choose_rotation,
    own_transforms,
    unaffordable,
    uniform_of_bytes,
    uniform_warning,
)
from tqbench.engine.allocate.sensitivity import (
    BOUNDED,
    EXACT,
    SensitivityTable,
    measure_sensitivity,
    sliding_repricer,
)
from tqbench.engine.allocate.solver import Allocation
from tqbench.engine.allocate.spec import DEFAULT_CODECS, DEFAULT_MEASUREMENTS, GRANULARITIES, AllocateSpec  # noqa: F401
from tqbench.engine.allocate.speed import (
    DEFAULT_RULE_KL,
    SpeedReport,
    measure_speed,
    protection_key,
    resolve_min_speed,
    speed_constraint,
)
from tqbench.engine.allocate.texts import MIX, calibration_set, check_unseen
from tqbench.engine.allocate.verify import FrontierPoint, frontier_texts
from tqbench.engine.atomic import atomic_write
from tqbench.engine.codecs import canonical_spec, is_calibrated_spec
from tqbench.engine.codecs.ggml import QK as GGML_BLOCK
from tqbench.engine.events import CancelFlag, OnEvent, Progress, emit, raise_if_cancelled
from tqbench.engine.models.fingerprint import model_config_summary
from tqbench.engine.policy.artifact import PolicyArtifact
from tqbench.engine.policy.spec import Policy
from tqbench.engine.request import RequestError

#: calibrated key codecs added to the K choices when the model has a fit (``pcaq``)
CALIBRATED_K = ("pcaq2", "pcaq3", "pcaq4")
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
    measured_kl: float | None = None  # the chosen policy's joint chunk KL on the calibration sequences
    steps: list[ExchangeStep] = field(default_factory=list)
    unseen: FrontierPoint | None = None  # the second unseen text
    notes: list[str] = field(default_factory=list)  # what was not available and why (pcaq, layer skipping)
    speed: SpeedReport | None = None  # predicted (and, verify_speed, measured) decode speed vs dense
    axes: dict | None = None  # the axes searched, the keep cells and where the bytes went (``joint.axis_split``)
    uniform: dict = field(default_factory=dict)  # text -> the uniform policy of no more bytes, verified beside it
    warnings: list[str] = field(default_factory=list)  # e.g. far worse than that uniform policy (``operating.py``)

    @property
    def predicted_kl(self) -> float:
        """The measured-based prediction: the joint calibration KL (the additive sum when not measured)."""
        return self.measured_kl if self.measured_kl is not None else self.allocation.predicted_kl

    @property
    def worst_verified_kl(self) -> float | None:
        """The larger verified KL of the two texts (what ``--max-kl`` gates)."""
        kls = [p.kl_mean for p in (self.verified, self.unseen) if p is not None]
        return max(kls) if kls else None

    def fitted_vs_unseen(self) -> dict:
        v, u = self.verified, self.unseen
        return {"predicted_kl": self.predicted_kl, "predictor": "joint chunk KL on the calibration sequences"
                if self.measured_kl is not None else "additive sum of cells",
                "additive_kl": self.allocation.predicted_kl, "calibration_joint_kl": self.measured_kl,
                "verification_text": v.text if v else None, "verification_kl": v.kl_mean if v else None,
                "unseen_text": u.text if u else None, "unseen_kl": u.kl_mean if u else None,
                "unseen_over_verification": (u.kl_mean / v.kl_mean) if u and v and v.kl_mean else None,
                "predicted_over_verification": (self.predicted_kl / v.kl_mean) if v and v.kl_mean else None}

    def to_dict(self) -> dict:
        return {"model": self.model, "fingerprint": self.fingerprint, "setup": self.setup,
                "allocation": self.allocation.to_dict(), "bits_grid": self.allocation.bits_grid(),
                "verified": self.verified.to_dict() if self.verified else None,
                "unseen": self.unseen.to_dict() if self.unseen else None,
                "fitted_vs_unseen": self.fitted_vs_unseen(),
                "steps": [s.to_dict() for s in self.steps], "notes": self.notes,
                "measured_cells": self.measured_cells, "resumed_cells": self.resumed_cells,
                "seconds": self.seconds, "partial_path": self.partial_path,
                "speed": self.speed.to_dict() if self.speed else None, "axes": self.axes,
                "context_tokens": self.allocation.estimate.seq_len, "uniform": self.uniform,
                "warnings": self.warnings, "worst_verified_kl": self.worst_verified_kl,
                "sensitivity": self.table.to_rows()}

    def to_artifact(self, geometry) -> PolicyArtifact:
        a = self.allocation
        model = {"name": self.model, "fingerprint": self.fingerprint, "num_layers": geometry.num_layers,
                 "kv_heads": geometry.kv_heads, "head_dim": geometry.head_dim}
        fvu = {k: v for k, v in self.fitted_vs_unseen().items() if v is not None}
        alloc = {"budget_bits": a.budget_bits, "context_tokens": a.estimate.seq_len,
                 "bits_per_element": a.bits_per_element, "total_bytes": a.estimate.total_bytes,
                 "dense_fp16_bytes": a.estimate.dense_fp16_bytes, "predicted_kl": self.predicted_kl,
                 "additive_kl": a.predicted_kl, "k_codecs": list(a.k), "v_codecs": list(a.v),
                 "joint_measurements": sum(1 for s in self.steps if s.measured_kl is not None),
                 **self.setup, "fitted_vs_unseen": fvu}
        if self.speed:
            alloc["speed"] = self.speed.artifact_fields()
        if self.axes:
            alloc["axes"] = {k: self.axes[k] for k in ("axes", "keeps", "score", "window", "saved_by_codecs",
                                                        "saved_by_eviction", "keep_granularity", "demotes",
                                                        "demoted_bytes") if k in self.axes}
            if "retrieval" in self.axes:  # how the keep cells were priced (the per-cell prices: the JSON report)
                alloc["axes"]["retrieval"] = {k: v for k, v in self.axes["retrieval"].items() if k != "price"}
        tensors = {"sensitivity": self.table.as_tensor(),
                   "layers": torch.tensor(self.table.layers, dtype=torch.int64)}
        verified = self.verified.to_dict() if self.verified else {}
        if self.unseen:
            verified = verified | {"unseen": self.unseen.to_dict()}
        return PolicyArtifact(a.policy, model, alloc, verified, tensors)


def calibration_ids(tokenizer, calibration: str, n: int) -> tuple[torch.Tensor, str]:
    """The first ``n`` tokens of one text (``texts.resolve_text`` names) and its label."""
    cs = calibration_set(tokenizer, calibration, n - 1, 1) if calibration != MIX else None
    if cs is None:
        raise ValueError("calibration_ids reads one text: use texts.calibration_set for the mix")
    return cs.ids, cs.label


def _read_partial(path: str, setup: dict) -> dict[str, float]:
    if not os.path.isfile(path):
        return {}
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"partial results file {path!r} is not valid JSON ({exc}): delete it to start over") from None
    if data.get("format") != PARTIAL_FORMAT:
        raise RequestError("partial_path", path, "it is not an allocate partial results file: give another")
    old = data.get("setup", {})
    # cells are keyed by codec and by unit (layer or layer.head): another codec list or granularity reuses them
    # calibrated key cells name their codec, not their transforms: another fit drops them, the rest stay
    free = ("codecs", "k_codecs", "granularity", "transforms")  # keep cells name their score and window in their keys
    diff = sorted(k for k in set(setup) | set(old) if k not in free and setup.get(k) != old.get(k))
    if diff:
        raise RequestError("partial_path", path, f"it was measured with another setup ({', '.join(diff)} differ): "
                                                 "delete it, or give another")
    same_fit = setup.get("transforms") == old.get("transforms")
    return {k: float(v) for k, v in data.get("cells", {}).items()
            if same_fit or not is_calibrated_spec(k.rsplit("/", 1)[-1])}


def _write_partial(path: str, setup: dict, cells: dict[str, float]) -> None:
    codecs = sorted({key.split("/")[2] for key in cells if key.split("/")[1] in ("k", "v")})
    doc = {"format": PARTIAL_FORMAT, "setup": setup | {"codecs": codecs}, "cells": cells}
    atomic_write(Path(path), json.dumps(doc).encode("utf-8"))


def calibrated_k_choices(engine, base: Policy) -> tuple[list[str], str | None]:
    """The ``pcaq`` key codecs this model can use (its calibrated fit), or [] and the reason."""
    try:
        codec = build_codec(base, CALIBRATED_K[0], "k", 0)
        codec.transforms.check_model(engine.loaded.fingerprint, engine.name)
        codec.transforms.check_geometry(engine.geometry.kv_heads, engine.geometry.head_dim)
        codec.shared_items(engine.geometry.head_dim)
    except Exception as exc:  # noqa: BLE001 - the reason goes into the report
        return [], f"pcaq key codecs not offered: {str(exc).splitlines()[0]}"
    return list(CALIBRATED_K), None


def allocate_policy(engine, budget: float, *, on_event: OnEvent | None = None, cancel: CancelFlag | None = None,
                    spec: AllocateSpec | None = None, **options) -> AllocationReport:
    """Measure, solve, measure jointly, verify (the module doc): what ``spec`` asks for, or an ``AllocateSpec`` of
    ``budget`` and ``options`` (its fields, checked once there). Events go to ``on_event``; ``cancel`` is checked
    every step."""
    spec = spec if spec is not None else AllocateSpec(budget, **options)
    budget = spec.budget
    (calibration, calib_prefill, calib_steps, k_codecs, granularity, context, protections, max_measurements,
     verify_text, unseen_text, verify_prefill, verify_steps, name, partial_path, partial_dir, verify_speed,
     decode_costs, rotation, fit_transforms, compare_uniform, min_speed) = (
        spec.calibration, spec.calib_prefill, spec.calib_steps, spec.k_codecs, spec.granularity, spec.context,
        spec.protections, spec.max_measurements, spec.verify_text, spec.unseen_text, spec.verify_prefill,
        spec.verify_steps, spec.name, spec.partial_path, spec.partial_dir, spec.verify_speed, spec.decode_costs,
        spec.rotation, spec.fit_transforms, spec.compare_uniform, spec.min_speed)
    specs, base_pol, axes, keep_choices, demotes = (list(spec.specs), spec.base_policy, spec.axes,
                                                    spec.keep_choices, spec.demotes)
    per_head = spec.per_head_keeps
    notes: list[str] = list(spec.notes)
    if tuple(spec.codecs) == DEFAULT_CODECS and engine.geometry.head_dim % GGML_BLOCK:  # the default's q8_0
        specs = [c for c in specs if c != "q8_0"]
        notes.append(f"q8_0 not offered: head_dim {engine.geometry.head_dim} is not a multiple of GGML's "
                     f"{GGML_BLOCK}-value block")
    base_pol, why = choose_rotation(rotation, base_pol, engine.geometry, budget, context)
    if why:
        notes.append(why)
    t_start, c_start = time.perf_counter(), time.process_time()
    t_cal, c_cal, fitted = time.perf_counter(), 0.0, None
    if "bits" not in axes:  # eviction alone: every kept row fp16
        specs, kspecs = ["fp16"], ["fp16"]
    elif k_codecs is None:
        extra, why = calibrated_k_choices(engine, base_pol)
        if why and fit_transforms and not base_pol.calib:  # calibration is part of allocating
            path, fitted, c_cal = own_transforms(engine, on_event, cancel, calib_prefill)
            base_pol = replace(base_pol, calib=path)
            extra, why2 = calibrated_k_choices(engine, base_pol)
            why = why2 or (f"pcaq key codecs: transforms {'fitted now' if fitted else 'fitted before'} on the "
                           f"calibration mix for this model ({path})")
        if why:
            notes.append(why)
        kspecs = specs + [c for c in extra if c not in specs]
    else:
        kspecs = [canonical_spec(c) for c in k_codecs]
    check_demote_codecs(spec.demote_codecs, spec.axes, spec.keep_granularity, kept=(kspecs, specs))
    t_cal = time.perf_counter() - t_cal
    check_budget(budget, (specs + [c for c in kspecs if c not in specs]) if "tokens" not in axes else ())
    if "tokens" not in axes and "bits" in axes:  # choices no unit can afford within the budget: never measured
        drop = unaffordable(specs, kspecs, granularity, base_pol, engine.geometry, budget, context)
        if drop:
            specs = [c for c in specs if c not in drop.get("v", ())] or specs
            kspecs = [c for c in kspecs if c not in drop.get("k", ())] or kspecs
            notes.append("not measured (no unit can afford them within the budget at this context): "
                         + "; ".join(f"{r.upper()} {', '.join(cs)}" for r, cs in drop.items()))
    calib = calibration_set(engine.tokenizer, calibration, calib_prefill, calib_steps)
    check_unseen(calib, [verify_text, unseen_text])
    staged = protections is None  # the default grid: one coordinate at a time (exchange.improve)
    if protections is None:
        protections = protection_grid(base_pol, engine.geometry)
    options = list(dict.fromkeys(as_protection(o) for o in [(base_pol.sink, base_pol.recent, base_pol.srecent),
                                                            *protections]))
    setup = {"calibration": calib.label, "calib_sequences": int(calib.ids.shape[0]), "calib_prefill": calib_prefill,
             "calib_steps": calib_steps, "codecs": specs, "k_codecs": kspecs, "granularity": granularity,
             "sink": base_pol.sink, "recent": base_pol.recent, "codec_options": _codec_options(base_pol),
             "model_fingerprint": engine.loaded.fingerprint, "measure": "one-unit chunk KL",
             "transforms": _transforms_digest(base_pol, kspecs)}
    if partial_path is None and partial_dir is not None:
        digest = hashlib.sha256(json.dumps({k: v for k, v in setup.items() if k not in ("codecs", "k_codecs",
                                                                                           "granularity", "transforms")},
                                           sort_keys=True).encode()).hexdigest()[:12]
        os.makedirs(partial_dir, exist_ok=True)
        partial_path = os.path.join(partial_dir, f"{digest}.partial.json")
    known = _read_partial(partial_path, setup) if partial_path else {}
    cells = dict(known)

    def persist(key: str, kl: float) -> None:
        cells[key] = kl
        if partial_path:
            _write_partial(partial_path, setup, cells)

    t0, c0 = time.perf_counter(), time.process_time()
    runner = None
    need_keep = [(layer, f) for layer in _table_layers(engine, base_pol) for f in keep_choices if f < 1
                 and (keep_key(layer, base_pol.score, base_pol.window, f, base_pol.chunk) not in known
                      or any(demote_key(layer, base_pol.score, base_pol.window, f, d, base_pol.chunk) not in known
                             for d in demotes))
                 and not per_head]
    if per_head:
        need_keep = [k for k in needed_keys(_table_layers(engine, base_pol), engine.geometry.kv_heads, keep_choices,
                                            base_pol) if k not in known]
    if max_measurements or not known or need_keep:
        emit(on_event, Progress("setup", 0, 1, f"exact prefill of {calib.ids.shape[0]} x {calib_prefill} "
                                               "calibration tokens"))
        runner = ChunkRunner(engine, calib.ids, calib_prefill)
        emit(on_event, Progress("setup", 1, 1, "calibration prefill done"))
        if runner.skip_note:
            notes.append(runner.skip_note)
    ts, cs = time.perf_counter(), time.process_time()
    table = measure_sensitivity(engine, calib.ids, calib_prefill, specs, base_pol, known=known, on_cell=persist,
                                on_event=on_event, cancel=cancel, granularity=granularity, k_codecs=kspecs,
                                runner=runner)
    tk = time.perf_counter()
    if table.bounded:
        notes.append(f"{len(table.bounded)} q8_0 cells not measured: their unit's turbo4 cell is below "
                     f"{BOUNDED['q8_0'][1]:g} KL, so q8_0 can gain at most that; taken as turbo4's (never chosen)")
    keep_cells = KeepCells(runner, base_pol.score, base_pol.window, base_pol.chunk) if runner is not None and "tokens" in axes else None
    keep_kl = {}
    keep_resumed = sum(1 for layer in table.layers for f in keep_choices
                       if f < 1 and keep_key(layer, base_pol.score, base_pol.window, f, base_pol.chunk) in known and not per_head)
    if per_head:
        heads = engine.geometry.kv_heads
        keep_kl = head_keep_cells(keep_cells, table.layers, heads, keep_choices, base_pol, known, cells, persist,
                                  on_event, cancel)
        keep_resumed = sum(1 for k in needed_keys(table.layers, heads, keep_choices, base_pol) if k in known)
    for i, (layer, f) in enumerate((layer, f) for layer in table.layers for f in keep_choices
                                   if f < 1 and not per_head):
        key = keep_key(layer, base_pol.score, base_pol.window, f, base_pol.chunk)
        emit(on_event, Progress("keep", i, len(table.layers) * (len(keep_choices) - 1), f"layer {layer} keep={f:g}"))
        if key not in known:
            raise_if_cancelled(cancel, "allocate")
            persist(key, keep_cells.cell(layer, f, base_pol.sink, base_pol.recent))
        keep_kl[(layer, f)] = cells[key]
    retrieval, calib_keep_kl = None, keep_kl
    if "tokens" in axes and spec.probes and keep_kl:  # the answers of needle probes beside the calibration KL
        from tqbench.engine.allocate.retrieval import PROBE_MIN, price_keeps

        keep_kl, retrieval = price_keeps(engine, keep_kl, base_pol, probes=spec.probes, weight=spec.probe_weight,
                                         protocols=spec.probe_protocols, context=spec.probe_context or max(calib_prefill, PROBE_MIN),
                                         known=known, cells=cells, persist=persist, on_event=on_event, cancel=cancel)
    tier = DemoteTier(keep_cells) if keep_cells is not None and demotes else None
    demote_kl, demote_resumed = {}, 0
    tier_cells = [(layer, f, d) for layer in table.layers for f in keep_choices if f < 1 for d in demotes]
    for i, (layer, f, d) in enumerate(tier_cells):
        key = demote_key(layer, base_pol.score, base_pol.window, f, d, base_pol.chunk)
        emit(on_event, Progress("demote", i, len(tier_cells), f"layer {layer} keep={f:g} demote={d}"))
        if key not in known:
            raise_if_cancelled(cancel, "allocate")
            persist(key, tier.cell(base_pol, layer, f, d))
        else:
            demote_resumed += 1
        demote_kl[(layer, f, d)] = cells[key]
    t1, c1 = time.perf_counter(), time.process_time()
    speed, costs_cached = None, False
    if resolve_min_speed(min_speed)[1] != "none" or verify_speed or decode_costs is not None:
        emit(on_event, Progress("speed", 0, 1, f"decode costs at {context} tokens"))
        try:
            speed, costs_cached = speed_constraint(engine, table, base_pol, context, min_speed, decode_costs,
                                                   partial_path)
        except Exception as exc:  # noqa: BLE001 - the default rule gives way (said in the notes); a given one not
            if resolve_min_speed(min_speed)[1] == "given":
                raise
            notes.append(f"decode speed not considered: {str(exc).splitlines()[0]}")
        emit(on_event, Progress("speed", 1, 1, f"decode costs at {context} tokens"))
    t_speed = time.perf_counter()
    emit(on_event, Progress("solve", 0, 1, f"{budget:g} bits at {context} tokens"))
    measure = JointMeasure(runner, keeps=keep_cells, tier=tier) if runner is not None else None
    joint = None
    if "tokens" in axes:
        tiers = tier_options(keep_kl, demote_kl, demotes, engine.geometry, context) if demotes else None

        def joint(tab, geo, bud, ctx, pol, nm):
            return solve_joint(tab, keep_kl, keep_choices, geo, bud, ctx, pol, nm, tiers=tiers,
                               tier_specs=shared_specs(demotes))
    if per_head:
        hk, alloc, measured, steps = solve_heads(table, keep_kl, keep_choices, engine.geometry, budget, context,
                                                 base_pol, name or f"alloc-{budget:g}bit", keep_cells,
                                                 bool(max_measurements and keep_cells is not None))
        notes.append(HEAD_NOTE)
    elif max_measurements and measure is not None:
        reprice = sliding_repricer(engine, runner, table, base_pol, specs, kspecs, granularity, cells, persist,
                                   cancel) if "tokens" not in axes else None
        c_rep = time.process_time()
        alloc, measured, steps = improve(table, engine.geometry, budget, context, base_pol, measure,
                                         protections=options, max_measurements=max_measurements,
                                         name=name or f"alloc-{budget:g}bit", on_event=on_event, cancel=cancel,
                                         speed=speed, solver=joint, staged=staged, reprice=reprice)
        if reprice is not None and any("re-measured" in s.move for s in steps):
            notes.append(f"srecent options within {REPRICE_WITHIN}x of the best re-solved on their own cells: "
                         f"{reprice.measured} sliding-layer cells re-measured (solve_and_measure phase; "
                         f"{time.process_time() - c_rep:.0f} s CPU with its joint measurements)")
    else:
        from tqbench.engine.allocate.solver import solve_allocation

        solve = joint or (speed.solve if speed is not None else solve_allocation)
        alloc = solve(table, engine.geometry, budget, context, base_pol, name or f"alloc-{budget:g}bit")
        measured, steps = None, []
    if speed is not None and (gave := speed.gave_way.get(protection_key(alloc.policy))):
        notes.append(f"min speed: the default rule (no slower than {speed.model.costs.reference}) gave way: keeping "
                     f"it raised the additive KL from {gave[1]:.4f} to {gave[0]:.4f}, over {DEFAULT_RULE_KL}x; the "
                     "allocation is kept no slower than the least-KL solution instead (a min_speed given explicitly never gives way)")
    if alloc.policy.calib and not _uses_calibrated(alloc.policy):  # the fit was offered, not chosen: no reference
        alloc = replace(alloc, policy=replace(alloc.policy, calib=""))
    emit(on_event, Progress("solve", 1, 1, f"{alloc.bits_per_element:.3f} bits/element"))
    t2, c2 = time.perf_counter(), time.process_time()
    texts = [t for t in (verify_text, unseen_text) if t is not None]
    uniform = uniform_of_bytes(alloc, base_pol, engine.geometry, context) if compare_uniform and texts else None
    pols = [alloc.policy] + ([uniform] if uniform is not None else [])
    measured_pts = frontier_texts(engine, pols, texts=texts, prefill=verify_prefill, steps=verify_steps,
                                  context=context, on_event=on_event, cancel=cancel) if texts else {}
    points = {t: pts[0] for t, pts in measured_pts.items()}
    uniform_pts = {t: pts[1] for t, pts in measured_pts.items() if len(pts) > 1}
    warnings = [w for t in texts if (w := uniform_warning(points.get(t), uniform_pts.get(t)))]
    if compare_uniform and texts and uniform is None:
        notes.append("no uniform policy of no more bytes to compare with (the allocation is below uniform turbo1)")
    t3, c3 = time.perf_counter(), time.process_time()
    speed_rep = None
    if speed is not None:
        speed_rep = speed.report(alloc, context, measure_speed(engine, alloc.policy, context) if verify_speed else None)
    keys = {k for k in cells if k in known}
    n_cells = sum(1 for u in table.units() for c in table.choices(u[1]) if c not in EXACT) - len(table.bounded)
    resumed = sum(1 for u in table.units() for c in table.choices(u[1])
                  if (f"{u[0]}" + (f".{u[2]}" if len(u) == 3 else "") + f"/{u[1]}/{c}") in keys)
    report = AllocationReport(
        engine.name, engine.loaded.fingerprint, setup | {"config": _geometry_summary(engine)}, alloc, table,
        points.get(verify_text) if verify_text else None,
        n_cells - resumed + len(keep_kl) - keep_resumed + len(demote_kl) - demote_resumed,
        resumed + keep_resumed + demote_resumed,
        {"calibrate": round(t_cal, 2), "setup": round(ts - t0, 2), "sensitivity": round(t1 - ts, 2),
         "solve_and_measure": round(t2 - t1, 2), "verify": round(t3 - t2, 2),
         # CPU seconds of this process per phase (all threads): less sensitive to other processes than wall time
         "cpu": {"calibrate": round(c_cal, 2), "setup": round(cs - c0, 2), "sensitivity": round(c1 - cs, 2),
                 "solve_and_measure": round(c2 - c1, 2), "verify": round(c3 - c2, 2)},
         "total": round(t3 - t_start, 2), "total_cpu": round(c3 - c_start, 2), "transforms_fitted": fitted,
         "threads": torch.get_num_threads(), "chunk_forwards": runner.calls if runner else 0,
         "layer_skipping": bool(runner and runner.layer_skipping)},
        partial_path, measured, steps, points.get(unseen_text) if unseen_text else None, notes,
    )
    report.uniform = {p.text: p.to_dict() for p in uniform_pts.values()}  # keyed by the text's label
    report.warnings = warnings
    if "tokens" in axes:
        report.seconds["keep_cells"] = round(t1 - tk, 2)  # of the sensitivity phase: recording + keep cells
        report.axes = {"axes": list(axes), "keeps": list(keep_choices), "score": base_pol.score,
                       "window": base_pol.window,  # keep cells: "L/f" per layer, "L.h/f" per KV head
                       "keep_cells": {".".join(map(str, key[:-1])) + f"/{key[-1]:g}": kl
                                      for key, kl in calib_keep_kl.items()},  # (the calibration KL alone)
                       "demotes": list(demotes),
                       "demote_cells": {f"{layer}/{f:g}/{d}": kl for (layer, f, d), kl in demote_kl.items()},
                       **(head_axis_split(hk, engine.geometry, context) if per_head else
                          axis_split(alloc.policy, engine.geometry, context))}
        if retrieval is not None:
            report.axes["retrieval"] = retrieval  # the probes' price per cell; the solve read keep + weight * price
        if per_head:
            report.axes["keep_granularity"] = "head"
            report.axes["head_keeps"] = {str(layer): list(fs) for layer, fs in sorted(hk.head_keeps.items())}
    if speed_rep is not None:
        report.speed = speed_rep
        report.seconds.update(speed=round(t_speed - t1, 2), speed_costs_cached=costs_cached,
                              verify_speed=round(time.perf_counter() - t3, 2))
    return report


def _uses_calibrated(policy: Policy) -> bool:
    specs = (policy.k, *(spec for role, _, spec in policy.overrides if role in ("k", "kv")))
    return any(is_calibrated_spec(part) for s in specs for part in str(s).split("|"))


def _transforms_digest(base: Policy, kspecs) -> str:
    """The calibrated key transforms the ``pcaq`` cells read ("" when none is offered)."""
    if not any(is_calibrated_spec(c) for c in kspecs):
        return ""
    from tqbench.engine.codecs.transforms_file import load_transforms

    return load_transforms(base.calib).digest


def _codec_options(base: Policy) -> str:
    """The base policy as the codec cells see it: without its eviction ranking (score, window, chunk), which only
    keep cells read and which their keys name, so a ranking change reuses the codec cells of a partial file."""
    d = Policy()
    return replace(base, score=d.score, window=d.window, chunk=d.chunk, calib=d.calib).to_string()


def _table_layers(engine, base: Policy) -> list[int]:
    from tqbench.engine.allocate.sensitivity import allocatable_layers

    return allocatable_layers(base, engine.geometry)


def _geometry_summary(engine) -> dict:
    s = model_config_summary(engine.config)
    return {k: s[k] for k in ("model_type", "num_layers", "num_kv_heads", "head_dim")}
