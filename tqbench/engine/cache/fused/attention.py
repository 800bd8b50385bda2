"""The ``fused`` cache mode's attention: read the packed store directly, never a dense K/V copy.

``install_fused_attention(model)`` registers an attention implementation with transformers
(``AttentionInterface`` + the sdpa mask builder) and switches the model to it, so plain ``model.generate()``
and a manual decode loop both use it. Calls that carry plain tensors (a ``DynamicCache`` baseline, no
cache) go to transformers' own SDPA unchanged, so one model serves baseline and candidate runs alike.
Calls that carry a ``FusedKV`` handle are computed from the store:

- turbo keys score in the rotated domain: ``q.k = n * (R q).c[idx] + q.mu`` (query rotated once), codes
  decoded straight from the packed bytes through a per-codec byte table;
- turbo values accumulate in the rotated domain and the output is rotated back once;
- affine keys/values are dequantized in blocks inside the call; the full-precision rows (sinks, recent
  window, this call's new rows) go through one small matmul;
- codecs without a fused form (QJL, outlier split) are decoded inside the call: counted as a fallback.

Which implementation ran is counted per call (``TQLayer.fused_impl``): ``triton`` (GPU kernels in
``tqbench.kernels``) or ``torch-reference`` with the reason. Triton is imported lazily, only when a call
could use it. A prefill with no history attends exactly over the new rows through SDPA.
"""

from __future__ import annotations

import os

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from tqbench.engine.cache.tqcache import FusedKV
from tqbench.engine.codecs import AffineChannelCodec, AffineTokenCodec, TurboCodec
from tqbench.engine.codecs.base import compute_dtype
from tqbench.kernels.reference import PackedSide, packed_scores, packed_values

ATTN_NAME = "tqbench_fused"
IMPL_ENV = "TQBENCH_FUSED_IMPL"  # "auto" (default), "torch" or "triton" (forces the kernels, e.g. interpreter)
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


# -- which implementation ------------------------------------------------------------------------------
def choose_impl(query: torch.Tensor) -> tuple[str, str]:
    """``(impl, why)``: ``triton`` on a CUDA device with triton installed, else the torch reference."""
    want = os.environ.get(IMPL_ENV, "auto").strip().lower() or "auto"
    if want not in ("auto", "torch", "triton"):
        raise ValueError(f"{IMPL_ENV}={want!r} is invalid: use auto, torch or triton")
    if want == "torch":
        return "torch-reference", f"{IMPL_ENV}=torch"
    if query.dtype == torch.float64:
        return "torch-reference", "float64 activations (the kernels compute in fp32)"
    if want == "auto" and query.device.type != "cuda":
        return "torch-reference", f"{query.device.type} device (the triton kernels need a GPU)"
    from tqbench.kernels import triton_status

    ok, why = triton_status()
    if not ok:
        if want == "triton":
            raise RuntimeError(f"{IMPL_ENV}=triton but {why}")
        return "torch-reference", why
    return "triton", f"{IMPL_ENV}=triton" if want == "triton" else "cuda device"


# -- packed sides --------------------------------------------------------------------------------------
def packed_side(store, payload: dict, n: int, d: int, dt: torch.dtype) -> PackedSide | None:
    """The fused description of a store's packed rows, or None when its codec has no fused form."""
    codec = store.codec
    state = store.state or {}
    if type(codec) is TurboCodec:
        return PackedSide(
            "turbo", codec.bits, payload, n, d, levels=codec.codebook_tensor(payload["idx"].device, dt, d),
            rotation=codec.rotation_tensor(payload["idx"].device, dt, d), mu=state.get("mu"),
        )
    if type(codec) is AffineChannelCodec:
        return PackedSide("affine-channel", codec.bits, payload, n, d, group=codec.block)
    if type(codec) is AffineTokenCodec and d % codec.group == 0:
        return PackedSide("affine-token", codec.bits, payload, n, d, group=codec.group)
    return None


def _layout(parts: tuple) -> tuple[list, tuple | None, list]:
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


def _cat(rows: list[torch.Tensor], dt: torch.dtype) -> torch.Tensor:
    out = rows[0] if len(rows) == 1 else torch.cat(rows, dim=2)
    return out if out.dtype == dt else out.to(dt)


def fused_attention(query: torch.Tensor, kv: FusedKV, attention_mask, scaling: float) -> torch.Tensor:
    """Attention of ``query`` [B, Hq, L, D] over the stored rows plus this call's new rows."""
    impl, why = choose_impl(query)
    layer = kv.layer
    label = "triton" if impl == "triton" else f"torch-reference ({why})"
    layer.fused_impl[label] = layer.fused_impl.get(label, 0) + 1
    if impl == "triton":
        from tqbench.engine.cache.fused.triton_glue import triton_fused_attention

        return triton_fused_attention(query, kv, attention_mask, scaling)
    return reference_fused_attention(query, kv, attention_mask, scaling)


def reference_fused_attention(query: torch.Tensor, kv: FusedKV, attention_mask, scaling: float) -> torch.Tensor:
    """The torch implementation (CPU): one softmax over [dense before | packed | dense after + new]."""
    b, hq, seq, d = query.shape
    hkv = kv.new_k.shape[1]
    g = hq // hkv
    dt = compute_dtype(query.dtype)
    layer = kv.layer
    q = (query.to(dt) * scaling).reshape(b, hkv, g * seq, d)
    kb, kp, ka = _layout(kv.k_parts)
    vb, vp, va = _layout(kv.v_parts)
    ka, va = ka + [kv.new_k], va + [kv.new_v]

    s_fp = q @ _cat(kb + ka, dt).transpose(-1, -2)
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
    probs = probs.view(b, hkv, g * seq, total)

    if vp is None:
        out = probs @ _cat(vb + va, dt)
    else:
        nb = sum(x.shape[2] for x in vb)
        p_p = probs[..., nb : nb + vp[1]]
        p_fp = torch.cat([probs[..., :nb], probs[..., nb + vp[1]:]], dim=-1) if nb else probs[..., vp[1]:]
        out = p_fp @ _cat(vb + va, dt)
        side = packed_side(kv.v_store, vp[2], vp[1], d, dt)
        if side is None:
            layer.note_fallback(f"dequantize-in-attention:{kv.v_store.codec.spec}")
            out = out + p_p @ kv.v_store.codec.decode(vp[2], kv.v_store.state, dt)
        else:
            out = out + packed_values(p_p, side)
    return out.view(b, hq, seq, d).to(query.dtype)
