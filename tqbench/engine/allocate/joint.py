"""One byte budget over tokens and bits: a keep fraction per layer beside the codec of every unit.

``solve_joint`` picks, per layer, a keep fraction (``keeps.KEEP_CHOICES`` or the ones given) and a codec for each
of the layer's units (layer or KV head, K and V) with the least summed KL (the keep cell's measured KL plus the
codec cells') whose exact bytes at the stated context (``estimate_kv``: a kept fraction scales the rows beyond
the sinks and the protected tail) stay within the budget. A layer's byte cost depends on its keep, so each
layer's options are the Pareto front (fewest bytes for each KL) over its keeps x its units' codecs, and a
multiple-choice knapsack over the layers picks one option each (``solver._solve_dp``, costs rounded up).

``axis_split`` says where the bytes went: per layer, the fp16 bytes, what the chosen codecs saved at full keep
and what eviction saved on top (net of the demote tier, whose bytes it gives as ``demoted_bytes``).
"""

from __future__ import annotations

from dataclasses import replace

from tqbench.engine.allocate.budget import check_budget
from tqbench.engine.allocate.keeps import with_keeps
from tqbench.engine.allocate.sensitivity import SensitivityTable
from tqbench.engine.allocate.solver import (
    DP_STEPS,
    Allocation,
    _shared,
    _solve_dp,
    _unit_stores,
    budget_bytes,
    choice_policy,
    fixed_bytes,
    layer_specs,
)
from tqbench.engine.cache.estimate import estimate_kv
from tqbench.engine.cache.evict.bookkeeping import bookkeeping_bytes
from tqbench.engine.cache.geometry import KVGeometry
from tqbench.engine.policy.keep import held_rows
from tqbench.engine.policy.spec import Policy

_MAX_FRONT = 4000  # options kept per layer (the cheapest ones of a longer Pareto front are kept)


def _front(points: list[tuple[int, float, tuple]]) -> list[tuple[int, float, tuple]]:
    """The Pareto front of (cost, kl, config): cheapest first, each with less KL than every cheaper one."""
    out = []
    for p in sorted(points, key=lambda t: (t[0], t[1])):
        if not out or p[1] < out[-1][1]:
            out.append(p)
    return out[:_MAX_FRONT]


def solve_joint(table: SensitivityTable, keep_kl: dict[tuple[int, float], float], keeps: tuple[float, ...],
                geometry: KVGeometry, budget_bits: float, context: int, base: Policy,
                name: str | None = None, tiers=None, tier_specs: set = frozenset()) -> Allocation:
    """The least-KL choice of a keep per layer (``keep_kl[(layer, f)]``: its measured KL, 0 at 1.0) and a codec
    per unit within ``budget_bits`` per element at ``context`` tokens (exact, never over); the keeps are in the
    policy (``keep@layers=f``), ``choice`` holds the codec units. ``tiers``: the demote tier's options per
    (layer, keep) (``demote.tier_options``; its shared objects ``tier_specs``), the choice in the policy
    (``demote@layers=codec``). ``ValueError`` when nothing fits (the message gives the floor)."""
    from tqbench.engine.allocate.demote import split_choice, with_demotes

    check_budget(budget_bits)
    g = geometry
    total_budget = budget_bytes(g, budget_bits, context, base)
    fixed = fixed_bytes(table, base, g, context)
    quantum = max(1, -(-total_budget // DP_STEPS))
    units = table.units()
    by_layer = {layer: [u for u in units if u[0] == layer] for layer in table.layers}
    packing: set = set(tier_specs)
    fronts: dict[int, list] = {layer: [] for layer in table.layers}
    for f in keeps:
        stores = _unit_stores(table, with_keeps(base, dict.fromkeys(table.layers, f)), g, context)
        packing |= {(u[1], c) for u, row in stores.items() for c, (_, packed) in row.items() if packed}
        for layer, lunits in by_layer.items():
            pts = tiers(layer, f, quantum, base) if tiers else [(0, keep_kl.get((layer, f), 0.0), ())]
            book = -(-_bookkeeping(base, g, context, f) // quantum)  # the held rows' positions: the layer's bytes
            pts = [(c + book, k, cfg) for c, k, cfg in pts]
            for u in lunits:
                pts = _front([(c + -(-stores[u][spec][0] // quantum), k + table.kl[u][spec], cfg + ((u, spec),))
                              for c, k, cfg in pts for spec in table.choices(u[1])])
            fronts[layer] += [(c, k, (f, cfg)) for c, k, cfg in pts]
    fronts = {layer: _front(pts) for layer, pts in fronts.items()}
    layers = list(table.layers)
    costs = [[p[0] for p in fronts[layer]] for layer in layers]
    kls = [[p[1] for p in fronts[layer]] for layer in layers]
    room = total_budget - fixed - _shared(base, packing, g)
    slack = 0
    for _ in range(6):
        picks = _solve_dp(costs, kls, (room - slack) // quantum) if room - slack >= 0 else None
        if picks is None:
            break
        choice, keep_of = {}, {}
        for layer, j in zip(layers, picks):
            f, cfg = fronts[layer][j][2]
            keep_of[layer] = f
            choice.update(dict(cfg))
        choice, demote_of = split_choice(choice)
        pol = choice_policy(choice, with_demotes(with_keeps(base, keep_of), demote_of), g, name)
        est = estimate_kv(pol, g, context)
        if est.total_bytes <= total_budget and est.bits_per_element <= budget_bits + 1e-12:
            k, v = layer_specs(choice, g.num_layers, g.kv_heads)
            pred = sum(kls[i][j] for i, j in enumerate(picks))
            return Allocation(pol, tuple(k), tuple(v), pred, budget_bits, est, choice)
        slack += est.total_bytes - total_budget + quantum
    cheapest = {u: min(table.choices(u[1]), key=lambda c: _unit_stores(table, base, g, context)[u][c][0])
                for u in units}
    floor = estimate_kv(choice_policy(cheapest, with_keeps(base, dict.fromkeys(table.layers, min(keeps))), g), g,
                        context).bits_per_element
    raise ValueError(f"budget {budget_bits} bits/element does not fit at {context} tokens: the cheapest choice of "
                     f"{', '.join(table.codecs)} at keep={min(keeps):g} with sink={base.sink}, recent={base.recent} "
                     f"needs about {floor:.3f} bits/element; raise the budget, offer a smaller keep or a cheaper codec")


def _bookkeeping(base: Policy, g: KVGeometry, context: int, keep) -> int:
    """Bytes an evicting layer keeps beside its rows at ``keep`` (each held row's position, h2o's mass:
    ``evict.bookkeeping``, as ``estimate_kv`` counts them); 0 at keep 1."""
    if keep >= 1:
        return 0
    held = held_rows(context, context, keep, base.sink, base.window, base.recent, base.every)
    return bookkeeping_bytes(base.score, 1, g.kv_heads, held)


def axis_split(policy: Policy, geometry: KVGeometry, context: int) -> dict:
    """Where ``policy``'s bytes went at ``context`` tokens: per layer its keep, the fp16 bytes, the bytes the codecs
    saved at full keep, the bytes eviction saved on top, and its demote codec and the tier's bytes (part of
    ``bytes``; eviction's saving is net of them) (exact, ``estimate_kv``; shared objects apart)."""
    g = geometry
    plans = policy.plan(g.num_layers, list(g.layer_types) if g.layer_types else None)
    kept = replace(policy, keep=1.0, demote="", overrides=tuple(o for o in policy.overrides
                                                              if o[0] not in ("keep", "demote")))
    full = estimate_kv(kept, g, context)
    dropped = estimate_kv(replace(policy, demote="", overrides=tuple(o for o in policy.overrides if o[0] != "demote")),
                          g, context)
    fp16 = estimate_kv(replace(policy, k="fp16", v="fp16", keep=1.0, demote="", protect="", overrides=()), g, context)
    now = estimate_kv(policy, g, context)
    rows = [{"layer": i, "keep": plans[i].keep if plans[i].evicts else 1.0, "fp16_bytes": fp16.layer_bytes[i],
             "saved_by_codecs": fp16.layer_bytes[i] - full.layer_bytes[i],
             "saved_by_eviction": full.layer_bytes[i] - now.layer_bytes[i], "bytes": now.layer_bytes[i],
             "demote": plans[i].demote or None, "demoted_bytes": now.layer_bytes[i] - dropped.layer_bytes[i]}
            for i in range(g.num_layers)]
    return {"per_layer": rows, "saved_by_codecs": sum(r["saved_by_codecs"] for r in rows),
            "saved_by_eviction": sum(r["saved_by_eviction"] for r in rows),
            "demoted_bytes": sum(r["demoted_bytes"] for r in rows), "total_bytes": now.total_bytes,
            "shared_bytes": now.shared_bytes}
