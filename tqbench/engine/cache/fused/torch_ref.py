"""The torch implementation of a ``fused`` attention call (the CPU path; the Triton path's fallback).

One softmax over ``[dense before | packed | dense after + new]``: turbo keys score in the rotated domain
(``q.k = n * (R q).c[idx] + q.mu``, query rotated once), codes decoded straight from the packed bytes through
a per-codec byte table; turbo values accumulate in the rotated domain and the output is rotated back once;
affine keys/values are dequantized in blocks inside the call. Codecs without a fused form (QJL, outlier
split) are decoded inside the call and counted as a fallback.

Per-call attention features of the families: ``softcap`` (Gemma-2: scores -> tanh(s / cap) * cap, before the
mask), ``sinks`` (gpt-oss: one logit per query head in the softmax denominator, taking no value), K and V
with different head dims (the output has V's). Sliding windows arrive in the mask.
"""

from __future__ import annotations

import torch

from tqbench.engine.cache.fused.layout import cat_rows, layout, packed_side
from tqbench.engine.cache.handles import FusedKV
from tqbench.engine.codecs.base import compute_dtype
from tqbench.kernels.reference import packed_scores, packed_values


def reference_fused_attention(query: torch.Tensor, kv: FusedKV, attention_mask, scaling: float, *,
                              softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The torch implementation (CPU): one softmax over [dense before | packed | dense after + new]."""
    b, hq, seq, d = query.shape
    hkv = kv.new_k.shape[1]
    dv = kv.new_v.shape[-1]
    g = hq // hkv
    dt = compute_dtype(query.dtype)
    layer = kv.layer
    q = (query.to(dt) * scaling).reshape(b, hkv, g * seq, d)
    kb, kp, ka = layout(kv.k_parts)
    vb, vp, va = layout(kv.v_parts)
    ka, va = ka + [kv.new_k], va + [kv.new_v]
    if kv.extra_k is not None:  # a verification call's column sets (``precision.py``), after the call's rows
        ka, va = ka + [kv.extra_k], va + [kv.extra_v]

    s_fp = q @ cat_rows(kb + ka, dt).transpose(-1, -2)
    if kp is None:
        scores = s_fp
    else:
        side = packed_side(kv.k_store, kp[2], kp[1], d, dt)
        if side is None:
            layer.note_fallback(f"dequantize-in-attention:{kv.k_store.codec.spec}")
            s_p = q @ kv.k_store.codec.decode(kp[2], kv.k_store.state, dt).transpose(-1, -2)
        else:
            s_p = packed_scores(q, side)
        nb = sum(x.shape[2] for x in kb)
        scores = torch.cat([s_fp[..., :nb], s_p, s_fp[..., nb:]], dim=-1) if nb else torch.cat([s_p, s_fp], -1)
    total = scores.shape[-1]
    scores = scores.view(b, hkv, g, seq, total)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        mask = attention_mask[:, :, -seq:, -total:]
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
        else:
            scores = scores + mask[:, :, None].to(dt)
    elif seq > 1:  # (a verification call always has a mask: its column sets are not causal)
        causal = torch.ones(seq, total, dtype=torch.bool, device=q.device).tril(total - seq)
        scores = scores.masked_fill(~causal, float("-inf"))
    if sinks is not None:
        sink = sinks.to(device=scores.device, dtype=dt).view(1, hkv, g, 1, 1).expand(b, hkv, g, seq, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :total]
    else:
        probs = torch.softmax(scores, dim=-1)
    if attention_mask is not None:  # fully masked rows (left padding) give zeros, as SDPA does
        probs = probs.nan_to_num(0.0)
    probs = probs.view(b, hkv, g * seq, total)

    if vp is None:
        out = probs @ cat_rows(vb + va, dt)
    else:
        nb = sum(x.shape[2] for x in vb)
        p_p = probs[..., nb : nb + vp[1]]
        p_fp = torch.cat([probs[..., :nb], probs[..., nb + vp[1]:]], dim=-1) if nb else probs[..., vp[1]:]
        out = p_fp @ cat_rows(vb + va, dt)
        side = packed_side(kv.v_store, vp[2], vp[1], dv, dt)
        if side is None:
            layer.note_fallback(f"dequantize-in-attention:{kv.v_store.codec.spec}")
            out = out + p_p @ kv.v_store.codec.decode(vp[2], kv.v_store.state, dt)
        else:
            out = out + packed_values(p_p, side)
    return out.view(b, hq, seq, dv).to(query.dtype)
