"""The packed layout a ``fused`` call reads: a store's parts in token order and their fused description.

A layer's store is ``[sinks | packed | tail]`` (``FusedKV.k_parts`` / ``v_parts``: ``(kind, n_tokens,
payload)`` tuples captured before this call's rows were appended). ``layout`` splits the parts around the
packed run; ``packed_side`` describes the packed run for the kernels (``tqbench.kernels.reference.PackedSide``),
or says there is no fused form for its codec; ``kernel_sides`` describes a layer's K and V for the native CPU
kernel (``tqbench.kernels.cpu.attention.kernel_side``), the full-precision rows as chunks where they are.
"""

from __future__ import annotations

import weakref

import torch

from tqbench.kernels.cpu.attention import dense_chunks, kernel_side, key_scoring, refresh_side
from tqbench.kernels.reference import PackedSide


def packed_side(store, payload: dict, n: int, d: int, dt: torch.dtype) -> PackedSide | None:
    """The fused description of a store's packed rows, or None when its codec has no fused form (the codec says:
    ``Codec.packed_side``, its layout a row of ``tqbench/kernels/layouts.py``)."""
    return store.codec.packed_side(payload, n, d, dt, store.state or {})


def layout(parts: tuple) -> tuple[list, tuple | None, list]:
    """``parts`` in token order -> (dense rows before the packed run, the packed part, dense rows after)."""
    before, packed, after = [], None, []
    for part in parts:
        if part[0] == "packed":
            packed = part
        elif packed is None:
            before.append(part[2])
        else:
            after.append(part[2])
    return before, packed, after


def cat_rows(rows: list[torch.Tensor], dt: torch.dtype) -> torch.Tensor:
    """Dense rows ``[B, H, n_i, D]`` joined along the tokens, in ``dt``."""
    out = rows[0] if len(rows) == 1 else torch.cat(rows, dim=2)
    return out if out.dtype == dt else out.to(dt)


# store -> (key, kernel Side of its packed run): rebuilt when the codec state changes (a new calibration) or the
# dims / dtype do; when only the run changes (a flush, an eviction) its payload fields and row count are refreshed
# in place; weak keys, so the cache holds one entry per live store and nothing outlives its cache
_SIDES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def store_side(store, parts: tuple, new: torch.Tensor, dim: int, dt: torch.dtype, extra=None, score: bool = False):
    """``(Side, extra_bytes)`` of one store's side for the native kernel, or ``str`` (why not). ``score``: a K side,
    its integer key scoring set when the side is built (``attention.key_scoring``; a kept side keeps it)."""
    before, packed, after = layout(parts)
    chunks = [*before, *after, new] + ([] if extra is None else [extra])
    if packed is None:
        out = kernel_side(None, chunks, 0, dim, dt)
        if score:
            key_scoring(out[0], dt)
        return out
    n_before = sum(x.shape[2] for x in before)
    payload = packed[2]
    key = (packed[1], dim, dt, store.state_version, score, [t.data_ptr() for t in payload.values()])
    hit = _SIDES.get(store)
    if hit is not None and hit[0][1:5] == key[1:5]:  # same dim, dtype, state, scoring: at most the run grew or moved
        side = hit[1]
        if hit[0] != key:
            refresh_side(side, payload, packed[1])
            _SIDES[store] = (key, side)
        side.dense, extra = dense_chunks(chunks, dt)
        side.n_before = n_before
        return side, extra
    if (desc := packed_side(store, payload, packed[1], dim, dt)) is None:
        return f"no native kernel for {store.codec.spec}"
    side, extra = kernel_side(desc, chunks, n_before, dim, dt)
    if score:
        key_scoring(side, dt)
    _SIDES[store] = (key, side)
    return side, extra


def kernel_sides(kv, d: int, dt: torch.dtype, score: bool = False):
    """``(k_side, v_side, total_rows, extra_bytes)`` of a ``FusedKV`` for the native kernel, or ``str`` (why not).

    The dense chunks are ``[sinks..., tail..., new rows]`` in token order (then a verification call's column
    sets, ``FusedKV.extra_k``), passed as they are stored
    (converted to ``dt`` only where they are in another dtype; ``extra_bytes`` counts those copies). The packed
    run's description is kept per store and rebuilt only when the run changes. ``score``: the K side's integer
    key scoring is set where the kernel can score it so (``attention.key_scoring``)."""
    ks = store_side(kv.k_store, kv.k_parts, kv.new_k, d, dt, kv.extra_k, score)
    if isinstance(ks, str):
        return ks
    vs = store_side(kv.v_store, kv.v_parts, kv.new_v, kv.new_v.shape[-1], dt, kv.extra_v)
    if isinstance(vs, str):
        return vs
    total = kv.new_k.shape[2] + sum(p[1] for p in kv.k_parts) + kv.extra_rows
    return ks[0], vs[0], total, ks[1] + vs[1]
