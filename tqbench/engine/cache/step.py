"""A decode step's append for a layer's stores in one native call (``append_step``).

The general path (``KVStore.append_points``) appends store by store, each through Python bookkeeping and its own
native encode. A decode step of a plain layer needs less: each store's rows go to its full-precision tail and the
rows its policy packs now are packed in place, so the step's K and V rows are copied and packed by ONE native call
(``append_rows``), the bookkeeping done around it once. Any store that needs more (sinks still filling, a window,
a mark for a crop, a deferral for eviction, no native encoder or no packed buffers yet) takes the general path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tqbench.engine.cache.handles import FusedKV
from tqbench.engine.cache.store import KVStore

__all__ = ["append_step", "fused_step"]

_MODULE: list = []  # the native extension, once asked (the per-step call skips the loader's lock)


def append_step(stores: Sequence[KVStore], xs: Sequence[torch.Tensor]) -> bool:
    """A decode step's rows of several stores (a layer's K and V) appended by ONE native call (``append_rows``): each
    store's rows copied into its tail buffer and the rows its policy packs now packed in place, exactly as
    ``append_points(x)`` would (the same rows, the same bytes, the same bookkeeping). False, with nothing changed,
    where any store needs the general path (``KVStore._step_plan``); the caller then appends store by store."""
    plans = []
    for store, x in zip(stores, xs):
        plan = store._step_plan(x)
        if plan is None:
            return False
        plans.append(plan)
    saved = [(s.tail.state(), [b.state() for b in p[1]]) for s, p in zip(stores, plans)]
    encoders, tails, tail_at, starts, ns, dsts, offsets = [], [], [], [], [], [], []
    for store, x, (encoder, bufs) in zip(stores, xs, plans):
        tail, t = store.tail, x.shape[2]
        before = tail.alloc_bytes()
        at = tail.reserve(t)
        store.note_dense_bytes(_nbytes(x), before)
        if tail.data is not store._appender[1]:  # (the row buffer grew: same dtype and shape, the encoder stands)
            store._appender = (store._appender[0], tail.data, store._appender[2])
        tpu = store.codec.tokens_per_unit
        n = max(0, (tail.n - store.recent) // tpu * tpu)
        encoders.append(encoder)
        tails.append(tail.data)
        tail_at.append(at)
        starts.append(tail.start)
        ns.append(n)
        offsets.append([b.reserve(n) for b in bufs] if n else [])  # (reserved first: a buffer may grow)
        dsts.append([b.data for b in bufs] if n else [])
    try:
        _native_append(encoders, list(xs), tails, tail_at, starts, ns, dsts, offsets)
    except BaseException:
        for store, (tail_state, buf_states), (_, bufs) in zip(stores, saved, plans):
            store.tail.restore(tail_state)
            for b, st in zip(bufs, buf_states):
                b.restore(st)
        raise
    for store, x, n in zip(stores, xs, ns):
        store.seen += x.shape[2]
        store.last_evicted = 0
        if n:
            store.n_packed += n
            store.tail.drop_front(n)
    return True


def _native_append(*args) -> None:
    if not _MODULE:
        from tqbench.kernels.cpu import native_module

        _MODULE.append(native_module())
    _MODULE[0].append_rows(*args)


class _Plan:
    """A plain fused layer's step, kept across steps while its key stands (both stores' states, the rows' shapes and
    dtype, the stores' packed dicts): its kernel sides (built once by the glue's own ``store_sides``), each store's
    encoder, packed buffers and field names, and the native ``LayerStep`` over the buffers (remade when one moves)."""

    __slots__ = ("bufs", "data", "key", "names", "native", "packed", "sides", "why")

    def __init__(self, key, packed) -> None:
        self.key, self.packed = key, packed
        self.sides = self.why = self.native = None
        self.bufs: tuple = ()
        self.names: tuple = ()
        self.data: tuple = ()


def _new_plan(layer, ks: KVStore, vs: KVStore, k: torch.Tensor, v: torch.Tensor, dt: torch.dtype, key) -> _Plan:
    """A plan for the stores as they are (sides built from their parts before the call's rows), or one whose
    ``why`` says why the general path runs (kept, so the sides are not built again until the key changes)."""
    from tqbench.engine.cache.fused.native_glue import store_sides
    from tqbench.engine.cache.handles import FusedKV, snapshot

    plan = _Plan(key, (ks.packed, vs.packed))
    kp, vp = ks._step_plan(k), vs._step_plan(v)
    if kp is None or vp is None:
        store = ks if kp is None else vs
        hit = store._appender
        if hit is not None and isinstance(hit[2], str):
            reason = hit[2]
        elif hit is None:
            reason = f"{store.codec.spec} rows have no native in-place encoder"
        else:
            reason = "its rows take the general append path (a window, sinks filling or a mark)"
        plan.why = f"the {'K' if kp is None else 'V'} store: {reason}"
        return plan
    sides = store_sides(FusedKV(ks, vs, k, v, snapshot(ks), snapshot(vs), layer), k.shape[3], dt)
    if isinstance(sides, str):
        plan.why = sides
        return plan
    k_sides, v_sides = list(sides[0]), list(sides[1])
    names = (ks._appender[2][0], vs._appender[2][0])
    if (len(k_sides), len(v_sides)) != (len(names[0]), len(names[1])) or any(
            x.kind not in ("turbo", "pcaq") for x in (*k_sides, *v_sides)):
        plan.why = "sides other than one packed side per group of heads"
        return plan
    plan.sides = (k_sides, v_sides)
    plan.bufs = (kp, vp)
    plan.names = tuple(tuple(nm for group in g for nm in group) for g in names)
    return plan


def fused_step(layer, k: torch.Tensor, v: torch.Tensor):
    """A plain fused layer's decode step in one native call (``LayerStep.step``): the stores' parts as of the call
    and the kernel sides pointed at them, then the call's rows appended to both stores, exactly as the general path
    (``snapshot`` + ``append_points`` per store + the glue's ``store_sides``) would. Returns the ``FusedKV`` handle
    (its ``sides`` set: the glue hands them to the kernel as they are), or None where the general path must run.
    The handle's sides are the layer's own, pointed at this call's rows: read them before the layer's next call."""
    ks, vs = layer.k_store, layer.v_store
    if (ks._mark is not None or vs._mark is not None or ks.head.n != ks.sink or vs.head.n != vs.sink
            or not ks.n_packed or not vs.n_packed):
        return None
    dt = torch.float64 if k.dtype == torch.float64 else torch.float32
    key = (ks.state_version, vs.state_version, k.shape, v.shape, k.dtype, v.dtype)
    plan = layer._step
    if plan is None or plan.key != key or plan.packed[0] is not ks.packed or plan.packed[1] is not vs.packed:
        plan = layer._step = _new_plan(layer, ks, vs, k, v, dt, key)
    if plan.sides is None:
        return None
    stores = ((ks, k, plan.bufs[0][1]), (vs, v, plan.bufs[1][1]))
    saved = [(st.tail.state(), [b.state() for b in bufs]) for st, _, bufs in stores]
    ints, ns = [], []
    for store, x, bufs in stores:
        tail, head = store.tail, store.head
        tn = tail.n
        at = tail.reserve(x.shape[2])
        if tail.data is not store._appender[1]:  # (the row buffer grew: same dtype and shape, the encoder stands)
            store._appender = (store._appender[0], tail.data, store._appender[2])
        tpu = store.codec.tokens_per_unit
        n = max(0, (tail.n - store.recent) // tpu * tpu)
        ns.append(n)
        ints += (head.n, head.start, tail.start, tn, at, n, store.n_packed)
        for b in bufs:
            start = b.start
            ints += (start, b.reserve(n) if n else start + b.n)
    data = (ks.head.data, vs.head.data, ks.tail.data, vs.tail.data, *(b.data for b in stores[0][2]),
            *(b.data for b in stores[1][2]))
    try:
        if plan.native is None or any(a is not b for a, b in zip(data, plan.data)):
            # the dense bytes held (``KVStore._add``'s rule): they change only when a buffer does, so counted here
            for (store, x, _), (tail_state, _) in zip(stores, saved):
                store.note_dense_bytes(_nbytes(x), _nbytes(tail_state[0]))
            _bind(plan, data, dt)
        extra, views = plan.native.step(k, v, ints)
    except BaseException:
        for (store, _, bufs), (tail_state, buf_states) in zip(stores, saved):
            store.tail.restore(tail_state)
            for b, st in zip(bufs, buf_states):
                b.restore(st)
        raise
    parts = []
    for (store, x, _), (hv, tv, pv), n, names in zip(stores, views, ns, plan.names):
        n_packed = store.n_packed
        if hv is None:
            p = (("packed", n_packed, dict(zip(names, pv))),)
        else:
            p = (("dense", hv.shape[2], hv), ("packed", n_packed, dict(zip(names, pv))))
        parts.append(p if tv is None else (*p, ("dense", tv.shape[2], tv)))
        store.seen += x.shape[2]
        store.last_evicted = 0
        if n:
            store.n_packed = n_packed + n
            store.tail.drop_front(n)
    kv = FusedKV(ks, vs, k, v, parts[0], parts[1], layer)
    kv.sides = (*plan.sides, k.shape[2] + sum(p[1] for p in parts[0]), extra, dt)
    return kv


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _bind(plan: _Plan, data: tuple, dt: torch.dtype) -> None:
    """(Re)make the native step over the stores' buffers as they are now (the first step, or a buffer grew)."""
    if not _MODULE:
        from tqbench.kernels.cpu import native_module

        _MODULE.append(native_module())
    (k_enc, k_bufs), (v_enc, v_bufs) = plan.bufs
    plan.native = _MODULE[0].LayerStep(
        plan.sides[0], plan.sides[1], [b.data for b in k_bufs], [b.data for b in v_bufs], data[0], data[1],
        data[2], data[3], k_enc, v_enc, torch.empty(0, dtype=dt))
    plan.data = data
