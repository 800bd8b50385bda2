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

from tqbench.engine.cache.store import KVStore

__all__ = ["append_step"]

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
        after = tail.alloc_bytes()
        held = x.numel() * x.element_size() + store.head.alloc_bytes() + after + (before if after != before else 0)
        store.peak_dense_bytes = max(store.peak_dense_bytes, held)
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
