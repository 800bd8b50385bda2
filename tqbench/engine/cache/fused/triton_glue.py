"""The Triton path of the ``fused`` cache mode: packed history through the kernel, full-precision rows in torch.

Token layout of a layer's store: ``[sinks | packed | tail]`` plus this call's new rows. K and V may have
packed different counts (KIVI keys pack whole blocks of tokens): the kernel reads the common packed range;
rows that only one side packed are decoded for this call (counted as a fallback case with their row count),
and every full-precision row goes through one small dense attention. The two partial results merge by their
log-sum-exp (the same reduction as the kernel's split-K).
"""

from __future__ import annotations

import torch

from tqbench.engine.cache.fused.layout import layout, packed_side
from tqbench.engine.cache.fused.masks import bool_mask
from tqbench.engine.cache.fused.torch_ref import reference_fused_attention
from tqbench.engine.codecs.base import compute_dtype
from tqbench.kernels.packed_attention import packed_attention  # imports triton: this module is loaded lazily
from tqbench.kernels.reference import dense_partials, merge_partials


def _slice_units(payload: dict, start: int, stop: int) -> dict:
    return {name: t[:, :, start:stop] for name, t in payload.items()}


def kernel_mask(attention_mask: torch.Tensor | None, seq: int, total: int, device) -> torch.Tensor | str | None:
    """The Triton kernels' mask: ``bool_mask``, with the causal mask spelled out when there is none (None for one
    query row: it attends to every row), or the string saying why the kernels cannot take it."""
    mask = bool_mask(attention_mask, seq, total)
    if mask is None and seq > 1:
        return torch.ones(seq, total, dtype=torch.bool, device=device).tril(total - seq)[None]
    return mask


def _extra_rows(store, part, common: int, dt) -> torch.Tensor | None:
    """Dense rows of a store's packed run beyond the common range (decoded for this call)."""
    n = part[1]
    if n == common:
        return None
    tpu = store.codec.tokens_per_unit
    first = common // tpu
    rows = store.codec.decode(_slice_units(part[2], first, -(-n // tpu)), store.state, dt)
    return rows[:, :, common - first * tpu : n - first * tpu]


def triton_fused_attention(query: torch.Tensor, kv, attention_mask, scaling: float) -> torch.Tensor:
    b, hq, seq, d = query.shape
    layer = kv.layer
    kb, kp, ka = layout(kv.k_parts)
    vb, vp, va = layout(kv.v_parts)
    dt = compute_dtype(query.dtype)
    hb = sum(x.shape[2] for x in kb)
    if kp is None or vp is None or hb != sum(x.shape[2] for x in vb):
        layer.note_fallback("triton: one side has no packed rows or the sink counts differ (torch reference)")
        return reference_fused_attention(query, kv, attention_mask, scaling)
    common = min(kp[1], vp[1])
    k_side = packed_side(kv.k_store, _slice_units(kp[2], 0, common // kv.k_store.codec.tokens_per_unit),
                         common, d, torch.float32)
    v_side = packed_side(kv.v_store, _slice_units(vp[2], 0, common // kv.v_store.codec.tokens_per_unit),
                         common, d, torch.float32)
    if k_side is None or v_side is None:
        spec = (kv.k_store if k_side is None else kv.v_store).codec.spec
        layer.note_fallback(f"triton: no kernel for {spec} (torch reference)")
        return reference_fused_attention(query, kv, attention_mask, scaling)
    total = kv.shape[2] + kv.extra_rows  # (a verification call's column sets come after the call's rows)
    mask = kernel_mask(attention_mask, seq, total, query.device)
    if isinstance(mask, str):
        layer.note_fallback(f"triton: {mask} (torch reference)")
        return reference_fused_attention(query, kv, attention_mask, scaling)
    k_extra = _extra_rows(kv.k_store, kp, common, query.dtype)
    v_extra = _extra_rows(kv.v_store, vp, common, query.dtype)
    for store, extra in ((kv.k_store, k_extra), (kv.v_store, v_extra)):
        if extra is not None:
            layer.note_fallback(f"triton: decoded {store.codec.spec} rows beyond the common packed range")
    # full-precision (or just-decoded) rows of both sides, same token order: [sinks | beyond common | rest]
    k_rows = [*kb, *([k_extra] if k_extra is not None else []), *ka, kv.new_k]
    v_rows = [*vb, *([v_extra] if v_extra is not None else []), *va, kv.new_v]
    if kv.extra_k is not None:
        k_rows, v_rows = k_rows + [kv.extra_k], v_rows + [kv.extra_v]
    k_dense, v_dense = torch.cat(k_rows, dim=2), torch.cat(v_rows, dim=2)
    if k_dense.shape[2] != v_dense.shape[2] or k_dense.shape[2] + common != total:
        raise RuntimeError(f"fused layout mismatch: {k_dense.shape[2]} + {common} rows vs {total} tokens")
    p_mask = d_mask = None
    if mask is not None:
        mask = mask.expand(b, seq, total)
        p_mask = mask[:, :, hb : hb + common]
        d_mask = torch.cat([mask[:, :, :hb], mask[:, :, hb + common :]], dim=-1)
    packed = packed_attention(query, k_side, v_side, p_mask, scaling)
    dense = dense_partials(query, k_dense, v_dense, d_mask, scaling)
    out, _ = merge_partials([packed, (dense[0].to(torch.float32), dense[1].to(torch.float32))])
    return out.to(query.dtype) if dt == torch.float32 else out.to(dt).to(query.dtype)
