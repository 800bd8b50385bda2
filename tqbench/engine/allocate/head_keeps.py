"""One byte budget over tokens, bits and heads: a keep fraction and K/V codecs per (layer, KV head).

``solve_joint_heads`` is ``joint.solve_joint`` with the keep chosen per KV head: the table is measured per KV head
(units ``(layer, role, head)``), ``head_keep_kl[(layer, head, f)]`` is the measured KL of that head alone evicting to
``f`` (``keeps.KeepCells.head_cell``), and each head picks a keep and its K and V codecs. A layer's options are the
Pareto front (fewest bytes for each summed KL) of two kinds:

- *uniform*: every head keeps the same ``f`` (written ``keep@L=f``, as ``solve_joint`` writes it; any codec);
- *ragged*: the heads' keeps chosen independently (written ``keep@L=f0|f1|f2``, one value per KV head, ``|`` as in
  codec head lists; a head keeping everything is ``1``: a list's entries are fractions). A ragged layer
  is one store per KV head (as ``heads=ada``'s ``RaggedStore``): head ``h`` holds ``held_rows`` at its own keep, its
  own one-head store of its codec (sinks and the recent window fp16, the rest packed, its codec state), and the
  position of every row it holds (``bookkeeping_bytes``). So only codecs that pack each row on their own and are
  not calibrated per layer are offered there (``evict.ragged.check_ragged_codec``'s rule), and every head must
  pack rows (else the shared rotations and codebooks would not be the layer's at full keep).

The multiple-choice knapsack over layers picks one option each (costs rounded up, ``solver._solve_dp``); the
result is checked with ``head_keep_estimate`` and re-solved with less room until within the budget, never over.

``head_keep_estimate`` is the exact byte count of such a policy: ``estimate_kv`` of the policy without the ragged
layers' keeps (those layers at full keep), with each ragged layer's bytes replaced by the sum of its heads' one-head
stores. It stands in for ``estimate_kv`` until the policy language parses ``keep@L=f0|f1|f2``; then
``estimate_kv(parse_policy(text))`` must equal it to the byte (the end-to-end test after merging).

``head_axis_split`` says where the bytes went, per (layer, KV head).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tqbench.engine.allocate.budget import check_budget
from tqbench.engine.allocate.chunk import build_codec
from tqbench.engine.allocate.joint import _front, with_keeps
from tqbench.engine.allocate.sensitivity import ROLES, SensitivityTable
from tqbench.engine.allocate.solver import (
    DP_STEPS,
    _shared,
    _solve_dp,
    _unit_stores,
    budget_bytes,
    choice_policy,
    fixed_bytes,
    layer_specs,
)
from tqbench.engine.cache.estimate import estimate_kv, store_parts
from tqbench.engine.cache.evict.bookkeeping import bookkeeping_bytes
from tqbench.engine.cache.geometry import KVGeometry
from tqbench.engine.cache.report import bits_vs_fp16
from tqbench.engine.codecs import is_calibrated_spec
from tqbench.engine.codecs.heads import is_head_list, split_head_list
from tqbench.engine.policy.keep import evicts, fmt_keep, held_rows
from tqbench.engine.policy.spec import Policy


def head_keep_text(plain: Policy, ragged: dict[int, tuple[float, ...]]) -> str:
    """``plain``'s policy string with ``keep@L=f0|f1|...`` for every ragged layer (layers with the same per-head
    keeps grouped ``keep@3+7=...``), placed after ``plain``'s own keep overrides and before its codec overrides."""
    groups: dict[tuple, list[int]] = {}
    for layer, fs in sorted(ragged.items()):
        groups.setdefault(tuple(fs), []).append(layer)
    new = [("keep", "+".join(map(str, layers)), fmt_keep(tuple(map(float, fs))))
           for fs, layers in sorted(groups.items(), key=lambda t: t[1])]
    ovs = [o for o in plain.overrides if o[0] == "keep"] + new + [o for o in plain.overrides if o[0] != "keep"]
    head = replace(plain, overrides=()).to_string()
    return ",".join([head] + [f"{r}@{s}={c}" for r, s, c in ovs])


def _head_specs(spec: str, heads: int) -> list[str]:
    return split_head_list(spec) if is_head_list(spec) else [spec] * heads


def per_row_codec(base: Policy, spec: str, role: str) -> bool:
    """Whether a ragged (per-head keep) layer can hold ``spec``: a codec that packs each row on its own and is not
    calibrated per layer (``evict.ragged.check_ragged_codec``'s rule)."""
    if is_calibrated_spec(spec):
        return False
    return base.build_codec(spec, role).tokens_per_unit == 1


def head_bytes(policy: Policy, layer: int, keeps, geometry: KVGeometry, context: int, positions: bool) -> list[int]:
    """Bytes of each KV head of ``layer`` at ``context`` tokens (batch 1) as a one-head store of that head's
    codecs holding ``held_rows`` at its keep (``keeps[h]``), and with ``positions`` its rows' positions."""
    g = geometry
    plan = policy.plan(g.num_layers, list(g.layer_types) if g.layer_types else None)[layer]
    if plan.sliding or plan.dense_window:
        raise ValueError(f"layer {layer} is a sliding-window layer: per-head keeps evict full-attention layers only")
    specs = {"k": _head_specs(plan.k, g.kv_heads), "v": _head_specs(plan.v, g.kv_heads)}
    out = []
    for h, f in enumerate(keeps):
        held = held_rows(context, context, f, plan.sink, policy.window, plan.recent, policy.every)
        total = bookkeeping_bytes(policy.score, 1, 1, held) if positions else 0
        for role, dim in (("k", g.head_dim), ("v", g.v_dim)):
            total += store_parts(build_codec(policy, specs[role][h], role, layer, (h,)), plan.sink, plan.recent,
                                 held, 1, 1, dim).total
        out.append(total)
    return out


def ragged_layer_bytes(plain: Policy, layer: int, keeps: tuple[float, ...], geometry: KVGeometry,
                       context: int) -> list[int]:
    """Bytes of each KV head of a ragged ``layer`` (``head_bytes`` with positions), its codecs checked: each
    packs rows on its own, is not calibrated per layer, and packs some of the head's rows."""
    g = geometry
    plan = plain.plan(g.num_layers, list(g.layer_types) if g.layer_types else None)[layer]
    for role, spec, dim in (("k", plan.k, g.head_dim), ("v", plan.v, g.v_dim)):
        for h, (one, f) in enumerate(zip(_head_specs(spec, g.kv_heads), keeps)):
            codec = build_codec(plain, one, role, layer, (h,))
            if codec.lossless:
                continue
            if is_calibrated_spec(one) or codec.tokens_per_unit != 1:
                raise ValueError(f"layer {layer} head {h} ({role}) uses {one}: a per-head keep needs a codec that "
                                 "packs each row on its own and is not calibrated per layer")
            held = held_rows(context, context, f, plan.sink, plain.window, plan.recent, plain.every)
            if not store_parts(codec, plan.sink, plan.recent, held, 1, 1, dim).packed_tokens:
                raise ValueError(f"layer {layer} head {h} keeps {held} rows at {context} tokens, none packed: its "
                                 "codec's shared objects would not be counted as at full keep; offer larger keeps")
    return head_bytes(plain, layer, keeps, g, context, positions=True)


@dataclass(frozen=True)
class HeadKeepEstimate:
    """Exact bytes of a policy with per-head keeps at ``seq_len`` tokens (batch 1)."""

    seq_len: int
    total_bytes: int
    dense_fp16_bytes: int
    shared_bytes: int
    layer_bytes: list[int]
    head_bytes: dict[int, list[int]]  # ragged layers: the bytes of each KV head

    @property
    def bits_per_element(self) -> float:
        return bits_vs_fp16(self.total_bytes, self.dense_fp16_bytes)


def head_keep_estimate(plain: Policy, ragged: dict[int, tuple[float, ...]], geometry: KVGeometry,
                       context: int) -> HeadKeepEstimate:
    """``estimate_kv`` of ``plain`` (the ragged layers at full keep) with each ragged layer's bytes replaced by
    ``ragged_layer_bytes``. The shared objects are ``plain``'s: every head of a ragged layer packs rows (checked),
    so its codecs' rotations and codebooks are counted exactly as at full keep."""
    if ragged and (plain.heads == "ada" or plain.demote):
        raise ValueError("per-head keeps are counted without heads=ada or a demote tier")
    est = estimate_kv(plain, geometry, context)
    layers = list(est.layer_bytes)
    heads = {}
    for layer, fs in ragged.items():
        if len(fs) != geometry.kv_heads:
            raise ValueError(f"layer {layer}: {len(fs)} keep values for {geometry.kv_heads} KV heads")
        heads[layer] = ragged_layer_bytes(plain, layer, tuple(fs), geometry, context)
        layers[layer] = sum(heads[layer])
    return HeadKeepEstimate(context, sum(layers) + est.shared_bytes, est.dense_fp16_bytes, est.shared_bytes, layers,
                            heads)


@dataclass(frozen=True)
class HeadKeepAllocation:
    """``solve_joint_heads``'s answer: the policy text (``keep@L=f0|f1|f2`` where heads differ), the policy
    without the ragged keeps (``plain``), every table layer's per-head keeps, the codec per unit, the additive
    KL and the exact bytes (``head_keep_estimate``)."""

    text: str
    plain: Policy
    head_keeps: dict[int, tuple[float, ...]]
    k: tuple[str, ...]
    v: tuple[str, ...]
    predicted_kl: float
    budget_bits: float
    estimate: HeadKeepEstimate
    choice: dict = field(default_factory=dict, compare=False)

    @property
    def ragged(self) -> dict[int, tuple[float, ...]]:
        return {layer: fs for layer, fs in self.head_keeps.items() if len(set(fs)) > 1}

    @property
    def bits_per_element(self) -> float:
        return self.estimate.bits_per_element

    def to_dict(self) -> dict:
        return {"kv_policy_string": self.text, "k_codecs": list(self.k), "v_codecs": list(self.v),
                "head_keeps": {str(layer): list(fs) for layer, fs in sorted(self.head_keeps.items())},
                "predicted_kl": self.predicted_kl, "budget_bits": self.budget_bits,
                "context_tokens": self.estimate.seq_len, "bits_per_element": round(self.bits_per_element, 4),
                "total_bytes": self.estimate.total_bytes, "dense_fp16_bytes": self.estimate.dense_fp16_bytes,
                "shared_bytes": self.estimate.shared_bytes, "sink": self.plain.sink, "recent": self.plain.recent}


def _head_options(table, stores, bk, layer: int, h: int, fs, kl_of, quantum: int, ragged: bool, per_row,
                  lossless) -> list:
    """Pareto front of one KV head's (keep, K codec, V codec) options: (cost in quanta, KL, ((h, f, k, v),))."""
    pts = []
    for f in fs:
        sk, sv = stores[f][(layer, "k", h)], stores[f][(layer, "v", h)]
        for ks in table.choices("k"):
            if ragged and not per_row[("k", ks)]:
                continue
            for vs in table.choices("v"):
                if ragged and not per_row[("v", vs)]:
                    continue
                if ragged and ((not sk[ks][1] and not lossless[("k", ks)])
                               or (not sv[vs][1] and not lossless[("v", vs)])):
                    continue  # a head that packs nothing (see ragged_layer_bytes)
                nbytes = sk[ks][0] + sv[vs][0] + (bk[f] if ragged or evicts(f) else 0)
                kl = table.kl[(layer, "k", h)][ks] + table.kl[(layer, "v", h)][vs] + kl_of(layer, h, f)
                pts.append((-(-nbytes // quantum), kl, ((h, f, ks, vs),)))
    return _front(pts)


def _combine(per_head: list[list]) -> list:
    pts = [(0, 0.0, ())]
    for opts in per_head:
        pts = _front([(c + c2, k + k2, cfg + cfg2) for c, k, cfg in pts for c2, k2, cfg2 in opts])
    return pts


def solve_joint_heads(table: SensitivityTable, head_keep_kl: dict[tuple[int, int, float], float],
                      keeps: tuple[float, ...], geometry: KVGeometry, budget_bits: float, context: int, base: Policy,
                      name: str | None = None) -> HeadKeepAllocation:
    """The least-KL choice of a keep and K/V codecs per (layer, KV head) (``head_keep_kl[(layer, head, f)]``: that
    head alone evicting to ``f``; 0 at 1.0) within ``budget_bits`` per element at ``context`` tokens (exact,
    ``head_keep_estimate``; never over). ``table`` must be measured per KV head. ``ValueError`` when nothing fits
    (the message gives the floor)."""
    check_budget(budget_bits)
    if table.heads is None:
        raise ValueError("per-head keeps need a sensitivity table measured per KV head (granularity head)")
    if base.heads == "ada" or base.demote:
        raise ValueError("per-head keeps are searched without heads=ada or a demote tier in the base")
    g = geometry
    keeps = tuple(sorted(set(keeps) | {1.0}, reverse=True))
    total_budget = budget_bytes(g, budget_bits, context, base)
    fixed = fixed_bytes(table, base, g, context)
    quantum = max(1, -(-total_budget // DP_STEPS))
    per_row = {(role, s): per_row_codec(base, s, role) for role in ROLES for s in table.choices(role)}
    lossless = {(role, s): not is_calibrated_spec(s) and base.build_codec(s, role).lossless for role in ROLES
                for s in table.choices(role)}  # (a calibrated codec is built per layer, and is never lossless)
    stores = {f: _unit_stores(table, with_keeps(base, dict.fromkeys(table.layers, f)), g, context) for f in keeps}
    bk = {f: bookkeeping_bytes(base.score, 1, 1, held_rows(context, context, f, base.sink, base.window, base.recent,
                                                           base.every)) for f in keeps}
    packing = {(u[1], c) for s in stores.values() for u, row in s.items() for c, (_, packed) in row.items() if packed}

    def kl_of(layer, h, f):
        return head_keep_kl[(layer, h, f)] if evicts(f) else 0.0

    fronts = {}
    for layer in table.layers:
        pts = []
        for f in keeps:  # uniform: every head at f
            pts += _combine([_head_options(table, stores, bk, layer, h, (f,), kl_of, quantum, False, per_row,
                                             lossless)
                             for h in table.heads])
        pts += _combine([_head_options(table, stores, bk, layer, h, keeps, kl_of, quantum, True, per_row, lossless)
                         for h in table.heads])  # ragged
        fronts[layer] = _front(pts)
    layers = list(table.layers)
    costs = [[p[0] for p in fronts[layer]] for layer in layers]
    kls = [[p[1] for p in fronts[layer]] for layer in layers]
    room = total_budget - fixed - _shared(base, packing, g)
    slack = 0
    for _ in range(6):
        picks = _solve_dp(costs, kls, (room - slack) // quantum) if room - slack >= 0 else None
        if picks is None:
            break
        choice, head_keeps = {}, {}
        for layer, j in zip(layers, picks):
            cfg = sorted(fronts[layer][j][2])
            head_keeps[layer] = tuple(f for _, f, _, _ in cfg)
            for h, _, ks, vs in cfg:
                choice[(layer, "k", h)], choice[(layer, "v", h)] = ks, vs
        uniform = {layer: fs[0] for layer, fs in head_keeps.items() if len(set(fs)) == 1}
        ragged = {layer: fs for layer, fs in head_keeps.items() if len(set(fs)) > 1}
        plain = choice_policy(choice, with_keeps(base, uniform), g, name)
        est = head_keep_estimate(plain, ragged, g, context)
        if est.total_bytes <= total_budget and est.bits_per_element <= budget_bits + 1e-12:
            k, v = layer_specs(choice, g.num_layers, g.kv_heads)
            pred = sum(kls[i][j] for i, j in enumerate(picks))
            return HeadKeepAllocation(head_keep_text(plain, ragged), plain, head_keeps, tuple(k), tuple(v), pred,
                                      budget_bits, est, choice)
        slack += est.total_bytes - total_budget + quantum
    floor = min(estimate_kv(choice_policy({u: min(table.choices(u[1]), key=lambda c, u=u: stores[f][u][c][0])
                                           for u in table.units()}, with_keeps(base, dict.fromkeys(table.layers, f)),
                                          g), g, context).bits_per_element for f in keeps)
    raise ValueError(f"budget {budget_bits} bits/element does not fit at {context} tokens: the cheapest choice of "
                     f"{', '.join(table.codecs)} at keep={min(keeps):g} per KV head with sink={base.sink}, "
                     f"recent={base.recent} needs about {floor:.3f} bits/element; raise the budget, offer a smaller "
                     "keep or a cheaper codec")


def head_axis_split(alloc: HeadKeepAllocation, geometry: KVGeometry, context: int) -> dict:
    """Where the bytes went per (layer, KV head) at ``context`` tokens: its keep, its share of the fp16 cache, what
    its codecs saved at full keep and what eviction saved on top (``head_bytes``: each head's one-head stores at
    full keep and at its keep, positions included where its layer evicts). ``layer_rest``: per layer, what the
    estimate counts beyond its heads' sum (codec state a multi-head codec holds once per layer; 0 for ragged layers
    and per-row codecs)."""
    g = geometry
    fp16 = estimate_kv(replace(alloc.plain, k="fp16", v="fp16", keep=1.0, protect="", overrides=()), g, context)
    full_plain = replace(alloc.plain, keep=1.0, overrides=tuple(o for o in alloc.plain.overrides if o[0] != "keep"))
    rows, rest = [], {}
    for layer, fs in sorted(alloc.head_keeps.items()):
        now = head_bytes(alloc.plain, layer, fs, g, context, positions=any(evicts(f) for f in fs))
        full = head_bytes(full_plain, layer, (1.0,) * g.kv_heads, g, context, positions=False)
        rest[layer] = alloc.estimate.layer_bytes[layer] - sum(now)
        share = fp16.layer_bytes[layer] // g.kv_heads
        for h, f in enumerate(fs):
            rows.append({"layer": layer, "head": h, "keep": f, "fp16_bytes": share,
                         "saved_by_codecs": share - full[h], "saved_by_eviction": full[h] - now[h], "bytes": now[h]})
    return {"per_head": rows, "layer_rest": rest, "saved_by_codecs": sum(r["saved_by_codecs"] for r in rows),
            "saved_by_eviction": sum(r["saved_by_eviction"] for r in rows),
            "total_bytes": alloc.estimate.total_bytes, "shared_bytes": alloc.estimate.shared_bytes}


def measure_head_keeps(cells, choice: dict, plain: Policy, head_keeps: dict[int, tuple[float, ...]]) -> float:
    """The joint chunk KL of a per-head-keep allocation (``JointMeasure``'s measurement with the keeps per KV
    head): every unit ``(layer, role, head)`` quantized as ``choice`` says, each head's kept rows as a one-head
    store holding only them would (``KeepCells.quantized``), and every layer attending over each head's kept rows
    (``KeepCells.head_mask``). ``cells``: a ``keeps.KeepCells``; ``plain``: the policy without the ragged keeps
    (its codec options and protection)."""
    runner = cells.runner
    ks, vs = list(runner.keys), list(runner.values)
    for (layer, role, h), spec in sorted(choice.items()):
        f = head_keeps.get(layer, (1.0,) * (h + 1))[h]
        target = ks if role == "k" else vs
        if target[layer] is (runner.keys if role == "k" else runner.values)[layer]:
            target[layer] = target[layer].clone()
        if evicts(f):
            rows = cells.quantized(plain, spec, role, layer, h, cells.index(layer, f, plain.sink, plain.recent))
        else:
            rows = runner.quantized(plain, spec, role, layer, h)
        target[layer][:, h:h + 1] = rows
    masks = {layer: cells.head_mask(layer, fs, plain.sink, plain.recent)
             for layer, fs in head_keeps.items() if any(evicts(f) for f in fs)}
    start = min([u[0] for u in choice] + list(masks), default=0)
    return cells.kl(ks, vs, masks, start=start)


def keeps_text(axes: dict) -> str:
    """The keeps of an allocation report's ``axes`` as one line: ``layer:keep`` per layer (``>codec`` where the
    layer keeps its evicted rows in the demote tier), or per KV head ``layer:f0|f1|f2`` where a layer's heads
    differ (``head_keeps``)."""
    if "head_keeps" in axes:
        return " ".join(f"{layer}:" + (fmt_keep(tuple(map(float, fs))) if len(set(fs)) > 1 else f"{fs[0]:g}")
                        for layer, fs in axes["head_keeps"].items())
    return " ".join(f"{r['layer']}:{r['keep']:g}" + (f">{r['demote']}" if r.get("demote") else "")
                    for r in axes["per_layer"])
