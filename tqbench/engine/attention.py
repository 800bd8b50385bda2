"""The ``fused`` cache mode's attention: read the packed store directly, never a dense K/V copy.

``install_fused_attention(model)`` registers an attention implementation with transformers
(``AttentionInterface`` + the sdpa mask builder) and switches the model to it. Calls that carry plain
tensors (a ``DynamicCache`` baseline, no cache) go to transformers' own SDPA unchanged, so one model serves
baseline and candidate runs alike. Calls that carry a ``FusedKV`` handle are computed from the store:

- turbo keys score in the rotated domain: ``q.k = n * (R q).c[idx] + q.mu`` (query rotated once);
- turbo values accumulate in the rotated domain and the output is rotated back once;
- other packed codecs (affine, QJL, outlier split) are dequantized chunk-wise inside the attention call.

A prefill with no history attends exactly over the new rows through SDPA. This module is the torch
reference of the fused path (it is what runs on CPU). The report counts fused
calls and names each packed codec that went through the dequantize-in-attention path.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from tqbench.engine.cache import FusedKV
from tqbench.engine.codecs import TurboCodec
from tqbench.engine.codecs.base import compute_dtype

ATTN_NAME = "tqbench_fused"
_registered = False


def install_fused_attention(model) -> None:
    global _registered
    if not _registered:
        AttentionInterface.register(ATTN_NAME, fused_attention_forward)
        AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
        _registered = True
    if getattr(model.config, "_attn_implementation", None) != ATTN_NAME:
        model.set_attn_implementation(ATTN_NAME)


def fused_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                            is_causal=None, **kwargs):
    if not isinstance(key, FusedKV):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    if not key.k_parts and not key.v_parts:  # prefill with no history: exact attention on the new rows
        return sdpa_attention_forward(module, query, key.new_k, key.new_v, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    key.layer.fused_calls += 1
    out = fused_attention(query, key, attention_mask, scaling if scaling is not None else query.shape[-1] ** -0.5)
    return out.transpose(1, 2).contiguous(), None


def _is_rotated_turbo(codec) -> bool:
    return type(codec) is TurboCodec


def _scores(q: torch.Tensor, part, codec, state, dt) -> torch.Tensor:
    """q: [B, Hkv, G, L, D] -> scores [B, Hkv, G, L, n] for one stored part."""
    kind, _, payload = part
    if kind == "dense":
        return torch.einsum("bhgld,bhnd->bhgln", q, payload.to(dt))
    if _is_rotated_turbo(codec):
        rot = codec.rotation_tensor(device=q.device, dtype=dt, head_dim=q.shape[-1])
        q_rot = q @ rot.T
        s = torch.einsum("bhgld,bhnd->bhgln", q_rot, codec.codebook_values(payload, q.shape[-1], dt)) * payload["norm"].to(dt)[..., 0][:, :, None, None, :]
        if state and "mu" in state:
            s = s + torch.einsum("bhgld,bhd->bhgl", q, state["mu"].to(dt)[:, :, 0])[..., None]
        return s
    k = codec.decode(payload, state, dt)
    return torch.einsum("bhgld,bhnd->bhgln", q, k)


def _values(p: torch.Tensor, part, codec, state, dt, d: int) -> torch.Tensor:
    """p: [B, Hkv, G, L, n] -> p @ V for one stored part, [B, Hkv, G, L, D]."""
    kind, _, payload = part
    if kind == "dense":
        return torch.einsum("bhgln,bhnd->bhgld", p, payload.to(dt))
    if _is_rotated_turbo(codec):
        rot = codec.rotation_tensor(device=p.device, dtype=dt, head_dim=d)
        pw = p * payload["norm"].to(dt)[..., 0][:, :, None, None, :]
        out = torch.einsum("bhgln,bhnd->bhgld", pw, codec.codebook_values(payload, d, dt)) @ rot
        if state and "mu" in state:
            out = out + p.sum(-1, keepdim=True) * state["mu"].to(dt)[:, :, None]
        return out
    v = codec.decode(payload, state, dt)
    return torch.einsum("bhgln,bhnd->bhgld", p, v)


def fused_attention(query: torch.Tensor, kv: FusedKV, attention_mask, scaling: float) -> torch.Tensor:
    """Attention of ``query`` [B, Hq, L, D] over the stored rows plus this call's new rows."""
    b, hq, seq, d = query.shape
    hkv = kv.new_k.shape[1]
    g = hq // hkv
    dt = compute_dtype(query.dtype)
    q = query.reshape(b, hkv, g, seq, d).to(dt)
    layer = kv.layer
    k_parts = list(kv.k_parts) + [("dense", kv.new_k.shape[2], kv.new_k)]
    v_parts = list(kv.v_parts) + [("dense", kv.new_v.shape[2], kv.new_v)]
    for codec, parts in ((kv.k_store.codec, k_parts), (kv.v_store.codec, v_parts)):
        if any(p[0] == "packed" for p in parts) and not _is_rotated_turbo(codec):
            layer.note_fallback(f"dequantize-in-attention:{codec.spec}")
    scores = torch.cat([_scores(q, part, kv.k_store.codec, kv.k_store.state, dt) for part in k_parts], -1)
    scores = scores * scaling
    total = scores.shape[-1]
    if attention_mask is not None:
        mask = attention_mask[:, :, -seq:, -total:]
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
        else:
            scores = scores + mask[:, :, None].to(dt)
    elif seq > 1:
        causal = torch.ones(seq, total, dtype=torch.bool, device=q.device).tril(total - seq)
        scores = scores.masked_fill(~causal, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if attention_mask is not None:  # fully masked rows (left padding) give zeros, as SDPA does
        probs = probs.nan_to_num(0.0)
    out = None
    start = 0
    for part in v_parts:
        n = part[1]
        o = _values(probs[..., start : start + n], part, kv.v_store.codec, kv.v_store.state, dt, d)
        out = o if out is None else out + o
        start += n
    return out.reshape(b, hq, seq, d).to(query.dtype)
