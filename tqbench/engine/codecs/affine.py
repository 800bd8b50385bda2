"""Asymmetric min/max affine int8 / int4 / int2 with fp16 scale and fp16 zero (the group minimum).

The stored zero is the fp16 value just at or below the minimum and the stored scale the fp16 value just at or
above ``(max - zero) / (2**bits - 1)``, and indices are computed from those stored values, so every element
round-trips within half a quantization step of its group.
"""

from __future__ import annotations

import math

import torch

from tqbench.kernels.packing import max_values, pack_bits, packed_nbytes, unpack_bits

from .base import Codec, Encoded, compute_dtype

__all__ = ["AFFINE_BITS", "AffineChannelCodec", "AffineTokenCodec", "affine_params"]

AFFINE_BITS = (8, 4, 2)
_FP16_MAX = torch.finfo(torch.float16).max


def _check_bits(bits: int) -> None:
    if bits not in AFFINE_BITS:
        raise ValueError(f"affine bits must be one of {', '.join(map(str, AFFINE_BITS))}, got {bits!r}")


def _check_size(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _fp16_toward(x: torch.Tensor, up: bool) -> torch.Tensor:
    """Round ``x`` to fp16, toward +inf (``up``) or -inf, so the fp16 value bounds ``x``."""
    h = x.to(torch.float16)
    wrong = h.to(x.dtype) < x if up else h.to(x.dtype) > x
    step = torch.full_like(h, math.inf if up else -math.inf)
    return torch.where(wrong, torch.nextafter(h, step), h)


def affine_params(vmin: torch.Tensor, vmax: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 ``(scale, zero)`` covering ``[vmin, vmax]`` with ``2**bits`` levels (values beyond fp16 are clamped)."""
    qmax = (1 << bits) - 1
    zero = _fp16_toward(vmin.clamp(-_FP16_MAX, _FP16_MAX), up=False)
    need = (vmax.clamp(-_FP16_MAX, _FP16_MAX) - zero.to(vmin.dtype)).clamp_min(0) / qmax
    return _fp16_toward(need, up=True), zero


def _quantize(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    s = scale.to(x.dtype)
    q = torch.where(s > 0, (x - zero.to(x.dtype)) / torch.where(s > 0, s, 1), 0)
    return q.round_().clamp_(0, (1 << bits) - 1).to(torch.uint8)


class AffineTokenCodec(Codec):
    """Per-token groups of ``group`` channels along head_dim (values). Fields ``q``, ``scale``, ``zero``.

    ``q``: packed ``[B, H, T, ceil(D*bits/8)]``; ``scale``/``zero``: fp16 ``[B, H, T, ceil(D/group)]``. A
    last partial group is allowed.
    """

    layout = "affine-token"

    tokens_per_unit = 1

    def __init__(self, bits: int = 8, group: int = 32) -> None:
        _check_bits(bits)
        _check_size("group", group)
        self.bits, self.group = bits, group
        self.spec = f"int{bits}"

    def packed_side(self, payload: dict, n: int, head_dim: int, dtype: torch.dtype, state: dict):
        if head_dim % self.group:  # the kernels read whole groups of channels
            return None
        from tqbench.kernels.reference import PackedSide

        return PackedSide(self.layout, self.bits, payload, n, head_dim, group=self.group)

    def _groups(self, head_dim: int) -> int:
        return -(-head_dim // self.group)

    def _decodable_dim(self, nbytes: int, groups: int) -> int:
        return min(max_values(nbytes, self.bits), groups * self.group)

    def encode(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> Encoded:
        self.check_input(x)
        d = x.shape[-1]
        g = self._groups(d)
        if self._decodable_dim(packed_nbytes(d, self.bits), g) != d:
            raise ValueError(
                f"{self.spec}: head_dim {d} with group {self.group} cannot be unpacked unambiguously; "
                f"use a group that divides head_dim or a head_dim with head_dim*{self.bits} divisible by 8"
            )
        xc = x.to(compute_dtype(x.dtype))
        pad = g * self.group - d
        if pad:  # repeat the last channel: it belongs to the last group, so min/max are unchanged
            xc = torch.cat([xc, xc[..., -1:].expand(*xc.shape[:-1], pad)], dim=-1)
        xg = xc.reshape(*xc.shape[:-1], g, self.group)
        scale, zero = affine_params(xg.amin(-1), xg.amax(-1), self.bits)
        q = _quantize(xg, scale.unsqueeze(-1), zero.unsqueeze(-1), self.bits)
        q = q.reshape(*x.shape[:-1], g * self.group)[..., :d]
        return {"q": pack_bits(q, self.bits, check=False), "scale": scale, "zero": zero}

    def decode(self, enc: Encoded, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        scale, zero = enc["scale"], enc["zero"]
        g = scale.shape[-1]
        d = self._decodable_dim(enc["q"].shape[-1], g)
        q = unpack_bits(enc["q"], self.bits, d)
        cd = compute_dtype(dtype)
        pad = g * self.group - d
        qf = q.to(cd)
        if pad:
            qf = torch.cat([qf, qf.new_zeros(*qf.shape[:-1], pad)], dim=-1)
        qf = qf.reshape(*q.shape[:-1], g, self.group)
        x = zero.to(cd).unsqueeze(-1) + qf * scale.to(cd).unsqueeze(-1)
        return x.reshape(*q.shape[:-1], g * self.group)[..., :d].to(dtype)

    def unit_bytes(self, head_dim: int) -> int:
        return packed_nbytes(head_dim, self.bits) + 4 * self._groups(head_dim)

    def __repr__(self) -> str:
        return f"AffineTokenCodec({self.spec!r}, group={self.group})"


class AffineChannelCodec(Codec):
    """Per channel over blocks of ``block`` tokens (KIVI keys). Fields ``q``, ``scale``, ``zero``.

    ``q``: packed ``[B, H, U, ceil(block*D*bits/8)]`` (token-major within the block); ``scale``/``zero``: fp16
    ``[B, H, U, D]``. ``tokens_per_unit = block``.
    """

    layout = "affine-channel"

    def __init__(self, bits: int = 8, block: int = 32) -> None:
        _check_bits(bits)
        _check_size("block", block)
        self.bits, self.block = bits, block
        self.tokens_per_unit = block
        self.spec = f"int{bits}"

    def packed_side(self, payload: dict, n: int, head_dim: int, dtype: torch.dtype, state: dict):
        from tqbench.kernels.reference import PackedSide

        return PackedSide(self.layout, self.bits, payload, n, head_dim, group=self.block)

    def encode(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> Encoded:
        self.check_input(x)
        b, h, t, d = x.shape
        xb = x.to(compute_dtype(x.dtype)).reshape(b, h, t // self.block, self.block, d)
        scale, zero = affine_params(xb.amin(3), xb.amax(3), self.bits)
        q = _quantize(xb, scale.unsqueeze(3), zero.unsqueeze(3), self.bits)
        q = pack_bits(q.reshape(b, h, t // self.block, self.block * d), self.bits, check=False)
        return {"q": q, "scale": scale, "zero": zero}

    def decode(self, enc: Encoded, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        scale, zero = enc["scale"], enc["zero"]
        b, h, u, d = scale.shape
        q = unpack_bits(enc["q"], self.bits, self.block * d).reshape(b, h, u, self.block, d)
        cd = compute_dtype(dtype)
        x = zero.to(cd).unsqueeze(3) + q.to(cd) * scale.to(cd).unsqueeze(3)
        return x.reshape(b, h, u * self.block, d).to(dtype)

    def unit_bytes(self, head_dim: int) -> int:
        return packed_nbytes(self.block * head_dim, self.bits) + 4 * head_dim

    def __repr__(self) -> str:
        return f"AffineChannelCodec({self.spec!r}, block={self.block})"
