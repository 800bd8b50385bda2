"""A ``TQCache``'s ``CacheReport``: bytes per layer (packed, full precision, state), what attention held
transiently, and which fused implementation ran."""

from __future__ import annotations

import torch

from tqbench.engine.cache.fused.groups import GroupStore
from tqbench.engine.cache.geometry import dense_fp16_bytes, fp16_row_bytes, window_rows
from tqbench.engine.cache.layer import TQLayer
from tqbench.engine.cache.report import CacheReport, LayerBytes, ran_in_kernels
from tqbench.engine.cache.store import APPEND_IN_PLACE
from tqbench.engine.codecs import HeadSplitCodec
from tqbench.engine.policy.keep import fmt_keep
from tqbench.engine.policy.spec import Policy
from tqbench.kernels.layouts import layout_of

__all__ = ["build_report", "fused_reference_peak_bytes"]


def build_report(cache) -> CacheReport:
    """The report of ``cache`` (a ``TQCache``) as it is now."""
    rows = []
    shared: dict[str, int] = {}
    max_layer_dense = 0
    batch = 0
    kv_heads, head_dim, v_head_dim = cache.num_kv_heads, cache.head_dim, cache.v_head_dim
    for plan, layer in zip(cache.plans, cache.layers):
        if isinstance(layer, TQLayer):
            kb = layer.k_store.bytes_breakdown()
            vb = layer.v_store.bytes_breakdown()
            demoted = layer.evictor.demoted if layer.evictor is not None else None
            if demoted:  # evicted rows kept at the demote codec: this layer's bytes too
                for side, store, dim in ((kb, demoted[0], head_dim), (vb, demoted[1], v_head_dim)):
                    for key, n in store.bytes_breakdown().items():
                        side[key] += n
                    shared.update(_shared_of(store, dim))
            if layer.evictor is not None:  # the held rows' positions (and h2o's mass): row metadata, K side
                kb["state"] += layer.evictor.bookkeeping_bytes()
            tokens = layer.k_store.n_tokens  # rows held (a window-bounded store holds its window)
            head_tokens = tuple(layer.k_store.rows) if layer.ragged else ()
            if head_tokens:  # a ragged layer: each head its own rows; the mean is the layer's budget per head
                tokens = sum(head_tokens) // len(head_tokens)
            # the fp16 basis holds what transformers' cache would: a sliding layer's last window - 1 rows
            fp16_tokens = tokens if layer.window is None else min(layer.cumulative_length, layer.window)
            ev = layer.evictor
            if ev is not None:  # fp16 would hold every token; the layer holds the rows it kept
                fp16_tokens = layer.cumulative_length
            batch = batch or _batch_of(layer)
            for store, dim in ((layer.k_store, head_dim), (layer.v_store, v_head_dim)):
                shared.update(_shared_of(store, dim))
            rows.append(LayerBytes(
                layer=plan.layer, k_codec=plan.k, v_codec=plan.v, tokens=tokens,
                k_bytes=sum(kb.values()), v_bytes=sum(vb.values()),
                full_precision_bytes=kb["full_precision"] + vb["full_precision"],
                packed_bytes=kb["packed"] + vb["packed"], state_bytes=kb["state"] + vb["state"],
                k_packed_tokens=layer.k_store.n_packed, v_packed_tokens=layer.v_store.n_packed,
                dense_fp16_bytes=dense_fp16_bytes(batch * kv_heads * fp16_tokens, head_dim, v_head_dim),
                reason=plan.reason,
                evicted_prefill=ev.evicted_prefill if ev is not None else 0,
                evicted_decode=ev.evicted_decode if ev is not None else 0,
                demoted_tokens=ev.n_demoted if ev is not None else 0,
                head_tokens=head_tokens,
            ))
            max_layer_dense = max(max_layer_dense, rows[-1].dense_fp16_bytes)
        else:  # transformers' sliding window layer: dense, bounded
            held = layer.keys.shape[2] if layer.is_initialized and layer.keys.dim() == 4 else 0
            b = layer.keys.shape[0] if held else 0
            k_dense = fp16_row_bytes(b * kv_heads * held, head_dim)
            v_dense = fp16_row_bytes(b * kv_heads * held, v_head_dim)
            dense = k_dense + v_dense
            rows.append(LayerBytes(
                layer=plan.layer, k_codec="fp16", v_codec="fp16", tokens=held, k_bytes=k_dense,
                v_bytes=v_dense, full_precision_bytes=dense, packed_bytes=0, state_bytes=0,
                k_packed_tokens=0, v_packed_tokens=0, dense_fp16_bytes=dense, reason=plan.reason,
            ))
    layers = [la for la in cache.layers if isinstance(la, TQLayer)]
    fallbacks: dict[str, int] = {}
    impls: dict[str, int] = {}
    groups: dict[str, dict[str, int]] = {}
    sparse = [0, 0]
    for layer in layers:
        for group, ran in layer.fused_groups.items():
            for case, n in ran.items():
                groups.setdefault(group, {})[case] = groups.get(group, {}).get(case, 0) + n
        sparse = [sparse[0] + layer.sparse_v_rows[0], sparse[1] + layer.sparse_v_rows[1]]
        for case, n in layer.fallbacks.items():
            fallbacks[case] = fallbacks.get(case, 0) + n
        for case, n in layer.fused_impl.items():
            impls[case] = impls.get(case, 0) + n
    if cache.mode == "fused":
        if ran_in_kernels(impls, fallbacks):
            # the kernels keep split-K partials (+ the native call's joined full-precision rows), nothing decoded
            max_layer_dense = max((la.native_workspace for la in layers), default=0)
        else:  # the torch reference's peak: one side of one layer decoded, with its int32 code index
            max_layer_dense = max((fused_reference_peak_bytes(la, kv_heads, head_dim, v_head_dim) for la in layers),
                                  default=0)
    windowed = [la.plan.layer for la in layers if la.window is not None]
    rep = CacheReport.build(
        mode=cache.mode, policy=cache.policy, layers=rows, shared=shared,
        transient_layer_bytes=max_layer_dense, fused_calls=sum(la.fused_calls for la in layers),
        fallbacks=fallbacks, fused_impl=impls, fused_groups=groups,
        sparse_v=_sparse_v_summary(cache.policy, sparse) if cache.mode == "fused" else None,
        held_dtype=str(getattr(cache.layers[0], "dtype", "")).replace("torch.", ""),
    )
    slow = sorted({why for la in layers for c in (la.k_codec, la.v_codec)
                   if (why := getattr(c, "encoder_fallback", None))})
    rep.notes.extend(slow)  # the append path's fast path did not run: say so, and why
    rep.notes.extend(sorted({why for la in layers for s in (la.k_store, la.v_store)
                             if (why := getattr(s, "append_path", None)) and why != APPEND_IN_PLACE}))
    rep.notes.extend(sorted({f"decode step not in one native call ({why}): the stores appended one by one"
                             for la in layers if (why := getattr(getattr(la, "_step", None), "why", None))}))
    if windowed:
        rep.notes.append(
            f"{len(windowed)} sliding-window layers hold only their window ({window_rows(cache.sliding_window)} tokens, "
            f"plus up to one codec unit): their bytes and tokens stay bounded at any context"
        )
    evicting = [la for la in layers if la.evictor is not None]
    if evicting:
        held = sum(sum(la.k_store.rows) // len(la.k_store.rows) if la.ragged else la.k_store.n_tokens
                   for la in evicting)
        seen = sum(la.cumulative_length for la in evicting)
        pre = sum(la.evictor.evicted_prefill for la in evicting)
        dec = sum(la.evictor.evicted_decode for la in evicting)
        pol = cache.policy
        tiers: dict[str, list[int]] = {}  # demote codec -> the evicting layers that keep their evicted rows at it
        for la in evicting:
            if la.plan.demote:
                tiers.setdefault(la.plan.demote, []).append(la.plan.layer)
        tier = "; ".join(f"the evicted rows kept at {c} (demote" + ("" if len(ls) == len(evicting) else
                                                                   f", {len(ls)} layers") + ")"
                         for c, ls in tiers.items())
        rep.notes.append(
            f"token eviction (keep={fmt_keep(pol.keep)}, score={pol.score}, window={pol.window}"
            + (f", every={pol.every}" if pol.every else "") + f"): {len(evicting)} layers hold {held} of {seen} "
            f"rows per KV head, summed over layers ({pre} evicted at prefill, {dec} while decoding"
            + (f"; {tier}" if tier else "") + "); sinks and the "
            "last max(window, recent) rows are never evicted")
        if pol.budget == "global":
            rep.notes.append(
                "budget=global (kvpress KVzipPress layerwise=False): the rows of every evicting layer and KV head "
                "ranked together, the same total kept as keep= per layer; each holds its own rows (head_tokens per "
                "layer); layer_bytes differ from the estimate's per-layer shares, the total is exact")
        elif any(la.ragged and la.policy.heads != "ada" for la in evicting):
            rep.notes.append(
                "per-head keep lists: each KV head of those layers keeps its own fraction, in its own store "
                "(head_tokens per layer; tokens is their mean); compressed and simulate read the same rows (no "
                "dense simulate buffer for a ragged layer)")
        if pol.heads == "ada":
            rep.notes.append(
                f"heads=ada (AdaKV, ada_floor={pol.ada_floor}): each layer's KV heads share its kept rows by their "
                "scores, each holding its own rows (head_tokens per layer; tokens is their mean); compressed and "
                "simulate read the same rows (no dense simulate buffer for a ragged layer)")
    sliding_kept = [p.layer for p in cache.plans if (p.sliding or p.dense_window)]
    if cache.policy.evicts and sliding_kept:
        rep.notes.append(
            f"keep= does not apply to the {len(sliding_kept)} sliding-window layers: they already hold only their "
            "window (token eviction runs on full-attention layers)")
    verify = sum(la.verify_calls for la in layers)
    if verify:
        rep.notes.append(
            f"speculative verification: {verify} layer calls gave draft tokens rows packed during the call at "
            "their own precision (extra key columns, transient; nothing extra is stored)"
        )
    return rep


def _shared_of(store, dim: int) -> dict[str, int]:
    """The shared objects (rotations, codebooks) a store that packed rows uses (a ragged store: its heads')."""
    if getattr(store, "ragged", False):
        return store.shared_items(dim)
    return store.codec.shared_items(dim) if store.n_packed else {}


def _sparse_v_summary(policy: Policy, rows: list[int]) -> dict | None:
    """What Sparse-V skipped (value rows, over the rows with any softmax weight), or None when it is off."""
    if not policy.sparsev:
        return None
    skipped, visited = rows
    return {"threshold": policy.sparsev, "skipped_rows": skipped, "weighted_rows": visited,
            "skipped_share": round(skipped / visited, 4) if visited else 0.0}


def fused_reference_peak_bytes(layer: TQLayer, kv_heads: int, head_dim: int, v_head_dim: int | None = None) -> int:
    """Transient bytes the fused torch reference holds while reading one side of ``layer``: the decoded rows
    (rotated-domain or dequantized, compute dtype), the int32 copy of the codes that indexes the byte table
    (plus the unpacked codes for widths that do not divide 8), and the concatenated full-precision rows.
    Codecs decoded by ``codec.decode`` (fallback) are counted at twice their rows."""
    if not layer.is_initialized:
        return 0
    elem = torch.promote_types(layer.dtype, torch.float32).itemsize
    b = _batch_of(layer)
    v_head_dim = v_head_dim or head_dim
    if layer.ragged:  # a ragged layer: head by head, each its own store (its own codec): the largest one
        return max((max(_side_peak(ks, head_dim, b, elem), _side_peak(vs, v_head_dim, b, elem))
                    for ks, vs in zip(layer.k_store.stores, layer.v_store.stores)), default=0)
    if isinstance(layer.k_codec, HeadSplitCodec):  # groups of heads run one after another: the largest one
        return max(max(_side_peak(GroupStore(layer.k_store, g), head_dim, b * len(heads), elem),
                       _side_peak(GroupStore(layer.v_store, g), v_head_dim, b * len(heads), elem))
                   for g, heads in enumerate(layer.k_codec.groups))
    return max(_side_peak(layer.k_store, head_dim, b * kv_heads, elem),
               _side_peak(layer.v_store, v_head_dim, b * kv_heads, elem))


def _side_peak(store, dim: int, bh: int, elem: int) -> int:
    fp_rows = bh * (store.n_full_precision + 1) * dim * elem
    rows = bh * store.n_packed * dim * elem
    codec = store.codec
    if not store.n_packed:
        side = 0
    elif codec.layout is not None and layout_of(codec.layout).table_decoded:
        code_bytes = store.packed[layout_of(codec.layout).code_field].view().numel()
        if codec.bits == 8:
            side = rows
        elif 8 % codec.bits == 0:
            side = rows + 4 * code_bytes
        else:
            side = rows + 5 * bh * store.n_packed * dim
    else:
        side = 2 * rows
    return side + fp_rows


def _batch_of(layer: TQLayer) -> int:
    store = layer.k_store
    if layer.ragged:  # a ragged layer: every head's store holds the same sequences
        if not store.stores:
            return 0
        store = store.stores[0]
    for buf in (store.head, store.tail, *store.packed.values()):
        if buf.data is not None:
            return buf.data.shape[0]
    return 0
