"""llama.cpp's KV cache types as codecs, stored byte for byte as GGML lays them out.

``q8_0``, ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1`` and ``iq4_nl``: blocks of 32 consecutive values along
head_dim, each with an fp16 scale (and an fp16 minimum for the ``_1`` types). A row of ``head_dim`` values
is ``head_dim / 32`` blocks; the packed field ``blocks`` holds, per token, exactly the bytes llama.cpp's
``ggml_cpy`` writes into its K/V cache rows (``block_q4_0 {ggml_half d; uint8_t qs[16]}`` and friends).

The quantizers reproduce ggml's reference ones (``quantize_row_<type>_ref``, the CPU ``from_float`` of the
cache copy) in the same fp32 operations: ``gguf.quants.quantize`` (the ``gguf`` package's numpy port of them)
is the oracle in the tests. ``iq4_nl`` is not in ``gguf``: its cache quantizer is
``quantize_row_iq4_nl_ref`` = ``quantize_row_iq4_nl_impl(.., ntry=-1)``: scale ``max/-127`` (``max`` the
value of largest magnitude), nearest of the 16 non-linear levels ``IQ4NL_LEVELS``, then the weighted
least-squares scale (weights x^2) for those indices, summed in element order. (The ntry=7 scale search of
``quantize_iq4_nl`` is llama-quantize's weight path, not the KV cache's.) Values are quantized from fp32, as
llama.cpp's cache copy does.
"""

from __future__ import annotations

import torch

from .base import Codec, Encoded
from .names import GGML_TYPES, GgmlType

__all__ = ["GGML_TYPES", "IQ4NL_LEVELS", "GgmlCodec", "GgmlType"]

QK = 32  # values per block, every type here
#: kvalues_iq4nl (ggml-common.h)
IQ4NL_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
GROUP_MAX_EPS = 1e-15


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``[..., 1]`` -> its fp16 as 2 little-endian bytes ``[..., 2]``."""
    return x.to(torch.float16).contiguous().view(torch.uint8)


def _read_f16(b: torch.Tensor) -> torch.Tensor:
    """2 bytes ``[..., 2]`` -> fp32 ``[..., 1]``."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """Indices ``[..., 32]`` (0..15) -> 16 bytes: low nibble element j, high nibble element j + 16."""
    return (q[..., :16] & 0x0F) | (q[..., 16:] << 4)


def _unnibble(qs: torch.Tensor) -> torch.Tensor:
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _high_bits(q: torch.Tensor) -> torch.Tensor:
    """Bit 4 of each of 32 indices -> ``qh``: a little-endian uint32 whose bit j is element j's (4 bytes)."""
    bits = ((q >> 4) & 1).reshape(*q.shape[:-1], 4, 8).to(torch.int32)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.int32, device=q.device)
    return (bits * weights).sum(-1).to(torch.uint8)


def _read_high_bits(qh: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(8, device=qh.device, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(*qh.shape[:-1], 32)


def _abs_max_signed(x: torch.Tensor) -> torch.Tensor:
    """The value of largest magnitude per block (the first one on ties, as ggml's loop keeps)."""
    return torch.gather(x, -1, x.abs().argmax(-1, keepdim=True))


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / torch.where(d == 0, torch.ones_like(d), d))


def _roundf(v: torch.Tensor) -> torch.Tensor:
    """C ``roundf``: half away from zero, in fp32 exactly as gguf's ``np_roundf``."""
    a = v.abs()
    f = a.floor()
    return torch.sign(v) * (f + (2 * (a - f)).floor())


def _best_index(al: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """ggml's ``best_index_int8``: the nearest level (ties to the upper one), clamped at both ends."""
    mu = torch.searchsorted(levels, al.contiguous(), right=True).clamp_(1, len(levels) - 1)
    lo, hi = levels[mu - 1], levels[mu]
    return torch.where(al - lo < hi - al, mu - 1, mu)


def _quantize_iq4_nl(xb: torch.Tensor) -> torch.Tensor:
    """``quantize_row_iq4_nl_ref`` on blocks ``[N, 32]`` fp32 -> bytes ``[N, 18]``."""
    levels = torch.tensor(IQ4NL_LEVELS, dtype=torch.float32, device=xb.device)
    mx = _abs_max_signed(xb)  # [N, 1]
    d0 = mx / levels[0]
    idx = _best_index((1 / d0) * xb, levels)
    q = levels[idx]
    w = xb * xb
    wq = w * q
    t_qx, t_q2 = wq * xb, wq * q
    sumqx = torch.zeros_like(mx[:, 0])
    sumq2 = torch.zeros_like(mx[:, 0])
    for j in range(QK):  # in element order, as the C loop sums
        sumqx = sumqx + t_qx[:, j]
        sumq2 = sumq2 + t_q2[:, j]
    d = torch.where(sumq2 > 0, sumqx / torch.where(sumq2 > 0, sumq2, 1), 0)
    tiny = mx[:, 0].abs() < GROUP_MAX_EPS
    # a block below GROUP_MAX_EPS gets d = 0; ggml leaves its indices as its scratch array held them (the
    # previous block's): any indices decode to 0 there, and tqbench writes 0
    d = torch.where(tiny, 0, d)
    idx = torch.where(tiny.unsqueeze(-1), 0, idx).to(torch.uint8)
    return torch.cat([_f16_bytes(d.unsqueeze(-1)), _nibbles(idx)], dim=-1)


def quantize_blocks(kind: str, xb: torch.Tensor) -> torch.Tensor:
    """GGML ``kind`` blocks of ``xb`` ``[N, 32]`` (fp32) -> their bytes ``[N, block_bytes]``."""
    if kind == "iq4_nl":
        return _quantize_iq4_nl(xb)
    if kind == "q8_0":
        d = xb.abs().amax(-1, keepdim=True) / 127
        qs = _roundf(xb * _inverse(d)).to(torch.int8).view(torch.uint8)
        return torch.cat([_f16_bytes(d), qs], dim=-1)
    if kind in ("q4_0", "q5_0"):
        half = 8 if kind == "q4_0" else 16
        d = _abs_max_signed(xb) / -half
        q = torch.trunc(xb * _inverse(d) + (half + 0.5)).clamp_(0, 2 * half - 1).to(torch.uint8)
        parts = [_f16_bytes(d)] + ([_high_bits(q)] if kind == "q5_0" else []) + [_nibbles(q)]
        return torch.cat(parts, dim=-1)
    # q4_1 / q5_1: min and (max - min) / levels
    top = 15 if kind == "q4_1" else 31
    mn, mx = xb.amin(-1, keepdim=True), xb.amax(-1, keepdim=True)
    d = (mx - mn) / top
    q = torch.trunc((xb - mn) * _inverse(d) + 0.5).clamp_(0, top).to(torch.uint8)
    parts = [_f16_bytes(d), _f16_bytes(mn)] + ([_high_bits(q)] if kind == "q5_1" else []) + [_nibbles(q)]
    return torch.cat(parts, dim=-1)


def dequantize_blocks(kind: str, b: torch.Tensor) -> torch.Tensor:
    """Bytes ``[N, block_bytes]`` -> fp32 values ``[N, 32]`` (ggml's ``dequantize_row_<type>``)."""
    d = _read_f16(b[:, 0:2])
    if kind == "q8_0":
        return b[:, 2:].contiguous().view(torch.int8).to(torch.float32) * d
    if kind == "iq4_nl":
        levels = torch.tensor(IQ4NL_LEVELS, dtype=torch.float32, device=b.device)
        return d * levels[_unnibble(b[:, 2:]).long()]
    if kind == "q4_0":
        return d * (_unnibble(b[:, 2:]).to(torch.float32) - 8)
    if kind == "q5_0":
        q = _unnibble(b[:, 6:]) | (_read_high_bits(b[:, 2:6]) << 4)
        return d * (q.to(torch.float32) - 16)
    m = _read_f16(b[:, 2:4])
    if kind == "q4_1":
        return d * _unnibble(b[:, 4:]).to(torch.float32) + m
    q = _unnibble(b[:, 8:]) | (_read_high_bits(b[:, 4:8]) << 4)
    return d * q.to(torch.float32) + m


class GgmlCodec(Codec):
    """A GGML block type for K or V rows. Field ``blocks``: uint8 ``[B, H, T, head_dim / 32 * block_bytes]``,
    the bytes of llama.cpp's cache row; ``unit_bytes`` counts every one of them (scales included)."""

    tokens_per_unit = 1

    def __init__(self, kind: str) -> None:
        if kind not in GGML_TYPES:
            raise ValueError(f"unknown GGML KV type {kind!r}: valid types are {', '.join(GGML_TYPES)}")
        self.kind = self.spec = kind
        self.type = GGML_TYPES[kind]

    def _check_dim(self, head_dim: int) -> None:
        if head_dim % QK:
            raise ValueError(
                f"{self.kind}: head_dim {head_dim} is not a multiple of GGML's block of {QK} values; llama.cpp "
                "cannot store this model's K/V in a quantized type either (use f16, or a tqbench codec)"
            )

    def encode(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> Encoded:
        self.check_input(x)
        b, h, t, d = x.shape
        self._check_dim(d)
        xb = x.to(torch.float32).reshape(-1, QK)
        blocks = quantize_blocks(self.kind, xb)
        return {"blocks": blocks.reshape(b, h, t, d // QK * self.type.block_bytes)}

    def decode(self, enc: Encoded, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        raw = enc["blocks"]
        b, h, t, nbytes = raw.shape
        vals = dequantize_blocks(self.kind, raw.reshape(-1, self.type.block_bytes))
        return vals.reshape(b, h, t, nbytes // self.type.block_bytes * QK).to(dtype)

    def unit_bytes(self, head_dim: int) -> int:
        self._check_dim(head_dim)
        return head_dim // QK * self.type.block_bytes

    def __repr__(self) -> str:
        return f"GgmlCodec({self.kind!r})"
