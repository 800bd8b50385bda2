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
from dataclasses import dataclass, replace

import numpy as np

from tqbench.engine.allocate.sensitivity import ROLES, SensitivityTable
from tqbench.engine.cache.estimate import KVEstimate, estimate_kv, store_bytes
from tqbench.engine.cache.geometry import KVGeometry
from tqbench.engine.cache.store import FP_BYTES
from tqbench.engine.codecs.base import bits_per_element
from tqbench.engine.policy.spec import Policy

#: DP resolution: the budget is cut into at most this many byte quanta
DP_STEPS = 20000


@dataclass(frozen=True)
class Allocation:
    """The solver's answer: a policy, its codec per layer and role, predicted KL and exact bytes."""

    policy: Policy
    k: tuple[str, ...]  # codec per layer (dense_window layers: "fp16")
    v: tuple[str, ...]
    predicted_kl: float  # sum of the chosen cells' measured KL
    budget_bits: float
    estimate: KVEstimate  # estimate_kv at the stated context

    @property
    def bits_per_element(self) -> float:
        return self.estimate.bits_per_element

    def bits_grid(self) -> list[list[float]]:
        """Nominal bits per layer, ``[[K, V] per layer]`` (what the workbench's heatmap draws)."""
        from tqbench.engine.codecs import nominal_bits

        return [[nominal_bits(k), nominal_bits(v)] for k, v in zip(self.k, self.v)]

    def to_dict(self) -> dict:
        return {"kv_policy": self.policy.label, "kv_policy_string": self.policy.to_string(),
                "k_codecs": list(self.k), "v_codecs": list(self.v), "predicted_kl": self.predicted_kl,
                "budget_bits": self.budget_bits, "context_tokens": self.estimate.seq_len,
                "bits_per_element": round(self.bits_per_element, 4), "total_bytes": self.estimate.total_bytes,
                "dense_fp16_bytes": self.estimate.dense_fp16_bytes, "shared_bytes": self.estimate.shared_bytes}


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


def _shared(policy: Policy, specs: set[tuple[str, str]], head_dim: int) -> int:
    items: dict[str, int] = {}
    for role, spec in specs:
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


def solve_allocation(table: SensitivityTable, geometry: KVGeometry, budget_bits: float, context: int,
                     base: Policy, name: str | None = None) -> Allocation:
    """The codec per (layer, role) among ``table.codecs`` with the least summed KL whose exact bytes at
    ``context`` tokens stay within ``budget_bits`` per element. ``ValueError`` when even the cheapest
    choice does not fit (the message gives the lowest reachable budget)."""
    if context < 1:
        raise ValueError(f"context={context} is invalid: state the context length in tokens (>= 1)")
    if budget_bits <= 0:
        raise ValueError(f"budget {budget_bits} bits/element is invalid: give a positive number like 3.0")
    g = geometry
    plans = base.plan(g.num_layers, list(g.layer_types) if g.layer_types else None)
    dense_elems = 2 * g.kv_heads * context * g.head_dim * g.num_layers
    fixed = 0  # sliding-window layers' dense windows
    for p in plans:
        if p.dense_window:
            held = min(context, (g.sliding_window - 1) if g.sliding_window else context)
            fixed += 2 * g.kv_heads * held * g.head_dim * FP_BYTES
    budget_bytes = int(budget_bits * dense_elems / 8)
    items = [(layer, role) for layer in table.layers for role in ROLES]
    exact: list[list[int]] = []
    kls: list[list[float]] = []
    for layer, role in items:
        row_b, row_k = [], []
        for spec in table.codecs:
            codec = base.build_codec(spec, role)
            nbytes, _ = store_bytes(codec, base.sink, base.recent, context, 1, g.kv_heads, g.head_dim)
            row_b.append(nbytes)
            row_k.append(table.get(layer, role, spec))
        exact.append(row_b)
        kls.append(row_k)
    quantum = max(1, -(-budget_bytes // DP_STEPS))
    costs = [[-(-b // quantum) for b in row] for row in exact]
    reserve_specs = {(r, c) for r in ROLES for c in table.codecs}
    best: Allocation | None = None
    tried: set[frozenset] = set()
    while frozenset(reserve_specs) not in tried:
        tried.add(frozenset(reserve_specs))
        room = budget_bytes - fixed - _shared(base, reserve_specs, g.head_dim)
        picks = _solve_dp(costs, kls, room // quantum) if room >= 0 else None
        if picks is None:  # try again reserving only what the cheapest choices share
            reserve_specs = {(role, table.codecs[min(range(len(row)), key=row.__getitem__)])
                             for (_, role), row in zip(items, exact)}
            continue
        k = ["fp16"] * g.num_layers
        v = ["fp16"] * g.num_layers
        for (layer, role), j in zip(items, picks):
            (k if role == "k" else v)[layer] = table.codecs[j]
        pol = policy_from_choices(k, v, base, name)
        est = estimate_kv(pol, g, context)
        pred = sum(kls[i][j] for i, j in enumerate(picks))
        if est.bits_per_element <= budget_bits + 1e-12 and (best is None or pred < best.predicted_kl):
            best = Allocation(pol, tuple(k), tuple(v), pred, budget_bits, est)
        reserve_specs = {(role, table.codecs[j]) for (_, role), j in zip(items, picks)}
    if best is None:
        cheapest = [min(range(len(row)), key=row.__getitem__) for row in exact]
        shared = _shared(base, {(role, table.codecs[j]) for (_, role), j in zip(items, cheapest)}, g.head_dim)
        floor = bits_per_element(sum(row[j] for row, j in zip(exact, cheapest)) + fixed + shared, dense_elems)
        raise ValueError(
            f"budget {budget_bits} bits/element does not fit at {context} tokens: the cheapest choice of "
            f"{', '.join(table.codecs)} with sink={base.sink}, recent={base.recent} needs about {floor:.3f} "
            "bits/element; raise --budget, add a cheaper codec or shrink --sink/--recent"
        )
    return best
