"""llama.cpp's CPU flash attention (``ggml_compute_forward_flash_attn_ext_f16``, ggml-cpu ``ops.cpp``), in torch.

What the engine computes for a ``-ctk K -ctv V -fa on`` cache, read in llama.cpp 11434's source:

- The cache holds what ``set_rows`` wrote: the CPU ``from_float`` of the type (x86: ``quantize_row_q8_0`` is the
  AVX one, ``x * (127/amax)`` rounded half to even; the 4/5-bit types and ``iq4_nl`` are the reference
  quantizers, ``codecs.ggml``), ``f16`` rounds to half precision.
- Batches of at least ``GGML_FA_TILE_Q`` queries with an ``f16`` (or ``f32``) K and V of the same type take the
  tiled path: Q stays fp32, K/V are widened to fp32, scores, softmax and the V sum in fp32. Every other case
  (a quantized K or V, a mixed pair, single-token decode) takes ``_one_chunk``: Q is converted to the K type's
  ``vec_dot_type`` (``q8_0`` blocks for q8_0/q4_0/q5_0/iq4_nl, ``q8_1`` for q4_1/q5_1, fp16 for f16), scores
  are that block dot product (for the ``_1`` types plus ``m_k * s_q`` with ``s_q`` the fp16 block sum of the
  query), softmax online in fp32, V accumulated in fp32 when V is quantized (in fp16 when V is f16: not
  modelled here, ``f16_v_accumulation`` says so).
- Every query of a batch reads the cache as stored, its own row included.
- A quantized K (V) cache holds its rows rotated by a Hadamard matrix (``llama_kv_cache``, ``ggml_gen_hadamard``;
  the environment variable ``LLAMA_ATTN_ROT_DISABLE=1`` turns it off) when the type is quantized and head_dim is a
  multiple of 64: for K in blocks of ``n_rot_k`` = 64 doubled while head_dim is a multiple of twice it (256 for
  Gemma-3's head_dim 256), for V in blocks of ``n_rot_v`` = 64. The query is rotated as K before its conversion,
  and the attention output is rotated back for V. Modelled with the normalized Sylvester matrix.
- Sliding-window layers (``LLAMA_SWA_TYPE_STANDARD``: Gemma-2/3, Mistral) mask a key ``p0`` for a query ``p1``
  when ``p1 - p0 >= n_swa``; transformers' window (``q - kv < sliding_window``) is the same set.
- Gemma-2/3 scale the query by ``f_attention_scale`` in the model graph before attention (``kq_scale`` 1), so
  the query the K type's dot product quantizes is the scaled one (``QUERY_SCALED_FIRST``); Gemma-2's
  ``attn_logit_softcapping`` is applied to the scaled scores (``softcap * tanh(s / softcap)``).

``LLAMACPP_ATTN`` is registered with transformers' ``AttentionInterface``; ``llamacpp_kv(model, k, v)`` switches a
model to it for a block. One sequence per call, no cache (the whole chunk in one forward, as llama-perplexity's
chunk reads its own cache), causal.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tqbench.engine.codecs.ggml import GGML_TYPES, QK, dequantize_blocks, quantize_blocks

__all__ = ["LLAMACPP_ATTN", "VEC_DOT_TYPE", "f16_v_accumulation", "llamacpp_kv", "quantize_row_q8",
           "query_as_vec_dot", "stored"]

LLAMACPP_ATTN = "tqbench-llamacpp-cpu"
#: ggml-cpu type_traits_cpu[K].vec_dot_type: what the query is converted to before the K dot product
VEC_DOT_TYPE = {"f32": "f32", "f16": "f16", "bf16": "bf16", "q8_0": "q8_0", "q4_0": "q8_0", "q5_0": "q8_0",
                "iq4_nl": "q8_0", "q4_1": "q8_1", "q5_1": "q8_1"}
_TILED = ("f32", "f16")  # K = V of these types take the tiled (all-fp32) path for a batch of queries


def quantize_row_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ggml-cpu's x86 ``quantize_row_q8_0`` / ``quantize_row_q8_1`` on rows ``[..., n*32]`` (fp32): per block of
    32, ``d = amax/127`` stored as fp16, ``q = round_half_even(x * (127/amax))``, and (q8_1) ``s = fp16(d_fp32 *
    sum(q))``. Returns ``(d [..., n] as fp32 of the fp16, q [..., n, 32] int8, s [..., n] fp32 of the fp16)``."""
    xb = x.to(torch.float32).reshape(*x.shape[:-1], -1, QK)
    amax = xb.abs().amax(-1)
    d = amax / 127
    inv = torch.where(amax != 0, 127 / torch.where(amax != 0, amax, 1), 0)
    q = torch.round(xb * inv.unsqueeze(-1))  # torch.round: half to even, as _mm256_round_ps(_MM_ROUND_NEAREST)
    s = (d * q.sum(-1)).to(torch.float16).to(torch.float32)
    return d.to(torch.float16).to(torch.float32), q.to(torch.int8), s


def query_as_vec_dot(q: torch.Tensor, k_type: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The query as the K type's dot product reads it: ``(values [..., D] fp32, s [..., D/32] or None)``; ``s``
    is the q8_1 block sum the ``_1`` types' dot product uses for their minimum (``m_k * s``), in place of
    ``m_k * sum(values)``."""
    vt = VEC_DOT_TYPE[k_type]
    if vt == "f32":
        return q.to(torch.float32), None
    if vt in ("f16", "bf16"):
        return q.to(torch.float16 if vt == "f16" else torch.bfloat16).to(torch.float32), None
    d, qi, s = quantize_row_q8(q)
    vals = (qi.to(torch.float32) * d.unsqueeze(-1)).reshape(q.shape)
    return vals, (s if vt == "q8_1" else None)


def stored(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the cache holds for rows ``x [..., D]`` of type ``kind``, read back as fp32, and the per-block
    minimum ``m [..., D/32]`` of a ``_1`` type (else None)."""
    if kind == "f32":
        return x.to(torch.float32), None
    if kind in ("f16", "bf16"):
        return x.to(torch.float16 if kind == "f16" else torch.bfloat16).to(torch.float32), None
    if kind not in GGML_TYPES:
        raise ValueError(f"{kind!r} is not a llama.cpp KV type: valid types are f32, f16, bf16, "
                         f"{', '.join(GGML_TYPES)}")
    xb = x.to(torch.float32).reshape(-1, QK)
    if kind == "q8_0":  # the x86 set_rows quantizer (AVX), not the _ref one
        d, qi, _ = quantize_row_q8(xb)
        vals = qi.to(torch.float32).reshape(-1, QK) * d.reshape(-1, 1)
        return vals.reshape(x.shape), None
    raw = quantize_blocks(kind, xb)
    vals = dequantize_blocks(kind, raw).reshape(x.shape)
    if kind in ("q4_1", "q5_1"):
        m = raw[:, 2:4].contiguous().view(torch.float16).to(torch.float32)
        return vals, m.reshape(*x.shape[:-1], -1)
    return vals, None


def f16_v_accumulation(k_type: str, v_type: str) -> bool:
    """True where llama.cpp sums V in fp16 for a batch (a quantized K with an f16 V): not modelled here."""
    return v_type == "f16" and k_type not in _TILED


_current: dict = {}
ROT = 64  # llama.cpp's smallest rotation block for a quantized cache (n_rot_v is always 64)
#: architectures (``config.model_type``) whose llama.cpp graph scales the query before attention (kq_scale 1)
QUERY_SCALED_FIRST = ("gemma2", "gemma3", "gemma3_text")


def n_rot_k(head_dim: int) -> int:
    """llama.cpp's K rotation block for ``head_dim`` (a multiple of 64): 64, doubled while head_dim is a multiple of
    twice it (``llama_kv_cache``: ``n_rot_k``)."""
    n = ROT
    while head_dim % (2 * n) == 0:
        n *= 2
    return n


def hadamard(n: int = ROT) -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix of order ``n`` (symmetric, its own inverse)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def rotated(kind: str, dim: int) -> bool:
    """True where llama.cpp stores rows of ``kind`` Hadamard-rotated (a quantized type, head_dim % 64 == 0)."""
    return kind in GGML_TYPES and dim % ROT == 0 and not _current.get("no_rot", False)


def _rot(x: torch.Tensor, n: int = ROT) -> torch.Tensor:
    d = x.shape[-1]
    return (x.to(torch.float32).reshape(*x.shape[:-1], d // n, n) @ hadamard(n)).reshape(x.shape)


def _mask(t: int, window: int | None, device) -> torch.Tensor:
    """True where a query (row) may not read a key (column): the future, and with a sliding window a key
    ``window`` or more positions back (llama.cpp's ``LLAMA_SWA_TYPE_STANDARD``)."""
    pos = torch.arange(t, device=device)
    dist = pos[:, None] - pos[None, :]
    masked = dist < 0
    if window:
        masked |= dist >= window
    return masked


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
    """``AttentionInterface`` function: ``query [1, H, T, D]``, ``key``/``value [1, Hkv, T, D]`` (this call's rows,
    no cache) -> ``[1, T, H, D]``, computed as llama.cpp's CPU flash attention with ``_current`` K/V types."""
    k_type, v_type = _current["k"], _current["v"]
    _current["calls"] = _current.get("calls", 0) + 1
    if kwargs.get("s_aux") is not None:
        raise ValueError("the llama.cpp attention model covers causal attention without sinks only (this model's "
                         "attention has sink logits)")
    b, h, t, dk = query.shape
    dtype = query.dtype  # the model's: the output goes back to it (the query may be widened to fp32 below)
    if b != 1 or key.shape[2] != t:
        raise ValueError("the llama.cpp attention model runs one sequence in one forward, without a cache")
    rep = h // key.shape[1]
    scale = scaling if scaling is not None else dk ** -0.5
    arch = getattr(getattr(module, "config", None), "model_type", "")
    if arch in QUERY_SCALED_FIRST:  # the graph scales Q (ggml_scale), then attention runs with kq_scale 1
        query, scale = query.to(torch.float32) * scale, 1.0
    if rotated(k_type, dk):  # the quantized K cache and the query, rotated alike (Q.K unchanged before quantizing)
        query, key = _rot(query, n_rot_k(dk)), _rot(key, n_rot_k(dk))
    rot_v = rotated(v_type, value.shape[-1])
    if rot_v:
        value = _rot(value)
    if k_type == v_type and k_type in _TILED:  # tiled path: fp32 Q, K/V widened from their storage
        qv, s_q = query.to(torch.float32), None
    else:
        qv, s_q = query_as_vec_dot(query, k_type)
    kv, m_k = stored(key, k_type)
    vv, _ = stored(value, v_type)
    kv = kv.repeat_interleave(rep, dim=1)
    vv = vv.repeat_interleave(rep, dim=1)
    scores = qv @ kv.transpose(-1, -2)
    if s_q is not None and m_k is not None:  # the _1 types: m_k * s_q, not m_k * sum(q values)
        nb = dk // QK
        qsum = qv.reshape(b, h, t, nb, QK).sum(-1)
        scores = scores + (s_q - qsum) @ m_k.repeat_interleave(rep, dim=1).transpose(-1, -2)
    scores = scores * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(_mask(t, kwargs.get("sliding_window"), query.device), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = probs @ vv
    if rot_v:
        out = _rot(out)  # the Hadamard matrix is its own inverse
    return out.transpose(1, 2).contiguous().to(dtype), None


def attention_calls() -> int:
    """How many attention calls the llama.cpp model has served inside the current ``llamacpp_kv`` block (0 means
    the model's attention does not go through transformers' ``AttentionInterface``: nothing was modelled)."""
    return int(_current.get("calls", 0))


@contextmanager
def llamacpp_kv(model, k_type: str, v_type: str, rotation: bool = True) -> Iterator[None]:
    """Run ``model``'s attention as llama.cpp's CPU flash attention over a ``k_type``/``v_type`` cache for the
    block (then restore its implementation)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    for kind in (k_type, v_type):
        if kind not in VEC_DOT_TYPE:
            raise ValueError(f"{kind!r} is not a llama.cpp KV type: valid types are {', '.join(VEC_DOT_TYPE)}")
    AttentionInterface.register(LLAMACPP_ATTN, _attention)
    AttentionMaskInterface.register(LLAMACPP_ATTN, sdpa_mask)
    previous = model.config._attn_implementation
    _current.update(k=k_type, v=v_type, no_rot=not rotation, calls=0)
    model.set_attn_implementation(LLAMACPP_ATTN)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
        _current.clear()
