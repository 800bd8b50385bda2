"""An allocator that knows decode speed: a cost model of fused decode, measured on this machine, and the solve
that keeps a policy at or above a minimum speed relative to a dense ``DynamicCache``.

The cost model (``DecodeCosts``), measured once per machine, thread count, model, context and protection
(``measure_costs``; cached as JSON beside the partial results file or in the user cache dir, ``cached_costs``):

- ``layer``: seconds of one layer's fused decode call (the ``TQLayer`` append of the new token's K/V + the
  attention from the packed store, native kernel on CPU) at ``context`` stored rows, for every codec choice of a
  role with the other role at the reference codec (``turbo4``); synthetic rows, every configuration timed round
  by round (interleaved), medians;
- ``mixed`` / ``mixed_extra_group``: the extra seconds of a layer whose KV heads form two groups (two (K, V) codec
  pairs: one side per group of heads in the kernel call) over the head-weighted mean of the uniform layers, and
  of each group past two;
- ``dense_step`` / ``reference_step``: one decode step of the whole model at ``context`` with a ``DynamicCache``
  and with the uniform reference policy in fused mode, interleaved in one process (medians).

Prediction (``SpeedModel.step_seconds``): the reference policy's measured step plus, per allocatable layer, the
difference of the policy's layer cost from the reference layer's (each role: the mean over its KV heads of the
role's per-codec cost; plus the group overhead where the layer's heads form several groups). Tokens/s relative to dense is
``dense_step / step``; the uniform reference predicts exactly its measured ratio, which is the default minimum.

The constraint (``solve_with_speed``): a penalty then a check. The exact-bytes DP minimises KL + lambda x (the
unit's decode seconds); lambda grows (geometric bisection) until the check, the full prediction above (the mixed
overhead included, which is not additive), passes; the least-KL passing solution is kept. When even the fastest
allocation within the budget (lambda -> infinity) fails, ``RequestError("min_speed", ...)`` names the best
reachable ratio. Exchange steps admit only moves whose prediction passes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from tqbench.engine.allocate.budget import resolve_min_speed
from tqbench.engine.allocate.sensitivity import SensitivityTable
from tqbench.engine.allocate.solver import Allocation, allocation_of, solve_allocation
from tqbench.engine.allocate.speed_measure import (  # noqa: F401 (the measuring half, re-exported)
    COSTS_FORMAT,
    LAYER_REPEATS,
    STEP_REPEATS,
    DecodeCosts,
    _digest,
    costs_path,
    decode_steps,
    layer_seconds,
    machine_key,
    measure_costs,
    measure_speed,
)
from tqbench.engine.atomic import atomic_write
from tqbench.engine.policy.spec import Policy
from tqbench.engine.request import RequestError

#: bisection steps of the speed penalty
PENALTY_STEPS = 14
#: the default rule (no slower than the reference) gives way where keeping it would raise the additive KL above
#: this factor of the least-KL solution's: a preference, not a price in quality. On Gemma-3 270M at 2.5 bits
#: (1,024 tokens, costs measured under load) the rule kept 1-bit keys everywhere for a predicted 5% of speed:
#: verified KL 0.70 / 1.20 where the unconstrained solve verifies near 0.1 (docs/allocation.md)
DEFAULT_RULE_KL = 1.25


class SpeedUnreachable(RequestError):
    """No allocation within the budget is predicted at the minimum speed; ``best_ratio``: the best reachable."""

    def __init__(self, value: float, best_ratio: float, reason: str) -> None:
        self.best_ratio = best_ratio
        super().__init__("min_speed", value, reason)


class SpeedModel:
    """Predicted decode tokens/s relative to dense for an allocation's choice (unit -> codec)."""

    def __init__(self, costs: DecodeCosts, layers: list[int]) -> None:
        self.costs = costs
        self.layers = list(layers)  # the allocatable layers (the others are the same in every policy)

    def role_cost(self, role: str, codec: str) -> float:
        """Seconds a role at ``codec`` adds to a layer call over half the uniform reference layer."""
        row = self.costs.layer[role]
        if codec not in row:
            raise ValueError(f"no decode cost for {role.upper()} codec {codec}: measure it (choices "
                             f"{', '.join(row)})")
        return row[codec] - self.costs.uniform_layer / 2

    def unit_seconds(self, unit: tuple, codec: str) -> float:
        """The additive part of one unit's decode cost (a KV head's share at head granularity)."""
        share = 1.0 / self.costs.kv_heads if len(unit) == 3 else 1.0
        return self.role_cost(unit[1], codec) * share

    def step_seconds(self, choice: dict) -> float:
        c = self.costs
        per: dict[int, dict[str, dict]] = {}
        total = c.reference_step - len(self.layers) * c.uniform_layer
        for unit, codec in choice.items():
            total += self.unit_seconds(unit, codec)
            if len(unit) == 3:
                per.setdefault(unit[0], {}).setdefault(unit[1], {})[unit[2]] = codec
        # layers (or roles) the choice does not name keep the reference codec
        named = {(u[0], u[1]) for u in choice}
        for layer in self.layers:
            for role in ("k", "v"):
                if (layer, role) not in named:
                    total += self.role_cost(role, c.reference)
        for roles in per.values():  # the layer's groups: its heads' distinct (K, V) codec pairs
            heads = set(roles.get("k", {})) | set(roles.get("v", {}))
            pairs = {(roles.get("k", {}).get(h, c.reference), roles.get("v", {}).get(h, c.reference)) for h in heads}
            total += c.group_overhead(len(pairs))
        return total

    def ratio(self, choice: dict) -> float:
        return self.costs.dense_step / self.step_seconds(choice)

    def reference_ratio(self) -> float:
        """The uniform reference policy's predicted ratio (its measured one): the default minimum."""
        return self.costs.dense_step / self.costs.reference_step


@dataclass(frozen=True)
class SpeedReport:
    """What the report says about speed: the prediction for the chosen policy, the minimum it had to meet, the
    reference's, the cost table and (``verify_speed``) the measured ratio."""

    context: int
    predicted_ratio: float
    min_ratio: float | None  # None: no minimum (the prediction only)
    min_source: str  # "given", "reference" (uniform turbo4's predicted ratio) or "none"
    reference: str
    reference_ratio: float
    unconstrained_ratio: float | None  # the least-KL solution's prediction before the constraint
    constrained: bool  # whether the constraint changed the solution
    costs: DecodeCosts
    measured: dict | None = None  # {"dense_tok_s", "policy_tok_s", "ratio", "steps"}
    relaxed_to: float | None = None  # the default rule out of reach within the budget: the best reachable ratio

    @property
    def measured_ratio(self) -> float | None:
        return self.measured["ratio"] if self.measured else None

    def artifact_fields(self) -> dict:
        """What the saved policy artifact records (TOML: no nulls, no nested cost table)."""
        out = {"predicted_ratio": self.predicted_ratio, "min_ratio": self.min_ratio, "min_source": self.min_source,
               "reference": self.reference, "reference_ratio": self.reference_ratio,
               "unconstrained_ratio": self.unconstrained_ratio, "constrained": self.constrained,
               "measured_ratio": self.measured_ratio, "relaxed_to": self.relaxed_to,
               "threads": self.costs.machine.get("threads")}
        return {k: v for k, v in out.items() if v is not None}

    def to_dict(self) -> dict:
        return {"context_tokens": self.context, "predicted_ratio": self.predicted_ratio,
                "min_ratio": self.min_ratio, "min_source": self.min_source, "reference": self.reference,
                "reference_ratio": self.reference_ratio, "unconstrained_ratio": self.unconstrained_ratio,
                "constrained": self.constrained, "measured_ratio": self.measured_ratio, "relaxed_to": self.relaxed_to,
                "measured": self.measured, "cost_ns_per_row": self.costs.per_row(),
                "mixed_layer_seconds": self.costs.mixed, "mixed_extra_group_seconds": self.costs.mixed_extra_group,
                "dense_step_seconds": self.costs.dense_step,
                "reference_step_seconds": self.costs.reference_step, "machine": self.costs.machine}


# ---- the constrained solve ---------------------------------------------------------------------------------
class SpeedConstraint:
    """``min_ratio`` (None: none, the prediction only) under ``model``: the solve and the exchange steps' test.
    ``unconstrained``: per (sink, recent, srecent) solved, the least-KL solution's predicted ratio and whether the
    constraint changed the solution. The default rule (``source`` ``"reference"``) gives way where the budget
    cannot reach it, or where keeping it would cost more than ``DEFAULT_RULE_KL`` times the least-KL solution's
    additive KL (``gave_way``): ``relaxed`` holds, per (sink, recent, srecent), the ratio it kept instead (a given
    minimum never gives way: ``SpeedUnreachable``)."""

    def __init__(self, model: SpeedModel, min_ratio: float | None, source: str = "given") -> None:
        self.model = model
        self.min_ratio = min_ratio
        self.source = source
        self.unconstrained: dict[tuple[int, int, int], tuple[float, bool]] = {}
        self.relaxed: dict[tuple[int, int, int], float] = {}
        #: where the default rule gave way for quality: (the constrained additive KL, the least-KL one's)
        self.gave_way: dict[tuple[int, int, int], tuple[float, float]] = {}

    def limit(self, policy: Policy | None = None) -> float | None:
        """The minimum in force under ``policy``'s protection (the relaxed one where the default gave way)."""
        key = protection_key(policy) if policy is not None else None
        return self.relaxed.get(key, self.min_ratio) if self.min_ratio is not None else None

    def admits(self, choice: dict, policy: Policy | None = None) -> bool:
        limit = self.limit(policy)
        return limit is None or self.model.ratio(choice) >= limit - 1e-12

    def solve(self, table: SensitivityTable, geometry, budget_bits: float, context: int, base: Policy,
              name: str | None = None) -> Allocation:
        return solve_with_speed(table, geometry, budget_bits, context, base, name, self)

    def report(self, alloc: Allocation, context: int, measured: dict | None = None) -> SpeedReport:
        r0, changed = self.unconstrained.get(protection_key(alloc.policy), (None, False))
        ref = self.model.reference_ratio()
        return SpeedReport(context, self.model.ratio(alloc.choice), self.limit(alloc.policy), self.source,
                           self.model.costs.reference, ref, r0, changed, self.model.costs, measured,
                           self.relaxed.get(protection_key(alloc.policy)))


def protection_key(policy: Policy) -> tuple[int, int, int]:
    """(sink, recent, srecent): what a protection option of the allocator sets."""
    return policy.sink, policy.recent, policy.srecent


def _penalized(table: SensitivityTable, model: SpeedModel, lam: float, kl_weight: float = 1.0) -> SensitivityTable:
    kl = {u: {c: kl_weight * q + lam * model.unit_seconds(u, c) for c, q in row.items()}
          for u, row in table.kl.items()}
    return replace(table, kl=kl)


def solve_with_speed(table: SensitivityTable, geometry, budget_bits: float, context: int, base: Policy,
                     name: str | None, constraint: SpeedConstraint) -> Allocation:
    """The least-KL allocation within the budget whose predicted speed meets ``constraint`` (module doc)."""
    model = constraint.model
    alloc = solve_allocation(table, geometry, budget_bits, context, base, name)
    r0 = model.ratio(alloc.choice)
    key = protection_key(base)
    constraint.unconstrained[key] = (r0, False)
    if constraint.admits(alloc.choice, base):
        return alloc
    # the fastest allocation within the budget (KL only breaks ties)
    seconds = [abs(model.unit_seconds(u, c)) for u, row in table.kl.items() for c in row]
    kls = [abs(q) for row in table.kl.values() for q in row.values()]
    t_scale = max(max(seconds), 1e-12)
    k_scale = max(max(kls), 1e-12)
    fast = solve_allocation(_penalized(table, model, 1.0 / t_scale, 1e-6 / k_scale), geometry, budget_bits,
                            context, base, name)
    best_ratio = model.ratio(fast.choice)
    if not constraint.admits(fast.choice, base) and constraint.source == "reference":
        constraint.relaxed[key] = best_ratio  # the default rule: as close to it as the budget allows
    if not constraint.admits(fast.choice, base):
        raise SpeedUnreachable(constraint.min_ratio, best_ratio,
                               f"the fastest allocation within {budget_bits:g} bits/element at {context} tokens is "
                               f"predicted at {best_ratio:.3f}x dense tokens/s (the least-KL one at {r0:.3f}x): "
                               f"ask for at most {best_ratio:.3f}, or raise the budget")
    found = allocation_of(fast.choice, table, geometry, budget_bits, context, base, name) or fast
    lo, hi = -6.0, 6.0  # log10 of lambda in KL per second, scaled by k_scale / t_scale
    for _ in range(PENALTY_STEPS):
        mid = (lo + hi) / 2
        lam = 10 ** mid * k_scale / t_scale
        cand = solve_allocation(_penalized(table, model, lam), geometry, budget_bits, context, base, name)
        if constraint.admits(cand.choice, base):
            hi = mid
            real = allocation_of(cand.choice, table, geometry, budget_bits, context, base, name)
            if real is not None and real.predicted_kl < found.predicted_kl:
                found = real
        else:
            lo = mid
    if constraint.source == "reference" and found.predicted_kl > DEFAULT_RULE_KL * alloc.predicted_kl:
        constraint.relaxed[key] = min(r0, constraint.relaxed.get(key, r0))  # the default gives way: no slower
        constraint.gave_way[key] = (found.predicted_kl, alloc.predicted_kl)  # than the least-KL solution
        return alloc
    constraint.unconstrained[key] = (r0, True)
    return found


# ---- measuring ---------------------------------------------------------------------------------------------


def cached_costs(engine, context: int, base: Policy, choices: dict[str, list[str]], layer: int,
                 path: Path, **kwargs) -> tuple[DecodeCosts, bool]:
    """The cost table for this machine and setup: read from ``path`` when measured before (with every choice),
    else measured and stored. Returns (costs, whether it was read)."""
    key = machine_key(engine, context, base)
    digest = _digest(key)
    doc: dict = {}
    if path.is_file():
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            doc = {}
    if doc.get("format") != COSTS_FORMAT:
        doc = {"format": COSTS_FORMAT, "tables": {}}
    entry = doc["tables"].get(digest)
    if entry:
        costs = DecodeCosts.from_dict(entry)
        if all(c in costs.layer.get(r, {}) for r, cs in choices.items() for c in cs):
            return costs, True
    costs = measure_costs(engine, context, base, choices, layer, **kwargs)
    doc["tables"][digest] = costs.to_dict() | {"machine": key}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(doc, indent=1).encode("utf-8"))
    return replace(costs, machine=key), False


def speed_constraint(engine, table: SensitivityTable, base: Policy, context: int, min_speed,
                     costs: DecodeCosts | None = None, partial_path: str | None = None) -> tuple[SpeedConstraint, bool]:
    """The constraint for ``min_speed`` (``resolve_min_speed``) with ``costs`` given (tests inject a fixed table)
    or measured on this machine / read from the cache (``cached_costs``). Returns (constraint, read from cache)."""
    ratio, source = resolve_min_speed(min_speed)
    cached = False
    if costs is None:
        choices = {role: table.choices(role) for role in ("k", "v")}
        costs, cached = cached_costs(engine, context, base, choices, table.layers[0], costs_path(partial_path))
    model = SpeedModel(costs, table.layers)
    if source == "reference":
        ratio = model.reference_ratio()
    return SpeedConstraint(model, ratio, source), cached
