"""A solver that measures: protection options and exchange steps, each scored by the JOINT chunk KL.

The additive solution (``solver.solve_allocation``) assumes the cells' KLs add up; measured totals are about twice
that. Here every candidate policy is measured as a whole (``JointMeasure``: all layers and heads quantized at once,
one chunk forward over the calibration sequences) and kept only when the measured total falls:

1. protection options: for each (sink, recent) of a small grid, the additive solve at that protection (it costs
   bytes inside the budget), measured jointly; the best by measured KL is kept. ``staged`` (the default grid):
   one coordinate at a time, each option one measurement: the recent windows at the first option's sink, then the
   other sinks at the best window, then (models mixing sliding-window and full-attention layers) the sliding
   layers' own recent rows (``srecent``) at the best (sink, recent). An ``srecent`` option solved on cells measured
   at the base's rows is mispriced (its sliding layers hold other fp16 rows); with ``reprice`` (``job``: the sliding
   layers' cells re-measured at that option) an option measuring within ``REPRICE_WITHIN`` of the best is solved
   again on its own cells and measured again (one more measurement), the better of the two kept;
2. exchange steps from it: upgrade one unit and downgrade one or more others so the exact bytes stay within the
   budget (``estimate_kv``), candidates ranked by their additive change, each measured; accepted when the measured
   total falls; at most ``max_measurements`` joint measurements in all.

Every measurement is one ``ExchangeStep`` (``to_dict`` for the JSON report). The calibration sequences are the only
text any step sees.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

from tqbench.engine.allocate.chunk import ChunkRunner
from tqbench.engine.allocate.sensitivity import SensitivityTable
from tqbench.engine.allocate.solver import (
    Allocation,
    allocation_of,
    budget_bytes,
    solve_allocation,
    unit_bytes,
)
from tqbench.engine.cache.geometry import KVGeometry
from tqbench.engine.events import CancelFlag, OnEvent, Progress, emit, raise_if_cancelled
from tqbench.engine.policy.spec import Policy

JOB = "allocate"
#: the default grid of full-precision sink tokens x recent window (at the stated context). 8 and 32: where fixed
#: bytes are large (Gemma-3 270M at 2.5 bits, 1,024 tokens), recent=16 is 15% of the budget (0.375 bits/element)
SINK_GRID = (4, 16, 64)
RECENT_GRID = (8, 16, 32, 64, 128)
#: the sliding-window layers' own recent rows (``srecent``) searched where a model mixes compressed sliding-window
#: and full-attention layers: on Gemma-3 270M the windows' recent rows carry most of the recent window's value
#: (docs/allocation.md)
SRECENT_GRID = (0, 8, 16, 32, 64)

Protection = tuple[int, int, int]  # (sink, recent, srecent); srecent -1: as recent
#: an ``srecent`` option is solved again on its own re-measured cells when its first measurement is within this
#: factor of the best so far. Measured on Gemma-3 270M at 2.5 bits (1,024 tokens): re-pricing moved srecent=8 from
#: 0.176 to 0.141 (1.25x) and srecent=32 from 0.171 to 0.160 (1.07x), neither reaching the best (0.128), at about
#: 170 re-measured cells each (most of a sensitivity phase): further off than 1.25x it is not worth its cost
REPRICE_WITHIN = 1.25


def protection_grid(base: Policy, geometry: KVGeometry) -> list[tuple[int, ...]]:
    """The default (sink, recent) options of ``base`` on a model: ``SINK_GRID`` x ``RECENT_GRID``. Where ``base``
    compresses sliding-window layers, recent=0 too: a window-bounded store holds ``window - 1`` rows and a recent
    tail of fp16 rows is a large share of a short window (all of it when the window is shorter than the tail).
    Where every layer slides, only ``base``'s sink: window-bounded stores keep no sinks, so the sink options would
    all be the same policy. Where compressed sliding-window layers and full-attention layers mix, (sink, recent,
    srecent) options too: the windows' own recent rows (``SRECENT_GRID``) at ``base``'s sink and recent."""
    plans = base.plan(geometry.num_layers, list(geometry.layer_types) if geometry.layer_types else None)
    sliding = [p.sliding for p in plans]
    recents = RECENT_GRID + ((0,) if any(sliding) else ())
    sinks = (base.sink,) if all(sliding) else SINK_GRID
    grid: list[tuple[int, ...]] = [(s, r) for s in sinks for r in recents]
    if any(sliding) and not all(sliding):
        grid += [(base.sink, base.recent, sr) for sr in SRECENT_GRID]
    return grid


def as_protection(option: tuple[int, ...]) -> Protection:
    """A (sink, recent) or (sink, recent, srecent) option as (sink, recent, srecent)."""
    if len(option) not in (2, 3):
        raise ValueError(f"protection option {option!r}: give (sink, recent) or (sink, recent, srecent)")
    return (int(option[0]), int(option[1]), int(option[2]) if len(option) == 3 else -1)


def protection_text(sink: int, recent: int, srecent: int = -1) -> str:
    return f"sink={sink},recent={recent}" + (f",srecent={srecent}" if srecent >= 0 else "")


@dataclass(frozen=True)
class ExchangeStep:
    step: int
    kind: str  # "protection" (an additive solve at one sink/recent) or "exchange" (a move from the best so far)
    move: str
    predicted_kl: float | None  # additive: the sum of the chosen cells' KL (None: the option did not fit)
    measured_kl: float | None  # joint chunk KL on the calibration sequences
    bits_per_element: float | None
    total_bytes: int
    sink: int
    recent: int
    accepted: bool
    srecent: int = -1  # the sliding-window layers' recent rows (-1: as recent)

    def to_dict(self) -> dict:
        return asdict(self)


def _unit_name(unit: tuple) -> str:
    return f"L{unit[0]}" + (f".h{unit[2]}" if len(unit) == 3 else "") + f" {unit[1].upper()}"


class JointMeasure:
    """``measure(choice, policy)``: the chunk KL with every unit quantized as ``choice`` says, under ``policy``'s
    token protection and codec options (quantized rows are kept between calls: a move re-quantizes only what it
    changes)."""

    def __init__(self, runner: ChunkRunner, max_cached: int = 600, keeps=None, tier=None) -> None:
        self.runner = runner
        self.keeps = keeps  # keeps.KeepCells: a policy that evicts (keep@) is measured with its layers evicting
        self.tier = tier  # demote.DemoteTier: a layer that demotes (demote@) attends its evicted rows at that codec
        self.count = 0
        self._rows: dict[tuple, torch.Tensor] = {}
        self._max = max_cached

    def _q(self, policy: Policy, spec: str, role: str, layer: int, head: int | None, keep=None) -> torch.Tensor:
        key = (policy.sink, policy.recent, policy.to_string(), spec, role, layer, head, keep)
        if key not in self._rows:
            if keep is None:
                out = self.runner.quantized(policy, spec, role, layer, head)
            else:
                idx = self.keeps.index(layer, keep, policy.sink, policy.recent)
                out = self.keeps.quantized(policy, spec, role, layer, head, idx)
            if len(self._rows) >= self._max:
                self._rows.pop(next(iter(self._rows)))
            self._rows[key] = out
        return self._rows[key]

    def __call__(self, choice: dict, policy: Policy) -> float:
        from tqbench.engine.allocate.keeps import layer_keeps

        evict = layer_keeps(policy, self.runner.engine.geometry)
        if evict and self.keeps is None:
            raise ValueError(f"{policy.to_string()!r} evicts tokens: measure it with the tokens axis (KeepCells)")
        ks, vs = list(self.runner.keys), list(self.runner.values)
        per_head: dict[tuple[int, str], dict[int, str]] = {}
        sliding: dict[int, dict[tuple[str, int | None], str]] = {}  # a sliding layer: one TQLayer for K and V
        for unit, spec in choice.items():
            layer, role = unit[0], unit[1]
            if self.runner.windows[layer] is not None:
                sliding.setdefault(layer, {})[(role, unit[2] if len(unit) == 3 else None)] = spec
            elif len(unit) == 2:
                (ks if role == "k" else vs)[layer] = self._q(policy, spec, role, layer, None, evict.get(layer))
            else:
                per_head.setdefault((layer, role), {})[unit[2]] = spec
        for (layer, role), specs in per_head.items():
            target = ks if role == "k" else vs
            rows = target[layer].clone()
            for h, spec in specs.items():
                rows[:, h:h + 1] = self._q(policy, spec, role, layer, h, evict.get(layer))
            target[layer] = rows
        for layer, specs in sliding.items():
            ks[layer] = vs[layer] = self.runner.cell(policy, layer, specs)[0][layer]
        start = min([u[0] for u in choice] + list(evict), default=0)
        self.count += 1
        if evict:
            masks = {layer: self.keeps.mask(self.keeps.index(layer, f, policy.sink, policy.recent))
                     for layer, f in evict.items()}
            self._demote(policy, evict, ks, vs, masks)
            return self.keeps.kl(ks, vs, masks, start=start)
        return self.runner.kl(ks, vs, start=start)


    def _demote(self, policy: Policy, evict: dict, ks: list, vs: list, masks: dict) -> None:
        from tqbench.engine.allocate.demote import layer_demotes

        demotes = layer_demotes(policy, self.runner.engine.geometry)
        if demotes and self.tier is None:
            raise ValueError(f"{policy.to_string()!r} demotes evicted rows: measure it with the demote tier "
                             "(DemoteTier)")
        if demotes:
            self.tier.apply(policy, evict, demotes, ks, vs, masks)


def _moves(choice: dict, table: SensitivityTable, ub: dict, room: int) -> list[tuple[float, dict, str]]:
    """Candidate moves from ``choice``: (additive KL change, new choice, description), best first. ``room``: the
    bytes the units may use in all (the budget less fixed and shared bytes)."""
    used = sum(ub[u][c] for u, c in choice.items())
    downs = []  # the cheapest next-lower choice of every unit, by KL lost per byte saved
    for u, c in choice.items():
        lower = [(ub[u][d], d) for d in table.choices(u[1]) if ub[u][d] < ub[u][c]]
        if lower:
            nb, d = max(lower)
            loss = table.kl[u][d] - table.kl[u][c]
            downs.append((loss / (ub[u][c] - nb), u, d, ub[u][c] - nb, loss))
    downs.sort(key=lambda t: t[0])
    out = []
    for u, c in choice.items():
        for up in table.choices(u[1]):
            extra = ub[u][up] - ub[u][c]
            gain = table.kl[u][c] - table.kl[u][up]
            if extra <= 0 or gain <= 0:
                continue
            need = used + extra - room
            new = dict(choice)
            new[u] = up
            delta, parts = -gain, [f"up {_unit_name(u)} {c}->{up}"]
            for _, du, d, saved, loss in downs:
                if need <= 0:
                    break
                if du == u:
                    continue
                new[du] = d
                need -= saved
                delta += loss
                parts.append(f"down {_unit_name(du)} {choice[du]}->{d}")
            if need <= 0:
                out.append((delta, new, "; ".join(parts)))
    out.sort(key=lambda t: t[0])
    return out


def _protection_order(options: list[Protection], staged: bool, best: Callable[[], Protection | None]):
    """The options in the order they are measured. ``staged``: every recent window of the options at the first
    option's sink (and ``srecent``), then each other sink of the options at the best of those (``best()``, asked between stages),
    then each sliding-window recent (``srecent``) of the options at the best (sink, recent) so far; a stage with
    nothing measured before it (nothing fitted) falls back to every remaining option."""
    if not staged:
        yield from options
        return
    first, _, first_sr = options[0]
    recents = list(dict.fromkeys((first, r, first_sr) for _, r, _ in options))
    yield from recents
    done = set(recents)
    at = best()
    sinks = [o for o in options if o[0] != first and o[2] < 0]
    sinks = list(dict.fromkeys((s, at[1], at[2]) for s, _, _ in sinks)) if at else sinks
    yield from (o for o in sinks if o not in done)
    done.update(sinks)
    at = best()
    slides = [o for o in options if o[2] >= 0]
    if at:
        slides = [(at[0], at[1], sr) for sr in dict.fromkeys(o[2] for o in slides) if sr != at[1]]
    yield from (o for o in dict.fromkeys(slides) if o not in done)


def improve(
    table: SensitivityTable,
    geometry: KVGeometry,
    budget_bits: float,
    context: int,
    base: Policy,
    measure: Callable[[dict, Policy], float],
    *,
    protections: list[tuple[int, int]] | None = None,
    max_measurements: int = 24,
    name: str | None = None,
    on_event: OnEvent | None = None,
    cancel: CancelFlag | None = None,
    speed=None,
    solver=None,
    staged: bool = False,
    reprice: Callable[[Policy], SensitivityTable | None] | None = None,
) -> tuple[Allocation, float, list[ExchangeStep]]:
    """The best allocation found by measuring (see the module doc): (allocation, its measured joint KL, steps).

    ``protections``: the (sink, recent) options (None: ``base``'s only); options whose cheapest choice does not
    fit the budget are skipped (a step with ``move`` saying so, not measured). ``measure`` is called at most
    ``max_measurements`` times (at least once per fitting protection option). ``speed``: a
    ``speed.SpeedConstraint`` (its solve at every protection option; exchange moves it does not admit are skipped).
    ``solver``: the solve at each option instead (the joint tokens-and-bits solve); its policy's keep values are
    kept by the exchange steps, which move codecs. ``staged``: the recent windows at the first option's sink first,
    then the other sinks at the best of them only (the module doc). ``reprice(policy)``: the table re-measured at
    an ``srecent`` option's protection (None: nothing to re-measure), asked for options measuring within
    ``REPRICE_WITHIN`` of the best; the exchange steps then use the winning option's table."""
    solve = solver or (speed.solve if speed is not None else solve_allocation)
    options = [as_protection(o) for o in (protections or [(base.sink, base.recent, base.srecent)])]
    steps: list[ExchangeStep] = []
    best: tuple[Allocation, float, Policy] | None = None
    count = 0
    total = max(max_measurements, len(options))
    first_error: ValueError | None = None
    slow_error = None  # the speed refusal of the option with the best reachable speed
    tables = {}  # a repriced option's table (by its protection), when it won

    def best_option():
        return (best[2].sink, best[2].recent, best[2].srecent) if best else None

    for sink, recent, srecent in _protection_order(options, staged, best_option):
        raise_if_cancelled(cancel, JOB)
        pol = replace(base, sink=sink, recent=recent, srecent=srecent)
        where = protection_text(sink, recent, srecent)
        try:
            alloc = solve(table, geometry, budget_bits, context, pol, name)
        except ValueError as exc:
            slow = getattr(exc, "best_ratio", None) is not None  # fits the budget, not the minimum speed
            if slow and (slow_error is None or exc.best_ratio > slow_error.best_ratio):
                slow_error = exc
            first_error = first_error or exc
            why = "does not meet the minimum speed" if slow else "does not fit the budget"
            steps.append(ExchangeStep(len(steps), "protection", f"{where}: {why}", None, None,
                                      None, 0, sink, recent, False, srecent))
            continue
        # the exchange steps keep the layers' keep values (the tokens axis) and move codecs
        pol = replace(pol, keep=alloc.policy.keep, demote=alloc.policy.demote,
                      overrides=tuple(o for o in alloc.policy.overrides if o[0] in ("keep", "demote")))
        emit(on_event, Progress("measure", count, total, where.replace(",", " ")))
        m = measure(alloc.choice, pol)
        count += 1
        better = best is None or m < best[1]
        steps.append(ExchangeStep(len(steps), "protection", f"solve at {where}",
                                  alloc.predicted_kl, m, alloc.bits_per_element, alloc.estimate.total_bytes, sink,
                                  recent, better, srecent))
        if better:
            best = (alloc, m, pol)
        if reprice is not None and srecent >= 0 and m < REPRICE_WITHIN * best[1] and count < total:
            raise_if_cancelled(cancel, JOB)
            emit(on_event, Progress("measure", count, total, f"{where.replace(',', ' ')}: re-measuring its cells"))
            own = reprice(pol)
            if own is not None:
                try:
                    again = solve(own, geometry, budget_bits, context, pol, name)
                except ValueError:
                    again = None
                if again is not None and again.choice != alloc.choice:
                    emit(on_event, Progress("measure", count, total, where.replace(",", " ") + " repriced"))
                    m2 = measure(again.choice, pol)
                    count += 1
                    better = m2 < best[1]
                    steps.append(ExchangeStep(len(steps), "protection", f"solve at {where} (cells re-measured there)",
                                              again.predicted_kl, m2, again.bits_per_element,
                                              again.estimate.total_bytes, sink, recent, better, srecent))
                    if better:
                        best = (again, m2, pol)
                        tables[(sink, recent, srecent)] = own
    if best is None:  # the first option's message says what fits
        if slow_error is not None:
            raise slow_error
        raise ValueError(f"{first_error} (no sink/recent option {options} fits)") from None
    alloc, m, pol = best
    table = tables.get((pol.sink, pol.recent, pol.srecent), table)
    ub = unit_bytes(table, pol, geometry, context)
    used = sum(ub[u][c] for u, c in alloc.choice.items())
    # the units may use the bytes the solve used plus what estimate_kv says is still free
    room = used + max(0, budget_bytes(geometry, budget_bits, context, pol) - alloc.estimate.total_bytes)
    tried: set[frozenset] = {frozenset(alloc.choice.items())}
    while count < max_measurements:
        raise_if_cancelled(cancel, JOB)
        cand = None
        for _delta, new, desc in _moves(alloc.choice, table, ub, room):
            if frozenset(new.items()) in tried:
                continue
            tried.add(frozenset(new.items()))
            trial = allocation_of(new, table, geometry, budget_bits, context, pol, name)
            if trial is not None and (speed is None or speed.admits(trial.choice, pol)):  # bytes (and speed) within
                cand = (trial, desc)
                break
        if cand is None:
            break
        trial, desc = cand
        emit(on_event, Progress("measure", count, total, desc))
        mt = measure(trial.choice, pol)
        count += 1
        accepted = mt < m
        steps.append(ExchangeStep(len(steps), "exchange", desc, trial.predicted_kl, mt, trial.bits_per_element,
                                  trial.estimate.total_bytes, pol.sink, pol.recent, accepted, pol.srecent))
        if accepted:
            alloc, m = trial, mt
    emit(on_event, Progress("measure", total, total, f"{count} joint measurements"))
    return alloc, m, steps
