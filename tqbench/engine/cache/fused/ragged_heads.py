"""The ``fused`` mode of a ragged layer (``heads=ada``, or a per-head keep list): each KV head holds its own rows
in its own store (``evict.ragged.RaggedStore``, at its own codec), so each head is attended over its own row
count, nothing padded.

On the native kernel the layer is ONE call: each KV head is a side of the call with its own packed codes (its
own codec's description), full-precision rows, row count and mask, the way the sequences of serving's ragged
batch are (the kernel takes sides of different lengths as different sequences: the query heads each KV head
serves are handed as that "sequence"'s query, ``[H * B, n_rep, L, D]``). A head's demote tier (its evicted rows
at ``policy.demote``, its own store) is one more side of the same call, merged into its head's softmax
(``merge_into``, as ``native_glue`` does for a uniform layer's tier). Elsewhere (Triton, the torch reference, sink logits, a call the
kernel refuses) the layer runs head by head through the ordinary fused path, each head counted in the report
(``TQLayer.fused_groups``), and the report says why.

The call's mask (transformers', over the most rows a head reads plus the call's rows) is read per head: head
``h``'s demoted then held rows are the mask's first ``tier_h + rows_h`` columns (every such row is before every
query), then the call's own columns.
"""

from __future__ import annotations

import torch

from tqbench.engine.cache.fused.masks import bool_mask

__all__ = ["head_mask", "ragged_fused_attention"]


def head_mask(attention_mask, held: int, span: int):
    """The columns of ``attention_mask`` (``[..., span + L]``) that head ``h`` with ``held`` rows reads: its rows
    (the first ``held``) and the call's (the last ``L``)."""
    if attention_mask is None or held == span:
        return attention_mask
    return torch.cat([attention_mask[..., :held], attention_mask[..., span:]], dim=-1)


def _native(query, kv, attention_mask, scaling, softcap):
    """One native call over every KV head, or ``str`` (why not)."""
    from tqbench.engine.cache.fused.layout import kernel_sides
    from tqbench.engine.cache.fused.native_glue import _record, _split_mask, tier_sides
    from tqbench.kernels.cpu.attention import native_attention_batch

    heads = kv.ragged
    b, hq, seq, d = query.shape
    n_rep = hq // len(heads)
    dt = torch.float64 if query.dtype == torch.float64 else torch.float32
    span = kv.k_store_tokens
    total = span + seq
    mask = bool_mask(attention_mask, seq, total)
    if isinstance(mask, str):
        return mask
    k_sides, v_sides, masks, extra = [], [], [], 0
    tiers, tier_masks, merge = [], [], []
    for i, kv_h in enumerate(heads):
        sides = kernel_sides(kv_h, d, dt)
        if isinstance(sides, str):
            return sides
        ks, vs, _, x = sides
        for side in (ks, vs):  # a one-head store, whole (no group naming)
            if side.kv_heads:
                side.heads, side.kv_heads = [], 0
        tier = tier_sides(kv_h, d, dt)
        if isinstance(tier, str):
            return tier
        m = head_mask(mask, kv_h.tier_rows + kv_h.k_store_tokens, span)
        if tier is not None:  # the head's demote tier: one more side, merged into this head's softmax
            m, tm = _split_mask(m, tier[2])
            tiers.append(tier)
            tier_masks.append(tm)
            merge.append(i)
            extra += tier[3]
        k_sides.append(ks)
        v_sides.append(vs)
        masks.append(m)
        extra += x
    for tk, tv, _, _ in tiers:
        k_sides.append(tk)
        v_sides.append(tv)
    # each KV head's query heads as its own "sequence": [H * B, n_rep, L, D], head-major
    q = query.reshape(b, len(heads), n_rep, seq, d).transpose(0, 1).reshape(len(heads) * b, n_rep, seq, d)
    extra += q.numel() * q.element_size()
    out, call = native_attention_batch(q, k_sides, v_sides, scaling, masks=masks + tier_masks, softcap=softcap,
                                       sparse_v=kv.layer.policy.sparsev, extra_bytes=extra,
                                       merge_into=[-1] * len(heads) + merge if merge else [])
    _record(kv.layer, call, slice(None))
    dv = out.shape[-1]
    return out.reshape(len(heads), b, n_rep, seq, dv).transpose(0, 1).reshape(b, hq, seq, dv)


def _label(layer) -> str:
    return "heads=ada" if layer.policy.heads == "ada" else "per-head keep"


def ragged_fused_attention(query, kv, attention_mask, scaling: float, *, softcap=None, sinks=None, one, count
                           ) -> torch.Tensor:
    """Attention of ``query`` ``[B, Hq, L, D]`` over each KV head's own rows plus the call's (``kv.ragged``).
    ``one`` attends one store (``install._fused_one``: a KV head, off the native call) and ``count`` records
    which implementation ran (``install._count``); the caller hands both, so this module needs no import of it."""
    from tqbench.engine.cache.fused.choose import NATIVE, choose_impl

    layer = kv.layer
    if choose_impl(query)[0] == NATIVE:
        why = "sink logits differ per query head (one call hands each KV head's query heads as one sequence)" \
            if sinks is not None else _native(query, kv, attention_mask, scaling, softcap)
        if not isinstance(why, str):
            count(layer, NATIVE, None)
            return why
        layer.note_fallback(f"native: {why}: the layer's KV heads (ragged) ran one call each")
    heads = kv.ragged
    n_rep = query.shape[1] // len(heads)
    span = kv.k_store_tokens
    out = None
    for h, kv_h in enumerate(heads):
        qi = slice(h * n_rep, (h + 1) * n_rep)
        o = one(query[:, qi], kv_h, head_mask(attention_mask, kv_h.tier_rows + kv_h.k_store_tokens, span), scaling,
                softcap, None if sinks is None else sinks[qi], f"kv head {h} ({_label(layer)})")
        if out is None:
            out = o.new_empty(query.shape[0], query.shape[1], *o.shape[2:])
        out[:, qi] = o
    return out
