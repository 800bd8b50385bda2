"""Pick one codec per (layer, role) that minimises the summed measured KL under an exact byte budget.

The budget is bits per element of the whole cache at a stated context (``context`` tokens, batch 1), counted
the way ``estimate_kv`` counts it: fp16 sinks, recent window and partial units, packed units with their
norms/scales, per-layer codec state (centering means), shared rotations and codebooks, and sliding-window
layers' dense windows. Every (layer, role, codec) has an exact byte cost (``store_bytes``); the choice is a
multiple-choice knapsack, solved by dynamic programming over byte costs rounded *up* to a quantum (so the
solution never exceeds the budget by rounding). Shared objects are counted once for the whole cache: the
solver reserves those of all candidate codecs first, then those the previous solution used (or the cheapest
choices' when nothing fitted), until the reserve repeats; each solution is
checked with ``estimate_kv`` itself, and one over the exact budget is never returned.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace

import numpy as np

from tqbench.engine.allocate.budget import check_budget
from tqbench.engine.allocate.chunk import build_codec
from tqbench.engine.allocate.sensitivity import SensitivityTable
from tqbench.engine.cache.estimate import KVEstimate, estimate_kv, store_bytes
from tqbench.engine.cache.geometry import KVGeometry
from tqbench.engine.cache.store import FP_BYTES
from tqbench.engine.codecs.base import bits_per_element
from tqbench.engine.codecs.calibrated import is_calibrated_spec
from tqbench.engine.policy.spec import Policy

#: DP resolution: the budget is cut into at most this many byte quanta
DP_STEPS = 20000


@dataclass(frozen=True)
class Allocation:
    """The solver's answer: a policy, its codec per layer and role, predicted KL and exact bytes."""

    policy: Policy
    k: tuple[str, ...]  # codec per layer (a head-list spec ``a|b|c`` at head granularity; dense_window: "fp16")
    v: tuple[str, ...]
    predicted_kl: float  # sum of the chosen cells' measured KL (the additive prediction)
    budget_bits: float
    estimate: KVEstimate  # estimate_kv at the stated context
    choice: dict = field(default_factory=dict, compare=False)  # unit -> codec (the table's units)

    @property
    def bits_per_element(self) -> float:
        return self.estimate.bits_per_element

    def bits_grid(self) -> list[list[float]]:
        """Nominal bits per layer, ``[[K, V] per layer]`` (a head list: the mean of its heads; what the
        workbench's heatmap draws)."""
        return [[_mean_bits(k), _mean_bits(v)] for k, v in zip(self.k, self.v)]

    def to_dict(self) -> dict:
        return {"kv_policy": self.policy.label, "kv_policy_string": self.policy.to_string(),
                "k_codecs": list(self.k), "v_codecs": list(self.v), "predicted_kl": self.predicted_kl,
                "budget_bits": self.budget_bits, "context_tokens": self.estimate.seq_len,
                "bits_per_element": round(self.bits_per_element, 4), "total_bytes": self.estimate.total_bytes,
                "dense_fp16_bytes": self.estimate.dense_fp16_bytes, "shared_bytes": self.estimate.shared_bytes,
                "sink": self.policy.sink, "recent": self.policy.recent}


def _mean_bits(spec: str) -> float:
    from tqbench.engine.codecs import nominal_bits

    parts = spec.split("|")
    return sum(nominal_bits(p) for p in parts) / len(parts)


def head_list(specs: list[str]) -> str:
    """One codec spec per KV head as a head-list spec (all equal: the one spec)."""
    return specs[0] if len(set(specs)) == 1 else "|".join(specs)


def policy_from_choices(k: list[str], v: list[str], base: Policy, name: str | None = None) -> Policy:
    """``base`` (token protection, codec options) with per-layer codecs: the most common codec of each role
    is the default, the others become ``role@layers=codec`` overrides."""
    heads, overrides = {}, []
    for role, per_layer in (("k", k), ("v", v)):
        common = Counter(per_layer).most_common(1)[0][0]
        heads[role] = common
        groups: dict[str, list[int]] = defaultdict(list)
        for layer, spec in enumerate(per_layer):
            if spec != common:
                groups[spec].append(layer)
        overrides += [(role, "+".join(map(str, layers)), spec) for spec, layers in sorted(groups.items())]
    return replace(base, k=heads["k"], v=heads["v"], protect="", overrides=tuple(overrides), name=name)


def layer_specs(choice: dict, num_layers: int, kv_heads: int) -> tuple[list[str], list[str]]:
    """Per-layer K and V specs of a unit -> codec choice (layers without units: fp16)."""
    k, v = ["fp16"] * num_layers, ["fp16"] * num_layers
    per: dict[tuple[int, str], dict[int, str]] = defaultdict(dict)
    for unit, spec in choice.items():
        if len(unit) == 2:
            (k if unit[1] == "k" else v)[unit[0]] = spec
        else:
            per[(unit[0], unit[1])][unit[2]] = spec
    for (layer, role), by_head in per.items():
        (k if role == "k" else v)[layer] = head_list([by_head[h] for h in range(kv_heads)])
    return k, v


def choice_policy(choice: dict, base: Policy, geometry: KVGeometry, name: str | None = None) -> Policy:
    k, v = layer_specs(choice, geometry.num_layers, geometry.kv_heads)
    return policy_from_choices(k, v, base, name)


def unit_bytes(table: SensitivityTable, base: Policy, g: KVGeometry, context: int) -> dict[tuple, dict[str, int]]:
    """Exact bytes of every unit's choices at ``context`` tokens (a calibrated codec's basis and tables for the
    heads the unit serves included)."""
    out: dict[tuple, dict[str, int]] = {}
    for unit in table.units():
        layer, role = unit[0], unit[1]
        heads = (unit[2],) if len(unit) == 3 else None
        n = 1 if heads else g.kv_heads
        row = {}
        for spec in table.choices(role):
            codec = build_codec(base, spec, role, layer, heads)
            nbytes, _ = store_bytes(codec, base.sink, base.recent, context, 1, n, g.head_dim)
            if is_calibrated_spec(spec):  # its basis and tables for the heads it serves
                nbytes += sum(codec.shared_items(g.head_dim).values())
            row[spec] = nbytes
        out[unit] = row
    return out


def _shared(policy: Policy, specs: set[tuple[str, str]], head_dim: int) -> int:
    """Bytes of the objects every layer shares (rotations, codebooks) for these (role, spec) choices."""
    items: dict[str, int] = {}
    for role, spec in specs:
        if is_calibrated_spec(spec):  # per-layer state: in the unit's bytes
            continue
        codec = policy.build_codec(spec, role)
        if not codec.lossless:
            items.update(codec.shared_items(head_dim))
    return sum(items.values())


def _solve_dp(costs: list[list[int]], kls: list[list[float]], budget: int) -> list[int] | None:
    """Min sum of ``kls[i][choice]`` with sum of ``costs[i][choice]`` <= ``budget`` (costs in quanta)."""
    inf = float("inf")
    dp = np.full(budget + 1, inf)
    dp[0] = 0.0
    picks = []
    for cost, kl in zip(costs, kls):
        new = np.full(budget + 1, inf)
        pick = np.full(budget + 1, -1, dtype=np.int16)
        for j, (c, q) in enumerate(zip(cost, kl)):
            if c > budget:
                continue
            cand = np.full(budget + 1, inf)
            cand[c:] = dp[: budget + 1 - c] + q
            better = cand < new
            new[better] = cand[better]
            pick[better] = j
        dp = new
        picks.append(pick)
    if not np.isfinite(dp).any():
        return None
    b = int(np.argmin(dp))
    out = []
    for i in range(len(costs) - 1, -1, -1):
        j = int(picks[i][b])
        out.append(j)
        b -= costs[i][j]
    return out[::-1]


def budget_bytes(g: KVGeometry, budget_bits: float, context: int) -> int:
    return int(budget_bits * 2 * g.kv_heads * context * g.head_dim * g.num_layers / 8)


def solve_allocation(table: SensitivityTable, geometry: KVGeometry, budget_bits: float, context: int,
                     base: Policy, name: str | None = None) -> Allocation:
    """The codec per unit (layer and role, or layer, role and KV head) among the table's choices with the least
    summed KL whose exact bytes at ``context`` tokens stay within ``budget_bits`` per element (checked with
    ``estimate_kv``; never over). ``ValueError`` when even the cheapest choice does not fit (the message gives the
    lowest reachable budget)."""
    if context < 1:
        raise ValueError(f"context={context} is invalid: state the context length in tokens (>= 1)")
    check_budget(budget_bits)
    g = geometry
    plans = base.plan(g.num_layers, list(g.layer_types) if g.layer_types else None)
    dense_elems = 2 * g.kv_heads * context * g.head_dim * g.num_layers
    fixed = 0  # sliding-window layers' dense windows
    for p in plans:
        if p.dense_window:
            held = min(context, (g.sliding_window - 1) if g.sliding_window else context)
            fixed += 2 * g.kv_heads * held * g.head_dim * FP_BYTES
    total_budget = budget_bytes(g, budget_bits, context)
    items = table.units()
    ub = unit_bytes(table, base, g, context)
    specs = [table.choices(u[1]) for u in items]
    exact = [[ub[u][c] for c in cs] for u, cs in zip(items, specs)]
    kls = [[table.kl[u][c] for c in cs] for u, cs in zip(items, specs)]
    quantum = max(1, -(-total_budget // DP_STEPS))
    costs = [[-(-b // quantum) for b in row] for row in exact]
    reserve_specs = {(u[1], c) for u, cs in zip(items, specs) for c in cs}
    best: Allocation | None = None
    tried: set[frozenset] = set()
    slack = 0  # bytes taken off the room when estimate_kv counted more than the units' sum (shared per-layer state)
    while frozenset(reserve_specs) not in tried:
        tried.add(frozenset(reserve_specs))
        for _ in range(6):
            room = total_budget - fixed - _shared(base, reserve_specs, g.head_dim) - slack
            picks = _solve_dp(costs, kls, room // quantum) if room >= 0 else None
            if picks is None:
                break
            choice = {u: cs[j] for u, cs, j in zip(items, specs, picks)}
            pol = choice_policy(choice, base, g, name)
            est = estimate_kv(pol, g, context)
            if est.total_bytes <= total_budget:
                break
            slack += est.total_bytes - total_budget + quantum
            picks = None
        if picks is None:  # try again reserving only what the cheapest choices share
            reserve_specs = {(u[1], cs[min(range(len(row)), key=row.__getitem__)])
                             for u, cs, row in zip(items, specs, exact)}
            continue
        pred = sum(kls[i][j] for i, j in enumerate(picks))
        if est.bits_per_element <= budget_bits + 1e-12 and (best is None or pred < best.predicted_kl):
            k, v = layer_specs(choice, g.num_layers, g.kv_heads)
            best = Allocation(pol, tuple(k), tuple(v), pred, budget_bits, est, choice)
        reserve_specs = {(u[1], cs[j]) for u, cs, j in zip(items, specs, picks)}
    if best is None:
        cheapest = [min(range(len(row)), key=row.__getitem__) for row in exact]
        shared = _shared(base, {(u[1], cs[j]) for u, cs, j in zip(items, specs, cheapest)}, g.head_dim)
        floor = bits_per_element(sum(row[j] for row, j in zip(exact, cheapest)) + fixed + shared, dense_elems)
        raise ValueError(
            f"budget {budget_bits} bits/element does not fit at {context} tokens: the cheapest choice of "
            f"{', '.join(table.codecs)} with sink={base.sink}, recent={base.recent} needs about {floor:.3f} "
            "bits/element; raise the budget, add a cheaper codec or shrink the sink and recent window"
        )
    return best


def allocation_of(choice: dict, table: SensitivityTable, geometry: KVGeometry, budget_bits: float, context: int,
                  base: Policy, name: str | None = None) -> Allocation | None:
    """The ``Allocation`` of a given choice (its additive prediction from ``table``); None when its exact bytes
    (``estimate_kv``) are over the budget."""
    pol = choice_policy(choice, base, geometry, name)
    est = estimate_kv(pol, geometry, context)
    if est.total_bytes > budget_bytes(geometry, budget_bits, context) or est.bits_per_element > budget_bits + 1e-12:
        return None
    k, v = layer_specs(choice, geometry.num_layers, geometry.kv_heads)
    pred = sum(table.kl[u][c] for u, c in choice.items())
    return Allocation(pol, tuple(k), tuple(v), pred, budget_bits, est, dict(choice))
