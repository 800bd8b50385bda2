"""The native CPU path of the ``fused`` cache mode: a layer's store handed to ``tqbench.kernels.cpu``.

The kernel reads the packed codes where they are stored (no decoded copy, no code index); the layer's
full-precision rows ``[sinks | tail + this call's rows]`` are joined once per call (a few dozen rows).
``native_fused_attention`` returns a string saying why when a call cannot run natively (a codec without a
packed form, a per-head or additive mask); the caller then runs the torch reference and counts the fallback.
"""

from __future__ import annotations

import torch

from tqbench.engine.cache.fused.layout import layout, packed_side


def _bool_mask(attention_mask, seq: int, total: int):
    """``[B, L, total]`` bool (True = attend), ``None`` (no mask), or a string saying why the kernel cannot."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
        return "per-head attention masks"
    m = attention_mask[:, 0, -seq:, -total:]
    if m.dtype == torch.bool:
        return m
    keep = m == 0
    if not bool((keep | (m <= torch.finfo(m.dtype).min / 2)).all()):
        return "an additive attention bias (not a 0/-inf mask)"
    return keep


def native_fused_attention(query: torch.Tensor, kv, attention_mask, scaling: float, *, softcap=None,
                           sinks=None, sparse_v: float = 0.0):
    """Attention of ``query`` [B, Hq, L, D] over the stored + new rows, or ``str`` (why not) when it cannot run."""
    from tqbench.kernels.cpu.attention import native_attention

    d, dv = query.shape[-1], kv.new_v.shape[-1]
    dt = torch.float64 if query.dtype == torch.float64 else torch.float32
    kb, kp, ka = layout(kv.k_parts)
    vb, vp, va = layout(kv.v_parts)
    k_side = v_side = None
    if kp is not None and (k_side := packed_side(kv.k_store, kp[2], kp[1], d, dt)) is None:
        return f"no native kernel for {kv.k_store.codec.spec}"
    if vp is not None and (v_side := packed_side(kv.v_store, vp[2], vp[1], dv, dt)) is None:
        return f"no native kernel for {kv.v_store.codec.spec}"
    k_dense = torch.cat([x.to(dt) for x in (*kb, *ka, kv.new_k)], dim=2)
    v_dense = torch.cat([x.to(dt) for x in (*vb, *va, kv.new_v)], dim=2)
    total = k_dense.shape[2] + (kp[1] if kp else 0)
    mask = _bool_mask(attention_mask, query.shape[2], total)
    if isinstance(mask, str):
        return mask
    nbk = sum(x.shape[2] for x in kb) if kp else 0
    nbv = sum(x.shape[2] for x in vb) if vp else 0
    out, call = native_attention(query, k_side, v_side, k_dense, v_dense, nbk, nbv, mask, scaling,
                                 softcap=softcap, sinks=sinks, sparse_v=sparse_v)
    layer = kv.layer
    layer.native_workspace = max(layer.native_workspace, call.workspace_bytes)
    layer.sparse_v_rows[0] += call.skipped_rows
    layer.sparse_v_rows[1] += call.weighted_rows
    return out
