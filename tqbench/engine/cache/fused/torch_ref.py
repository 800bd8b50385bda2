"""The torch implementation of a ``fused`` attention call (the CPU path; the Triton path's fallback).

One softmax over ``[dense before | packed | dense after + new]`` (after a demote tier's rows, ``FusedKV.tier``, when
token eviction keeps its evicted rows at a cheaper codec: the same reading of another store): turbo keys score in the rotated domain
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


def _segment_scores(q, store, parts, after: list, d: int, dt, layer) -> torch.Tensor:
    """Scores ``[b, hkv, g*seq, n]`` of one store's rows ``[dense before | packed | dense after + after]``."""
    kb, kp, ka = layout(parts)
    rows = kb + ka + after
    s_fp = q @ cat_rows(rows, dt).transpose(-1, -2) if rows else None
    if kp is None:
        return s_fp
    side = packed_side(store, kp[2], kp[1], d, dt)
    if side is None:
        layer.note_fallback(f"dequantize-in-attention:{store.codec.spec}")
        s_p = q @ store.codec.decode(kp[2], store.state, dt).transpose(-1, -2)
    else:
        s_p = packed_scores(q, side)
    if s_fp is None:
        return s_p
    nb = sum(x.shape[2] for x in kb)
    return torch.cat([s_fp[..., :nb], s_p, s_fp[..., nb:]], dim=-1) if nb else torch.cat([s_p, s_fp], -1)


def _segment_values(probs, store, parts, after: list, dv: int, dt, layer) -> torch.Tensor:
    """``probs`` ``[b, hkv, g*seq, n]`` over one store's rows (as ``_segment_scores``) times its values."""
    vb, vp, va = layout(parts)
    rows = vb + va + after
    if vp is None:
        return probs @ cat_rows(rows, dt)
    nb = sum(x.shape[2] for x in vb)
    p_p = probs[..., nb : nb + vp[1]]
    out = None
    if rows:
        p_fp = torch.cat([probs[..., :nb], probs[..., nb + vp[1]:]], dim=-1) if nb else probs[..., vp[1]:]
        out = p_fp @ cat_rows(rows, dt)
    side = packed_side(store, vp[2], vp[1], dv, dt)
    if side is None:
        layer.note_fallback(f"dequantize-in-attention:{store.codec.spec}")
        o_p = p_p @ store.codec.decode(vp[2], store.state, dt)
    else:
        o_p = packed_values(p_p, side)
    return o_p if out is None else out + o_p


def reference_fused_attention(query: torch.Tensor, kv: FusedKV, attention_mask, scaling: float, *,
                              softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The torch implementation (CPU): one softmax over [demote tier | dense before | packed | dense after + new]."""
    b, hq, seq, d = query.shape
    hkv = kv.new_k.shape[1]
    dv = kv.new_v.shape[-1]
    g = hq // hkv
    dt = compute_dtype(query.dtype)
    layer = kv.layer
    q = (query.to(dt) * scaling).reshape(b, hkv, g * seq, d)
    ka, va = [kv.new_k], [kv.new_v]
    if kv.extra_k is not None:  # a verification call's column sets (``precision.py``), after the call's rows
        ka, va = ka + [kv.extra_k], va + [kv.extra_v]
    tier = kv.tier
    scores = _segment_scores(q, kv.k_store, kv.k_parts, ka, d, dt, layer)
    if tier is not None:  # the demote tier's rows come first (their own codec)
        scores = torch.cat([_segment_scores(q, tier.k_store, tier.k_parts, [], d, dt, layer), scores], dim=-1)
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
    n_tier = kv.tier_rows
    out = _segment_values(probs[..., n_tier:], kv.v_store, kv.v_parts, va, dv, dt, layer)
    if tier is not None:
        out = out + _segment_values(probs[..., :n_tier], tier.v_store, tier.v_parts, [], dv, dt, layer)
    return out.view(b, hq, seq, dv).to(query.dtype)
