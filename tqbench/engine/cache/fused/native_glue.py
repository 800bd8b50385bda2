"""The native CPU path of the ``fused`` cache mode: a layer's store handed to ``tqbench.kernels.cpu``.

The kernel reads the packed codes where they are stored (no decoded copy, no code index) and the layer's
full-precision rows ``[sinks | tail | this call's rows]`` where they are (chunks, not joined).
``native_fused_attention`` attends one store (a padded batch); ``native_fused_attention_ragged`` attends several
sequences, each with its own store (own length, own rows, own mask), in one kernel call. A per-head layer's store
(``HeadSplitCodec``) is handed as one side per group of heads, each naming its heads: still one kernel call for
the layer (``store_sides``), its dense rows handed whole (the kernel reads each group's heads at their indices).
A layer with a demote tier (``FusedKV.tier``: evicted rows kept at ``policy.demote``) adds the tier's store to the
same kernel call as a store whose sequences read the layer's query rows (``merge_into``): the kernel attends the
tier's packed codes where they are, and merges its softmax partials with the held rows' (one softmax over
``[tier | held | new]``, exact; no dense copy of the tier, no second call). The call's mask is split the same way.
Both return a string saying why when a call cannot run natively (a codec without a packed form, a per-head or
additive mask); the caller then runs the torch reference and counts the fallback. ``native_dense_attention`` is
the kernel-attended dense baselines' call (``cache.dense_kernel``): one dense side per K and V, their 16-bit rows
as stored.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from tqbench.engine.cache.fused.groups import group_label_of, group_stores, is_per_head
from tqbench.engine.cache.fused.layout import kernel_sides, store_side
from tqbench.engine.cache.fused.masks import bool_mask
from tqbench.engine.codecs.heads import HeadSplitCodec
from tqbench.kernels.cpu import attention as native
from tqbench.kernels.cpu.attention import dense_chunks, dense_side, native_attention_batch, refresh_side


def _record(layer, call, seq: slice) -> None:
    """The call's workspace (held while this layer's attention ran) and this layer's sequences' Sparse-V rows."""
    layer.native_workspace = max(layer.native_workspace, call.workspace_bytes)
    layer.sparse_v_rows[0] += sum(call.skipped_per_sequence[seq])
    layer.sparse_v_rows[1] += sum(call.weighted_per_sequence[seq])


def store_sides(kv, d: int, dt: torch.dtype):
    """``(k_sides, v_sides, total_rows, extra_bytes)`` of one ``FusedKV`` for the kernel, or ``str`` (why not): one
    side per side of a plain layer; one per group of heads of a per-head layer, each naming its KV heads (the
    kernel takes a store's groups the way it takes a batch's sequences: each its own codec description). Packed
    turbo keys the kernel can score in integers are scored so (``attention.key_scoring``)."""
    if kv.sides is not None and kv.sides[4] == dt and kv.extra_k is None:  # a decode step's sides (``step``)
        return kv.sides[:4]
    if not is_per_head(kv):  # (the K side's scoring is set when it is built: layout.store_side)
        sides = kernel_sides(kv, d, dt, score=True)
        if isinstance(sides, str):
            return sides
        for side in sides[:2]:  # the whole store (a group's kept side may carry its heads from a one-call try)
            if side.kv_heads:
                side.heads, side.kv_heads = [], 0
        return [sides[0]], [sides[1]], sides[2], sides[3]
    out = _group_sides(kv, d, dt)
    if not isinstance(out, str):
        for side in out[0]:
            native.key_scoring(side, dt)
    return out


def _group_parts(parts: tuple, codec: HeadSplitCodec, g: int) -> tuple:
    """Group ``g``'s view of a per-head store's parts: dense rows as stored (every KV head: the kernel reads the
    group's heads at their indices), packed fields the group's own (a lossless group's: its dense rows)."""
    out = []
    for part in parts:
        if part[0] == "dense":
            out.append(part)
        else:
            sub = HeadSplitCodec.sub_fields(part[2], g)
            out.append(("dense", part[1], sub["x"]) if codec.subs[g].lossless else ("packed", part[1], sub))
    return tuple(out)


# per-head K store -> (layout key, K sides, V sides): a decode step's groups keep their sides; only the dense chunks,
# the row counts and (after a flush packed rows) the payload fields are set on them (``_kept_sides``)
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _packed_key(parts: tuple):
    """``(n_before, n_packed, payload, data pointers)`` of a store's parts, or None without a packed run."""
    n_before = 0
    for kind, n, payload in parts:
        if kind == "packed":
            return n_before, n, payload, tuple(t.data_ptr() for t in payload.values())
        n_before += n
    return None


def _kept_sides(kv, d: int, dt: torch.dtype, kc: HeadSplitCodec, vc: HeadSplitCodec):
    """``_group_sides`` from the sides kept from this layer's last call, or None (no kept sides, or their codecs,
    state, dims or run layout changed: the caller builds them group by group). Same sides, same fields as a
    rebuild: the packed fields and row count are refreshed from this call's payload when rows were packed,
    and the dense chunks (sinks, tail, new rows; every KV head) converted once and handed to every group."""
    hit = _KEPT.get(kv.k_store)
    if hit is None or kv.extra_k is not None or kv.extra_v is not None:
        return None
    (v_store, kc0, vc0, heads, dims, versions), k_sides, v_sides, ptrs = hit
    if v_store is not kv.v_store or kc0 is not kc or vc0 is not vc or heads != kv.new_k.shape[1] or \
            dims != (d, kv.new_v.shape[-1], dt) or versions != (kv.k_store.state_version, kv.v_store.state_version):
        return None
    kp, vp = _packed_key(kv.k_parts), _packed_key(kv.v_parts)
    if kp is None or vp is None:
        return None
    extra = 0
    for i, (sides, (n_before, n_packed, payload, now), new, parts) in enumerate((
            (k_sides, kp, kv.new_k, kv.k_parts), (v_sides, vp, kv.new_v, kv.v_parts))):
        dense, x = dense_chunks([p[2] for p in parts if p[0] == "dense"] + [new], dt)
        extra += x
        moved = ptrs[i] != (n_packed, now)  # rows packed (the payload views grew) or a buffer moved
        for g, side in enumerate(sides):
            if moved:
                refresh_side(side, payload, n_packed, HeadSplitCodec.field_prefix(g))
            side.n_before = n_before
            side.dense = dense
        ptrs[i] = (n_packed, now)
    total = kv.new_k.shape[2] + sum(p[1] for p in kv.k_parts) + kv.extra_rows
    return k_sides, v_sides, total, extra


def _group_sides(kv, d: int, dt: torch.dtype):
    """``store_sides`` of a per-head layer: one K and one V side per group of heads, each naming its heads. The
    dense chunks (sinks, tail, this call's rows) are handed whole, every KV head: no per-group slicing here."""
    kc, vc = kv.k_store.codec, kv.v_store.codec
    if kc.groups != vc.groups:
        raise RuntimeError(f"per-head K ({kc.spec}) and V ({vc.spec}) were built over different groups of heads")
    kept = _kept_sides(kv, d, dt, kc, vc)
    if kept is not None:
        return kept
    kv_heads = kv.new_k.shape[1]
    k_views, v_views = group_stores(kv.k_store), group_stores(kv.v_store)
    k_sides, v_sides, extra = [], [], 0
    for g, heads in enumerate(kc.groups):
        ek = None if kv.extra_k is None else kc.take(kv.extra_k, g)
        ev = None if kv.extra_v is None else vc.take(kv.extra_v, g)
        ks = store_side(k_views[g], _group_parts(kv.k_parts, kc, g), kv.new_k, d, dt, ek)
        if isinstance(ks, str):
            return f"{ks} ({group_label_of(kc, vc, g)})"
        vs = store_side(v_views[g], _group_parts(kv.v_parts, vc, g), kv.new_v, kv.new_v.shape[-1], dt, ev)
        if isinstance(vs, str):
            return f"{vs} ({group_label_of(kc, vc, g)})"
        for side in (ks[0], vs[0]):  # (a kept side is labelled once: its group's heads stand with its store view)
            if side.kv_heads != kv_heads:
                side.heads = list(heads)
                side.kv_heads = kv_heads
        k_sides.append(ks[0])
        v_sides.append(vs[0])
        extra += ks[1] + vs[1]
    total = kv.new_k.shape[2] + sum(p[1] for p in kv.k_parts) + kv.extra_rows
    _keep(kv, d, dt, kc, vc, k_sides, v_sides)
    return k_sides, v_sides, total, extra


def _keep(kv, d: int, dt: torch.dtype, kc: HeadSplitCodec, vc: HeadSplitCodec, k_sides, v_sides) -> None:
    """Keep a rebuilt layer's sides for ``_kept_sides`` when every group is packed (a lossless group's rows are
    dense, its side built apart) and the call had no verification columns; else drop what was kept."""
    kp, vp = _packed_key(kv.k_parts), _packed_key(kv.v_parts)
    if kp is None or vp is None or kv.extra_k is not None or kv.extra_v is not None or \
            any(c.lossless for c in (*kc.subs, *vc.subs)):
        _KEPT.pop(kv.k_store, None)
        return
    key = (kv.v_store, kc, vc, kv.new_k.shape[1], (d, kv.new_v.shape[-1], dt),
           (kv.k_store.state_version, kv.v_store.state_version))
    _KEPT[kv.k_store] = (key, k_sides, v_sides, [kp[1::2], vp[1::2]])


def tier_sides(kv, d: int, dt: torch.dtype):
    """``(k_side, v_side, rows, extra_bytes)`` of a ``FusedKV``'s demote tier (a whole store at the demote codec:
    its packed run where it is, any rows not yet packed as chunks), None without a tier, or ``str`` (why not)."""
    tier = kv.tier
    if tier is None:
        return None
    ks = store_side(tier.k_store, tier.k_parts, kv.new_k[:, :, :0], d, dt)
    if isinstance(ks, str):
        return f"{ks} (the demote tier)"
    vs = store_side(tier.v_store, tier.v_parts, kv.new_v[:, :, :0], kv.new_v.shape[-1], dt)
    if isinstance(vs, str):
        return f"{vs} (the demote tier)"
    for side in (ks[0], vs[0]):  # (a whole store: the tier is one codec for every head)
        side.heads, side.kv_heads = [], 0
    return ks[0], vs[0], tier.rows, ks[1] + vs[1]


def _split_mask(mask, tier_rows: int) -> tuple:
    """A call's mask over ``[tier | held | new]`` -> (the held rows' part, the tier's part): views, no copy."""
    if mask is None:  # causal over the call's rows; every tier row precedes them
        return None, None
    return mask[..., tier_rows:], mask[..., :tier_rows]


def native_fused_attention(query: torch.Tensor, kv, attention_mask, scaling: float, *, softcap=None,
                           sinks=None, sparse_v: float = 0.0):
    """Attention of ``query`` [B, Hq, L, D] over the stored + new rows (and the demote tier's, in the same call and
    softmax), or ``str`` (why not) when it cannot run."""
    return _attend(query, [kv], None if attention_mask is None else [attention_mask], scaling, softcap, sinks,
                   sparse_v, padded=True)


def native_fused_attention_ragged(query: torch.Tensor, kvs: Sequence, masks: Sequence | None, scaling: float, *,
                                  softcap=None, sinks=None, sparse_v: float = 0.0):
    """One kernel call for ``len(kvs)`` sequences of different lengths (serving's fused batch).

    ``query``: ``[len(kvs), Hq, L, D]``, row ``i`` the query of sequence ``i``; ``kvs[i]``: that sequence's
    ``FusedKV`` (its own store, batch 1, this call's new rows in ``new_k``/``new_v``); ``masks[i]``: the
    sequence's 4-D attention mask ``[1, 1, L, >= rows_i]`` (its last ``rows_i`` columns are read) or None
    (causal over its last ``L`` rows). Returns ``[len(kvs), Hq, L, Dv]``, or ``str`` (why not).

    A sequence with a demote tier adds the tier's store after every sequence's own (``merge_into``: the kernel
    attends it with that sequence's queries, in the same softmax).
    """
    if masks is not None and len(masks) != len(kvs):
        raise ValueError(f"masks has {len(masks)} entries for {len(kvs)} sequences: give one per sequence or None")
    return _attend(query, kvs, masks, scaling, softcap, sinks, sparse_v, padded=False)


def _attend(query, kvs, masks, scaling, softcap, sinks, sparse_v, padded: bool):
    """One kernel call over ``kvs`` (each its own store, its tier after them all); ``padded``: one ``FusedKV`` of
    a padded batch (``query``'s batch is its store's)."""
    dt = torch.float64 if query.dtype == torch.float64 else torch.float32
    d = query.shape[-1]
    k_sides, v_sides, bool_masks, extra = [], [], [], 0
    tiers, tier_masks, merge = [], [], []
    for i, kv in enumerate(kvs):
        sides = store_sides(kv, d, dt)
        if isinstance(sides, str):
            return sides
        ks, vs, total, x = sides
        tier = tier_sides(kv, d, dt)
        if isinstance(tier, str):
            return tier
        n_tier = 0 if tier is None else tier[2]
        m = bool_mask(None if masks is None else masks[i], query.shape[2], n_tier + total)
        if isinstance(m, str):
            return m
        if tier is not None:
            m, tm = _split_mask(m, n_tier)
            tiers.append(tier)
            tier_masks.append(tm)
            merge.append(i)
            extra += tier[3]
        k_sides += ks
        v_sides += vs
        bool_masks.append(m)
        extra += x
    for tk, tv, _, _ in tiers:
        k_sides.append(tk)
        v_sides.append(tv)
    into = [-1] * len(kvs) + merge if merge else []
    out, call = native_attention_batch(query, k_sides, v_sides, scaling, masks=bool_masks + tier_masks,
                                       softcap=softcap, sinks=sinks, sparse_v=sparse_v, extra_bytes=extra,
                                       merge_into=into)
    for i, kv in enumerate(kvs):
        _record(kv.layer, call, slice(None) if padded else slice(i, i + 1))
    return out


def native_dense_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attention_mask,
                           scaling: float, *, softcap=None, sinks=None) -> torch.Tensor:
    """Attention of ``query`` [B, Hq, L, D] over a dense baseline's rows ``keys`` / ``values`` [B, Hkv, rows, D] as
    stored (16-bit: read by the kernel, never upcast here): one kernel call. A mask the kernel cannot take is
    refused (``RuntimeError`` saying why): the baseline has no other attention to fall back to silently."""
    mask = bool_mask(attention_mask, query.shape[2], keys.shape[2])
    if isinstance(mask, str):
        raise RuntimeError(f"the kernel-attended dense baseline cannot take {mask}: use dense-fp16 or dense-bf16 "
                           "(the model's attention on the upcast rows)")
    out, _ = native_attention_batch(query, [dense_side([keys], keys.shape[-1])],
                                    [dense_side([values], values.shape[-1])], scaling, masks=[mask],
                                    softcap=softcap, sinks=sinks)
    return out
