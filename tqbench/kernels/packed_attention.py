"""Decode attention over the packed KV history (Triton): ``_packed_attention_kernel`` and its launcher.

One program handles one (batch, kv head, split): all ``G * L`` queries of that kv head (GQA group x query
tokens) as one tile against a contiguous range of packed rows, so every packed byte is read once per kv
head. Rows are decoded in registers:

- ``turbo``: codes are looked up in the codebook (rotated unit domain); keys score as ``(R q).c[idx] * norm
  (+ q.mu)``, values accumulate ``p * norm * c[idx]`` in the rotated domain (the launcher's caller rotates
  the output back once);
- ``affine-channel`` (KIVI keys) and ``affine-token`` (values): ``zero + code * scale`` per element.

Codes of any width (1..8 bits) are read from the LSB-first stream as a 16-bit window of two bytes. Scores
use an online softmax; each split writes ``(m, l, acc)`` partials that ``packed_attention`` merges
(split-K over long histories). Everything is computed in fp32 (``tl.dot`` with ``input_precision="ieee"``;
fp16/bf16 inputs are upcast in registers, which also keeps bf16 dots off the interpreter's broken path).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tqbench.kernels.reference import KINDS, PackedSide

_KIND_ID = {k: i for i, k in enumerate(KINDS)}  # turbo 0, affine-channel 1, affine-token 2
_NEG = -1.0e30  # finite running max: fully masked rows keep l = 0 instead of producing NaN


@triton.jit
def _codes(ptr, row_off, col, mask, BITS: tl.constexpr, NBYTES: tl.constexpr):
    """Code ``col`` of packed rows at ``ptr + row_off`` (LSB-first bit stream)."""
    pos = col * BITS
    byte = pos // 8
    lo = tl.load(ptr + row_off + byte, mask=mask, other=0).to(tl.int32)
    hi = tl.load(ptr + row_off + byte + 1, mask=mask & (byte + 1 < NBYTES), other=0).to(tl.int32)
    return ((lo | (hi << 8)) >> (pos % 8)) & ((1 << BITS) - 1)


@triton.jit
def _rows(CODES, S, Z, LV, b, h, offs_n, offs_d, n_mask, d_mask,
          sib, sih, sin, ssb, ssh, ssn,
          KIND: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
          NBYTES: tl.constexpr):
    """``(tile [BLOCK_N, BLOCK_D] fp32, row_scale [BLOCK_N] fp32)`` of packed rows ``offs_n``."""
    m2 = n_mask[:, None] & d_mask[None, :]
    if KIND == 0:  # turbo: codebook values (rotated unit rows) and the fp16 norm
        code = _codes(CODES, b * sib + h * sih + offs_n[:, None] * sin, offs_d[None, :], m2, BITS, NBYTES)
        tile = tl.load(LV + code, mask=m2, other=0.0).to(tl.float32)
        scale = tl.load(S + b * ssb + h * ssh + offs_n * ssn, mask=n_mask, other=0.0).to(tl.float32)
    elif KIND == 1:  # affine-channel: unit = GROUP tokens, token-major codes, scale/zero per (unit, channel)
        unit = offs_n // GROUP
        col = (offs_n % GROUP)[:, None] * D + offs_d[None, :]
        code = _codes(CODES, b * sib + h * sih + unit[:, None] * sin, col, m2, BITS, NBYTES)
        sz = b * ssb + h * ssh + unit[:, None] * ssn + offs_d[None, :]
        sc = tl.load(S + sz, mask=m2, other=0.0).to(tl.float32)
        zr = tl.load(Z + sz, mask=m2, other=0.0).to(tl.float32)
        tile = zr + code.to(tl.float32) * sc
        scale = offs_n * 0.0 + 1.0
    else:  # affine-token: scale/zero per (row, group of GROUP channels)
        code = _codes(CODES, b * sib + h * sih + offs_n[:, None] * sin, offs_d[None, :], m2, BITS, NBYTES)
        sz = b * ssb + h * ssh + offs_n[:, None] * ssn + (offs_d // GROUP)[None, :]
        sc = tl.load(S + sz, mask=m2, other=0.0).to(tl.float32)
        zr = tl.load(Z + sz, mask=m2, other=0.0).to(tl.float32)
        tile = zr + code.to(tl.float32) * sc
        scale = offs_n * 0.0 + 1.0
    return tile, scale


@triton.jit
def _packed_attention_kernel(
    Q, QMU, MASK, M_OUT, L_OUT, ACC_OUT,
    KI, KS, KZ, KLV, VI, VS, VZ, VLV,
    N, QN, L, HKV, n_per_split,
    skib, skih, skin, sksb, sksh, sksn,
    svib, svih, svin, svsb, svsh, svsn,
    smb, sml,
    K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr, K_NBYTES: tl.constexpr,
    V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr, V_NBYTES: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_QMU: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    b = (bh // HKV).to(tl.int64)  # int64 offsets: packed stores of long contexts exceed 2**31 bytes
    h = (bh % HKV).to(tl.int64)
    offs_q = tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = offs_q < QN
    d_mask = offs_d < D
    q_base = (bh * QN + offs_q) * D
    q = tl.load(Q + q_base[:, None] + offs_d[None, :], mask=q_mask[:, None] & d_mask[None, :], other=0.0)
    if HAS_QMU:
        qmu = tl.load(QMU + bh * QN + offs_q, mask=q_mask, other=0.0)
    m_i = tl.full((BLOCK_Q,), -1.0e30, tl.float32)
    l_i = tl.zeros((BLOCK_Q,), tl.float32)
    acc = tl.zeros((BLOCK_Q, BLOCK_D), tl.float32)
    start = split * n_per_split
    stop = tl.minimum(start + n_per_split, N)
    for n0 in range(start, stop, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < stop
        kt, ks = _rows(KI, KS, KZ, KLV, b, h, offs_n, offs_d, n_mask, d_mask,
                       skib, skih, skin, sksb, sksh, sksn, K_KIND, K_BITS, K_GROUP, D, K_NBYTES)
        s = tl.dot(q, tl.trans(kt), input_precision="ieee") * ks[None, :]
        if HAS_QMU:
            s = s + qmu[:, None]
        valid = q_mask[:, None] & n_mask[None, :]
        if HAS_MASK:
            l_idx = offs_q % L
            mk = tl.load(MASK + b * smb + l_idx[:, None] * sml + offs_n[None, :], mask=valid, other=0)
            valid = valid & (mk != 0)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt, vs = _rows(VI, VS, VZ, VLV, b, h, offs_n, offs_d, n_mask, d_mask,
                       svib, svih, svin, svsb, svsh, svsn, V_KIND, V_BITS, V_GROUP, D, V_NBYTES)
        acc = acc * alpha[:, None] + tl.dot(p * vs[None, :], vt, input_precision="ieee")
        m_i = m_new
    o_base = (bh * n_splits + split) * QN + offs_q
    tl.store(M_OUT + o_base, m_i, mask=q_mask)
    tl.store(L_OUT + o_base, l_i, mask=q_mask)
    tl.store(ACC_OUT + o_base[:, None] * D + offs_d[None, :], acc, mask=q_mask[:, None] & d_mask[None, :])


# -- launcher ------------------------------------------------------------------------------------------
def _side_tensors(side: PackedSide, b: int, hkv: int, device) -> tuple:
    p = side.payload
    if side.kind == "turbo":
        codes, s, z = p["idx"], p["norm"], p["norm"]
        if side.levels is None:
            raise ValueError("turbo side without codebook levels")
        lv = side.levels.to(device=device, dtype=torch.float32).contiguous()
        rows_per_unit = 1
    else:
        codes, s, z = p["q"], p["scale"], p["zero"]
        lv = codes  # unused
        rows_per_unit = side.group if side.kind == "affine-channel" else 1
    for name, t in (("codes", codes), ("scale/norm", s), ("zero", z)):
        if t.dim() != 4 or t.shape[0] != b or t.shape[1] != hkv:
            raise ValueError(f"{side.kind} {name}: expected [batch={b}, kv_heads={hkv}, units, ...], got {tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{side.kind} {name}: the last dimension must be contiguous (stride {t.stride()})")
        if t.device != torch.device(device) and t.device.type != torch.device(device).type:
            raise ValueError(f"{side.kind} {name} is on {t.device}, the query on {device}")
    if codes.dtype != torch.uint8:
        raise ValueError(f"{side.kind} codes must be uint8, got {codes.dtype}")
    if s.dtype not in (torch.float16, torch.float32) or z.dtype != s.dtype:
        raise ValueError(f"{side.kind} scales/norms must be fp16 or fp32, got {s.dtype}/{z.dtype}")
    d = side.head_dim
    per_unit = d * rows_per_unit
    nbytes = (per_unit * side.bits + 7) // 8
    if codes.shape[-1] != nbytes:
        raise ValueError(f"{side.kind}{side.bits}: expected {nbytes} code bytes per unit, got {codes.shape[-1]}")
    if side.kind == "affine-token" and d % side.group:
        raise ValueError(f"affine-token: head_dim {d} is not a multiple of the group {side.group}")
    units = codes.shape[2]
    if units * rows_per_unit < side.n_tokens:
        raise ValueError(f"{side.kind}: {units} units hold fewer than {side.n_tokens} rows")
    return (codes, s, z, lv, nbytes,
            (codes.stride(0), codes.stride(1), codes.stride(2), s.stride(0), s.stride(1), s.stride(2)))


def packed_attention(
    q: torch.Tensor, k: PackedSide, v: PackedSide, mask: torch.Tensor | None, scale: float,
    *, q_rot: torch.Tensor | None = None, block_n: int | None = None, splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`tqbench.kernels.reference.packed_attention_partials`.

    ``q`` ``[B, Hq, L, D]`` (fp16/bf16/fp32); ``mask`` bool ``[B, L, N]`` or None. Returns ``(out, lse)``
    in fp32, ``out`` in the values' original domain (turbo values are rotated back here, ``+ mu``).
    ``q_rot`` may pass the already rotated query for turbo keys. ``splits`` defaults to enough programs for
    long histories (split-K); the partials are merged here.
    """
    if q.dim() != 4:
        raise ValueError(f"query must be [batch, heads, tokens, head_dim], got {tuple(q.shape)}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"query dtype {q.dtype} is not supported by the kernel (fp16, bf16, fp32)")
    b, hq, seq, d = q.shape
    if k.head_dim != d or v.head_dim != d:
        raise ValueError(f"head_dim mismatch: query {d}, keys {k.head_dim}, values {v.head_dim}")
    if k.n_tokens != v.n_tokens:
        raise ValueError(f"keys hold {k.n_tokens} packed rows, values {v.n_tokens}: pass the common range")
    hkv = (k.payload["idx"] if k.kind == "turbo" else k.payload["q"]).shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads is not a multiple of {hkv} kv heads")
    n = k.n_tokens
    g = hq // hkv
    qn = g * seq
    dev = q.device
    qf = q.to(torch.float32) * scale
    qk = qf
    qmu = None
    if k.kind == "turbo":
        rot = k.rotation.to(device=dev, dtype=torch.float32)
        qk = q_rot.to(torch.float32) * scale if q_rot is not None else qf @ rot.T
        if k.mu is not None:
            qmu = (qf.reshape(b, hkv, qn, d) @ k.mu.to(torch.float32).transpose(-1, -2)).reshape(b, hkv, qn)
            qmu = qmu.contiguous()
    qk = qk.reshape(b, hkv, qn, d).contiguous()
    kt = _side_tensors(k, b, hkv, dev)
    vt = _side_tensors(v, b, hkv, dev)
    if mask is not None:
        if mask.shape != (b, seq, n):
            raise ValueError(f"mask must be [batch={b}, tokens={seq}, packed={n}], got {tuple(mask.shape)}")
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
        mask = mask.to(torch.int8) if mask.dtype == torch.bool else mask
    block_n = block_n or (64 if dev.type == "cuda" else 32)
    block_q = max(16, triton.next_power_of_2(qn))
    block_d = max(16, triton.next_power_of_2(d))
    if splits is None:
        splits = max(1, min(64, math.ceil(n / 1024)))
    per = math.ceil(max(n, 1) / splits / block_n) * block_n
    splits = max(1, math.ceil(n / per))
    m_out = torch.empty(b, hkv, splits, qn, device=dev, dtype=torch.float32)
    l_out = torch.empty_like(m_out)
    acc = torch.empty(b, hkv, splits, qn, d, device=dev, dtype=torch.float32)
    dummy = qk
    _packed_attention_kernel[(b * hkv, splits)](
        qk, qmu if qmu is not None else dummy, mask if mask is not None else dummy, m_out, l_out, acc,
        kt[0], kt[1], kt[2], kt[3], vt[0], vt[1], vt[2], vt[3],
        n, qn, seq, hkv, per,
        *kt[5], *vt[5],
        mask.stride(0) if mask is not None else 0, mask.stride(1) if mask is not None else 0,
        K_KIND=_KIND_ID[k.kind], K_BITS=k.bits, K_GROUP=k.group, K_NBYTES=kt[4],
        V_KIND=_KIND_ID[v.kind], V_BITS=v.bits, V_GROUP=v.group, V_NBYTES=vt[4],
        D=d, BLOCK_D=block_d, BLOCK_Q=block_q, BLOCK_N=block_n,
        HAS_MASK=mask is not None, HAS_QMU=qmu is not None,
    )
    # merge the split partials (m_i is finite: -1e30 where nothing was attended, with l = 0)
    m_all = m_out.amax(dim=2, keepdim=True)
    w = torch.exp(m_out - m_all)
    l_tot = (l_out * w).sum(2)
    acc_tot = (acc * w[..., None]).sum(2)
    out = acc_tot / torch.where(l_tot > 0, l_tot, 1.0)[..., None]
    lse = torch.where(l_tot > 0, m_all[:, :, 0] + torch.log(l_tot), float("-inf"))
    if v.kind == "turbo":
        out = out @ v.rotation.to(device=dev, dtype=torch.float32)
        if v.mu is not None:
            out = torch.where(l_tot[..., None] > 0, out + v.mu.to(torch.float32), out)
    return out.reshape(b, hq, seq, d), lse.reshape(b, hq, seq)
