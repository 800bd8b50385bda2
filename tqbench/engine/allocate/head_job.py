"""The per-head keeps inside ``allocate_policy`` (``keep_granularity="head"``): its checks, its cells, its solve.

- ``check_keep_granularity``: ``layer`` (one keep per layer, ``joint.solve_joint``) or ``head`` (a keep per
  (layer, KV head), ``head_keeps.solve_joint_heads``), which needs the tokens axis and per-head codecs.
- ``head_keep_cells``: the cells ``KeepCells.head_cell`` measures, keyed ``L.h/keep/<score>.w<window>.<keep>``
  in the partial results file (resumed like every cell).
- ``solve_heads``: the additive solve at the base's protection and one joint measurement of it
  (``measure_head_keeps``); the policy parsed from its text (``keep@L=f0|f1|f2``) and its ``estimate_kv`` checked
  equal to the solver's per-head count, to the byte. The protection grid and the exchange steps are not run with
  per-head keeps (a note says so).
"""

from __future__ import annotations

from tqbench.engine.allocate.exchange import ExchangeStep
from tqbench.engine.allocate.head_keeps import HeadKeepAllocation, measure_head_keeps, solve_joint_heads
from tqbench.engine.allocate.keeps import head_keep_key
from tqbench.engine.allocate.solver import Allocation
from tqbench.engine.cache.estimate import estimate_kv
from tqbench.engine.events import Progress, emit, raise_if_cancelled
from tqbench.engine.policy.files import parse_policy
from tqbench.engine.request import RequestError

KEEP_GRANULARITIES = ("layer", "head")
NOTE = ("per-head keeps: the additive solve at the base's sink/recent and one joint measurement of it; the "
        "protection grid and the exchange steps are not searched")


def check_keep_granularity(keep_granularity: str, axes: tuple[str, ...], granularity: str) -> None:
    if keep_granularity not in KEEP_GRANULARITIES:
        raise RequestError("keep_granularity", keep_granularity, "use layer (one keep fraction per layer) or head "
                                                                 "(one per KV head)")
    if keep_granularity == "head" and "tokens" not in axes:
        raise RequestError("keep_granularity", keep_granularity, "per-head keeps are the tokens axis: search tokens "
                                                                 "(tokens or bits,tokens)")
    if keep_granularity == "head" and granularity != "head":
        raise RequestError("keep_granularity", keep_granularity, "each KV head with its own keep picks its own "
                                                                 "codecs too: use granularity head")


def head_keep_cells(keep_cells, layers, heads: int, keeps, base, known: dict, cells: dict, persist, on_event,
                    cancel) -> dict[tuple[int, int, float], float]:
    """``(layer, head, keep) -> KL`` for every table layer, KV head and keep below 1 (measured unless ``known``)."""
    todo = [(layer, h, f) for layer in layers for h in range(heads) for f in keeps if f < 1]
    out = {}
    for i, (layer, h, f) in enumerate(todo):
        key = head_keep_key(layer, h, base.score, base.window, f, base.chunk)
        emit(on_event, Progress("keep", i, len(todo), f"layer {layer} head {h} keep={f:g}"))
        if key not in known:
            raise_if_cancelled(cancel, "allocate")
            persist(key, keep_cells.head_cell(layer, h, f, base.sink, base.recent))
        out[(layer, h, f)] = cells[key]
    return out


def needed_keys(layers, heads: int, keeps, base) -> list[str]:
    return [head_keep_key(layer, h, base.score, base.window, f, base.chunk) for layer in layers for h in range(heads)
            for f in keeps if f < 1]


def solve_heads(table, head_kl, keeps, geometry, budget, context, base, name, keep_cells, measure: bool):
    """(``HeadKeepAllocation``, the ``Allocation`` of its parsed policy, its joint KL or None, steps)."""
    hk: HeadKeepAllocation = solve_joint_heads(table, head_kl, keeps, geometry, budget, context, base, name)
    measured = measure_head_keeps(keep_cells, hk.choice, hk.plain, hk.head_keeps) if measure else None
    try:
        policy = parse_policy(hk.text)
    except ValueError as exc:
        raise ValueError(f"the allocation {hk.text!r} keeps different fractions per KV head, which this build's "
                         f"policy language cannot hold ({exc})") from None
    if name:
        from dataclasses import replace

        policy = replace(policy, name=name)
    est = estimate_kv(policy, geometry, context)
    if est.total_bytes != hk.estimate.total_bytes:
        raise ValueError(f"the store counts {est.total_bytes} bytes for {hk.text!r} at {context} tokens, the per-head "
                         f"solve {hk.estimate.total_bytes}: the two byte rules disagree")
    alloc = Allocation(policy, hk.k, hk.v, hk.predicted_kl, budget, est, hk.choice)
    steps = [ExchangeStep(0, "protection", f"solve per KV head at sink={base.sink},recent={base.recent}",
                          hk.predicted_kl, measured, est.bits_per_element, est.total_bytes, base.sink, base.recent,
                          True)] if measure else []
    return hk, alloc, measured, steps
