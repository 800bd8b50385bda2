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
from tqbench.engine.allocate.sensitivity import SensitivityTable, allocatable_layers
from tqbench.engine.cache.estimate import KVEstimate, estimate_kv, store_bytes
from tqbench.engine.cache.geometry import FP_BYTES, KVGeometry
from tqbench.engine.cache.store import window_start
from tqbench.engine.codecs.calibrated import is_calibrated_spec
from tqbench.engine.policy.keep import held_rows
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
    keeps = tuple(o for o in base.overrides if o[0] in ("keep", "demote"))  # the tokens axis's choices stay
    return replace(base, k=heads["k"], v=heads["v"], protect="", overrides=keeps + tuple(overrides), name=name)


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
    return {u: {c: b for c, (b, _) in row.items()} for u, row in _unit_stores(table, base, g, context).items()}


def _unit_stores(table: SensitivityTable, base: Policy, g: KVGeometry, context: int) -> dict:
    """``unit_bytes`` with the packed token count: unit -> spec -> (bytes, packed tokens)."""
    plans = base.plan(g.num_layers, list(g.layer_types) if g.layer_types else None)
    out: dict[tuple, dict[str, int]] = {}
    for unit in table.units():
        layer, role = unit[0], unit[1]
        heads = (unit[2],) if len(unit) == 3 else None
        n = 1 if heads else g.kv_heads
        plan = plans[layer]
        dim = g.head_dim if role == "k" else g.v_dim  # (MLA caches: K and V rows of different widths)
        row = {}
        for spec in table.choices(role):
            codec = build_codec(base, spec, role, layer, heads)
            if plan.sliding and g.sliding_window:  # a window-bounded store (aligned to this codec's units alone:
                # the layer's K/V alignment, and so its bytes, can differ by a unit; estimate_kv checks the sum)
                held = context - window_start(context, g.sliding_window - 1, codec.tokens_per_unit)
                nbytes, packed = store_bytes(codec, plan.sink, plan.recent, held, 1, n, dim)
            else:  # a layer that evicts (policy.keep) holds the rows its keep leaves at the stated context
                held = held_rows(context, context, plan.keep, plan.sink, base.window, plan.recent, base.every)
                nbytes, packed = store_bytes(codec, plan.sink, plan.recent, held if plan.evicts else context, 1, n,
                                             dim)
            if is_calibrated_spec(spec):  # its basis and tables for the heads it serves
                nbytes += sum(codec.shared_items(dim).values())
            row[spec] = (nbytes, packed)
        out[unit] = row
    return out


def _shared(policy: Policy, specs: set[tuple[str, str]], g: KVGeometry) -> int:
    """Bytes of the objects every layer shares (rotations, codebooks) for these (role, spec) choices."""
    items: dict[str, int] = {}
    for role, spec in specs:
        if is_calibrated_spec(spec):  # per-layer state: in the unit's bytes
            continue
        codec = policy.build_codec(spec, role)
        if not codec.lossless:
            items.update(codec.shared_items(g.head_dim if role == "k" else g.v_dim))
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


def dense_elements(g: KVGeometry, context: int, base: Policy | None = None) -> int:
    """The K/V elements an fp16 cache holds at ``context`` tokens under ``base``'s layer plan (``estimate_kv``'s
    basis: a sliding-window layer holds its window, ``window - 1`` rows, whether bypassed or compressed)."""
    pol = replace(base or Policy(), k="fp16", v="fp16", protect="", overrides=())  # the basis needs no codec
    return estimate_kv(pol, g, context).dense_fp16_bytes // FP_BYTES


def budget_bytes(g: KVGeometry, budget_bits: float, context: int, base: Policy | None = None) -> int:
    """The most bytes a cache may hold at ``context`` tokens for ``budget_bits`` per element (exactly
    ``estimate_kv``'s bits per element: over the elements an fp16 cache would hold, ``dense_elements``)."""
    return int(budget_bits * dense_elements(g, context, base) / 8)


def fixed_bytes(table: SensitivityTable, base: Policy, g: KVGeometry, context: int) -> int:
    """Bytes of the layers the table offers no choice for (sliding-window layers ``base`` bypasses or keeps
    dense): what they hold in every allocation (fp16, as ``layer_specs`` leaves them)."""
    est = estimate_kv(choice_policy({}, base, g), g, context)
    offered = set(table.layers)
    return sum(b for layer, b in enumerate(est.layer_bytes) if layer not in offered)


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
    dense = sorted(set(table.layers) - set(allocatable_layers(base, g)))
    if dense:
        raise ValueError(f"the sensitivity table offers choices for layers {dense}, which {base.to_string()!r} keeps "
                         "dense (sliding-window layers bypassed or dense): measure the table under the same base")
    fixed = fixed_bytes(table, base, g, context)  # sliding-window layers' windows the table offers no choice for
    total_budget = budget_bytes(g, budget_bits, context, base)
    items = table.units()
    stores = _unit_stores(table, base, g, context)
    ub = {u: {c: b for c, (b, _) in row.items()} for u, row in stores.items()}
    # a codec's shared objects count only where it packs rows (a window the recent rows cover packs none)
    packing = {(u[1], c) for u, row in stores.items() for c, (_, packed) in row.items() if packed}
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
            room = total_budget - fixed - _shared(base, reserve_specs & packing, g) - slack
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
        cheapest = {u: cs[min(range(len(row)), key=row.__getitem__)] for u, cs, row in zip(items, specs, exact)}
        floor = estimate_kv(choice_policy(cheapest, base, g), g, context).bits_per_element
        raise ValueError(
            f"budget {budget_bits} bits/element does not fit at {context} tokens: the cheapest choice of "
            f"{', '.join(table.codecs)} with sink={base.sink}, recent={base.recent} needs about {floor:.3f} "
            f"bits/element{_sliding_hint(base, g, table.layers, context)}; raise the budget, add a cheaper codec or "
            "shrink the sink / recent window"
        )
    return best


def _sliding_hint(base: Policy, g: KVGeometry, layers: list[int], context: int) -> str:
    """Why a model with sliding-window layers may not reach a budget (empty when it has none): the layers kept
    dense without a choice (bypassed windows) and their share of the fp16 basis; compressed windows' rows."""
    plans = base.plan(g.num_layers, list(g.layer_types) if g.layer_types else None)
    if not g.sliding_window:
        return ""
    held = g.sliding_window - 1
    parts = []
    fixed = [p.layer for p in plans if p.layer not in layers]
    if fixed:
        est = estimate_kv(choice_policy({}, base, g), g, context)
        share = sum(est.layer_bytes[i] for i in fixed) / est.dense_fp16_bytes
        parts.append(f"{len(fixed)} layers keep fp16 without a choice (sliding-window layers bypassed or dense: "
                     f"{share:.0%} of the fp16 cache, at 16 bits; a base policy with sliding=compress offers them codecs)")
    sliding = [layer for layer in layers if plans[layer].sliding]
    if sliding:
        covered = f", all of which recent={base.recent} keeps fp16" if base.recent >= held else ""
        parts.append(f"{len(sliding)} of its layers are sliding windows holding {held} rows{covered}; bits/element "
                     "count against those rows, shared rotations and codebooks included")
    return f" ({'; '.join(parts)})" if parts else ""


def allocation_of(choice: dict, table: SensitivityTable, geometry: KVGeometry, budget_bits: float, context: int,
                  base: Policy, name: str | None = None) -> Allocation | None:
    """The ``Allocation`` of a given choice (its additive prediction from ``table``); None when its exact bytes
    (``estimate_kv``) are over the budget."""
    pol = choice_policy(choice, base, geometry, name)
    est = estimate_kv(pol, geometry, context)
    if est.total_bytes > budget_bytes(geometry, budget_bits, context, base) or est.bits_per_element > budget_bits + 1e-12:
        return None
    k, v = layer_specs(choice, geometry.num_layers, geometry.kv_heads)
    pred = sum(table.kl[u][c] for u, c in choice.items())
    return Allocation(pol, tuple(k), tuple(v), pred, budget_bits, est, dict(choice))
