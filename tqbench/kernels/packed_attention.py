"""Decode attention over the packed KV history (Triton): ``_packed_attention_kernel`` and its launcher.

One program handles one (batch, kv head, split): all ``G * L`` queries of that kv head (GQA group x query
tokens) as one tile against a contiguous range of packed rows, so every packed byte is read once per kv
head. Rows are decoded in registers:

- ``turbo``: codes are looked up in the codebook (rotated unit domain); keys score as ``(R q).c[idx] * norm
  (+ q.mu)``, values accumulate ``p * norm * c[idx]`` in the rotated domain (the launcher's caller rotates
  the output back once);
- ``affine-channel`` (KIVI keys) and ``affine-token`` (values): ``zero + code * scale`` per element;
- ``pcaq`` (calibrated keys): coordinate ``j`` of head ``h`` at its own bit offset and width (the launcher passes
  both as ``[H, D]`` int32 tables in the scale / zero slots), its level from ``levels [H, D, 2**bits]``; keys
  score as ``(T_h q).level[idx] (+ q.mu)``, the query transformed per head by the launcher. Keys only.

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

from tqbench.kernels.layouts import KINDS, layout_of
from tqbench.kernels.reference import PackedSide

_KIND_ID = {k: i for i, k in enumerate(KINDS)}  # turbo 0, affine-channel 1, affine-token 2, pcaq 3
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
    elif KIND == 3:  # pcaq: per-(head, coordinate) bit offset (S) and width (Z), levels per coordinate (LV)
        off = tl.load(S + h * D + offs_d, mask=d_mask, other=0)
        wid = tl.load(Z + h * D + offs_d, mask=d_mask, other=0)
        pos = off[None, :] + offs_n[:, None] * 0
        byte = pos // 8
        row = CODES + b * sib + h * sih + offs_n[:, None] * sin
        lo = tl.load(row + byte, mask=m2 & (byte < NBYTES), other=0).to(tl.int32)
        hi = tl.load(row + byte + 1, mask=m2 & (byte + 1 < NBYTES), other=0).to(tl.int32)
        code = ((lo | (hi << 8)) >> (pos % 8)) & ((1 << wid[None, :]) - 1)
        tile = tl.load(LV + (h * D + offs_d[None, :]) * (1 << BITS) + code, mask=m2, other=0.0).to(tl.float32)
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
def _check_rows(t, name: str, shape: tuple, min_rows: int, dtypes: tuple, device: torch.device) -> None:
    """``t`` is a 4-D ``[batch, kv_heads, >= min_rows, cols]`` tensor of ``dtypes`` on ``device`` whose last
    dimension is contiguous (``shape`` = ``(batch, kv_heads, None, cols)``); else ValueError naming ``name``."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    b, h, _, cols = shape
    if t.dim() != 4 or t.shape[0] != b or t.shape[1] != h or t.shape[3] != cols:
        raise ValueError(f"{name}: expected [batch={b}, kv_heads={h}, units, {cols}], got {tuple(t.shape)}")
    if t.shape[2] < min_rows:
        raise ValueError(f"{name} holds {t.shape[2]} units, fewer than the {min_rows} the side's n_tokens needs")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if cols > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (strides {t.stride()})")
    if t.device.type != device.type:
        raise ValueError(f"{name} is on {t.device}, the query on {device}")


def _side_tensors(side: PackedSide, role: str, b: int, hkv: int, device: torch.device) -> tuple:
    """The kernel arguments of one side, every tensor checked against the query's geometry (errors name
    ``role.field``, e.g. ``k.idx``)."""
    d = side.head_dim
    if side.group < 1:
        raise ValueError(f"{role}.group must be >= 1, got {side.group}")
    if side.n_tokens < 0:
        raise ValueError(f"{role}.n_tokens must be >= 0, got {side.n_tokens}")
    p = side.payload
    if side.kind == "pcaq":
        return _pcaq_tensors(side, role, b, hkv, device)
    fields = layout_of(side.kind).payload_fields
    missing = [f for f in fields if f not in p]
    if missing:
        raise ValueError(f"{role} ({side.kind}) payload lacks {', '.join(missing)}")
    rows_per_unit = side.group if layout_of(side.kind).grouped_rows else 1
    units = -(-side.n_tokens // rows_per_unit)
    nbytes = (d * rows_per_unit * side.bits + 7) // 8
    codes = p[fields[0]]
    _check_rows(codes, f"{role}.{fields[0]}", (b, hkv, None, nbytes), units, (torch.uint8,), device)
    if side.kind == "turbo":
        s = z = p["norm"]
        _check_rows(s, f"{role}.norm", (b, hkv, None, 1), side.n_tokens, (torch.float16, torch.float32), device)
        if side.levels is None or tuple(side.levels.shape) != (1 << side.bits,):
            raise ValueError(f"{role}.levels must hold the {1 << side.bits} codebook values of {side.bits}-bit "
                             f"codes, got {None if side.levels is None else tuple(side.levels.shape)}")
        if side.rotation is None or tuple(side.rotation.shape) != (d, d):
            raise ValueError(f"{role}.rotation must be [{d}, {d}], got "
                             f"{None if side.rotation is None else tuple(side.rotation.shape)}")
        if side.mu is not None and (side.mu.dim() != 4 or side.mu.shape[0] not in (1, b)
                                    or tuple(side.mu.shape[1:]) != (hkv, 1, d)):
            raise ValueError(f"{role}.mu must be [{b} or 1, {hkv}, 1, {d}], got {tuple(side.mu.shape)}")
        lv = side.levels.to(device=device, dtype=torch.float32).contiguous()
    else:
        s, z = p["scale"], p["zero"]
        cols = d if side.kind == "affine-channel" else d // side.group
        if side.kind == "affine-token" and d % side.group:
            raise ValueError(f"{role}: head_dim {d} is not a multiple of the group {side.group}")
        for name, t in (("scale", s), ("zero", z)):
            _check_rows(t, f"{role}.{name}", (b, hkv, None, cols), units, (torch.float16, torch.float32), device)
        if z.dtype != s.dtype or z.stride() != s.stride():  # the kernel reads both with the scale's strides
            raise ValueError(f"{role}.zero must match {role}.scale in dtype and strides: {z.dtype} {z.stride()} vs "
                             f"{s.dtype} {s.stride()}")
        lv = codes  # unused
    return (codes, s, z, lv, nbytes,
            (codes.stride(0), codes.stride(1), codes.stride(2), s.stride(0), s.stride(1), s.stride(2)))


def _pcaq_tensors(side: PackedSide, role: str, b: int, hkv: int, device: torch.device) -> tuple:
    """A pcaq side's kernel arguments: codes, bit offsets and widths (int32 ``[H, D]``), levels ``[H, D, 2**bits]``."""
    d = side.head_dim
    if role != "k":
        raise ValueError(f"{role}: pcaq is a key codec (values have no pcaq form)")
    if "idx" not in side.payload:
        raise ValueError(f"{role} (pcaq) payload lacks idx")
    w = side.widths
    if w is None or tuple(w.shape) != (hkv, d):
        raise ValueError(f"{role}.widths must be [{hkv}, {d}] (bits per coordinate), got "
                         f"{None if w is None else tuple(w.shape)}")
    w = w.to(device=device, dtype=torch.int32)
    if int(w.max()) > side.bits:
        raise ValueError(f"{role}.widths holds {int(w.max())} bits, above the side's bits {side.bits}")
    totals = w.sum(-1)
    if bool((totals != totals[0]).any()):
        raise ValueError(f"{role}.widths: the heads pack {totals.tolist()} bits per row (one row size for all)")
    nbytes = (int(totals[0]) + 7) // 8
    codes = side.payload["idx"]
    _check_rows(codes, f"{role}.idx", (b, hkv, None, nbytes), side.n_tokens, (torch.uint8,), device)
    if side.levels is None or tuple(side.levels.shape) != (hkv, d, 1 << side.bits):
        raise ValueError(f"{role}.levels must be [{hkv}, {d}, {1 << side.bits}], got "
                         f"{None if side.levels is None else tuple(side.levels.shape)}")
    if side.rotation is None or tuple(side.rotation.shape) != (hkv, d, d):
        raise ValueError(f"{role}.rotation must be one [{d}, {d}] transform per head, got "
                         f"{None if side.rotation is None else tuple(side.rotation.shape)}")
    off = (torch.cumsum(w, -1) - w).to(torch.int32).contiguous()
    lv = side.levels.to(device=device, dtype=torch.float32).contiguous()
    return (codes, off, w.contiguous(), lv, nbytes, (codes.stride(0), codes.stride(1), codes.stride(2), 0, 0, 0))


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
    codes = k.payload.get(layout_of(k.kind).code_field)
    if not isinstance(codes, torch.Tensor) or codes.dim() != 4:
        raise ValueError(f"k codes must be a 4-D [batch, kv_heads, units, bytes] tensor, got "
                         f"{tuple(codes.shape) if isinstance(codes, torch.Tensor) else type(codes).__name__}")
    hkv = codes.shape[1]
    if hkv < 1 or hq % hkv:
        raise ValueError(f"{hq} query heads is not a multiple of {hkv} kv heads")
    n = k.n_tokens
    kt = _side_tensors(k, "k", b, hkv, q.device)
    vt = _side_tensors(v, "v", b, hkv, q.device)
    if q_rot is not None and tuple(q_rot.shape) != tuple(q.shape):
        raise ValueError(f"q_rot must have the query's shape {tuple(q.shape)}, got {tuple(q_rot.shape)}")
    if mask is not None:
        if mask.dtype not in (torch.bool, torch.int8, torch.uint8):
            raise ValueError(f"mask must be bool (True = attend), got {mask.dtype}")
        if mask.shape != (b, seq, n):
            raise ValueError(f"mask must be [batch={b}, tokens={seq}, packed={n}], got {tuple(mask.shape)}")
        if mask.device.type != q.device.type:
            raise ValueError(f"mask is on {mask.device}, the query on {q.device}")
    g = hq // hkv
    qn = g * seq
    dev = q.device
    qf = q.to(torch.float32) * scale
    qk = qf
    qmu = None
    if layout_of(k.kind).transformed:
        rot = k.rotation.to(device=dev, dtype=torch.float32)
        if q_rot is not None:
            qk = q_rot.to(torch.float32) * scale
        elif k.kind == "pcaq":  # one transform per KV head
            qk = torch.einsum("bhqd,hjd->bhqj", qf.reshape(b, hkv, qn, d), rot)
        else:
            qk = qf @ rot.T
        if k.mu is not None:
            qmu = (qf.reshape(b, hkv, qn, d) @ k.mu.to(torch.float32).transpose(-1, -2)).reshape(b, hkv, qn)
            qmu = qmu.contiguous()
    qk = qk.reshape(b, hkv, qn, d).contiguous()
    if mask is not None:
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
