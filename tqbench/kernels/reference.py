"""Pure-torch references of the kernels; also the CPU implementation of the ``fused`` cache mode.

A *side* (the K or the V history of one layer) is described by a :class:`PackedSide`: the packing kind,
bits, the codec constants, and the packed payload exactly as the codec stored it (no copy, no dense
rows). Kinds:

- ``turbo``: ``idx`` (b-bit codes, LSB-first stream) + fp16 ``norm``; rows live in the rotated domain:
  ``k = norm * c[idx] @ R + mu``. Keys are scored as ``(R q).c[idx] * norm + q.mu``; values are
  accumulated as ``sum_n p_n norm_n c[idx_n]`` and rotated back once.
- ``affine-channel``: KIVI keys, ``q`` packed token-major over blocks of ``group`` tokens, fp16
  ``scale``/``zero`` per (block, channel).
- ``affine-token``: ``q`` packed per row, fp16 ``scale``/``zero`` per group of ``group`` channels.
- ``pcaq`` (calibrated keys): ``idx`` packed with a width per coordinate (``widths [H, D]``,
  ``packing.pack_widths``), no norm; a transform per head (``rotation [H, D, D]``) and levels per coordinate
  (``levels [H, D, 2**bits]``, ``bits`` the widest width): ``k = level[idx] @ R_h + mu``, scored as
  ``(R_h q).level[idx] + q.mu`` like turbo keys without the norm.

Speed notes (CPU, one thread, 4K tokens x 3 heads x d64): decoding 4-bit codes through a 256-entry table
of value *pairs* viewed as one float64 per byte and ``index_select`` costs ~0.4 ms, 6x less than a row
``index_select`` of the ``[256, 2]`` table; everything else is one matmul per side.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tqbench.kernels.layouts import KINDS, TRANSFORMED, layout_of
from tqbench.kernels.packing import byte_table, lookup_packed, pack_bits, unpack_widths

__all__ = ["KINDS", "TRANSFORMED", "PackedSide"]  # KINDS / TRANSFORMED: the layouts table's (kernels/layouts.py)


@dataclass
class PackedSide:
    """The packed history of one side (K or V) of one layer."""

    kind: str
    bits: int
    payload: dict[str, torch.Tensor]
    n_tokens: int
    head_dim: int
    group: int = 1  # affine-token: channels per group; affine-channel: tokens per block
    levels: torch.Tensor | None = None  # turbo codebook [2**bits]; pcaq [H, D, 2**bits] (compute dtype)
    rotation: torch.Tensor | None = None  # turbo R [D, D]; pcaq one per head [H, D, D] (compute dtype)
    mu: torch.Tensor | None = None  # turbo / pcaq centering [B, H, 1, D] or None
    widths: torch.Tensor | None = None  # pcaq: bits of each coordinate [H, D]
    _tables: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        layout_of(self.kind)  # an unknown kind is refused, naming the valid ones
        if not 1 <= self.bits <= 8:
            raise ValueError(f"bits must be in 1..8, got {self.bits}")


# -- code tables (codes packed as ``packing.pack_bits`` lays them out: the engine's layout) -------------
_TABLES: dict[tuple, torch.Tensor] = {}


def _flat_table(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Table giving every byte's decoded values; rows of 8 or 16 bytes are viewed as one scalar each."""
    key = (bits, values.dtype, str(values.device), tuple(values.tolist()))  # by content: codecs are per layer
    tab = _TABLES.get(key)
    if tab is None:
        tab = byte_table(values, bits).contiguous()
        row = tab.shape[-1] * tab.element_size() if tab.dim() == 2 else 0
        if row == 8:
            tab = tab.view(torch.float64).reshape(256)
        elif row == 16:
            tab = tab.view(torch.complex128).reshape(256)
        _TABLES[key] = tab
    return tab


def decode_codes(packed: torch.Tensor, bits: int, n: int, values: torch.Tensor) -> torch.Tensor:
    """``values[unpack(packed)]`` as ``[..., n]`` in ``values.dtype``, straight from the packed bytes.

    ``packing.lookup_packed`` through a byte table cached by content, whose rows of 8 or 16 bytes are read
    as one scalar each (the speed note above)."""
    if 8 % bits:
        return lookup_packed(packed, bits, n, values)
    tab = _flat_table(values, bits)
    if tab.dim() == 2:
        return lookup_packed(packed, bits, n, tab)
    flat = tab.index_select(0, packed.reshape(-1).int())
    vals = flat.view(values.dtype).view(*packed.shape[:-1], packed.shape[-1] * (8 // bits))
    return vals if vals.shape[-1] == n else vals[..., :n]


_CODE_VALUES: dict[tuple, torch.Tensor] = {}


def code_values(bits: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``[0, 1, ..., 2**bits - 1]`` as floats (affine codes decode through the same byte table)."""
    key = (bits, dtype, str(device))
    if key not in _CODE_VALUES:
        _CODE_VALUES[key] = torch.arange(1 << bits, dtype=dtype, device=device)
    return _CODE_VALUES[key]


def dequantize_side(side: PackedSide, dtype: torch.dtype) -> torch.Tensor:
    """Affine rows ``[B, H, N, D]`` (dequantized in blocks); turbo rows in the rotated unit domain; pcaq rows
    in their head's transformed domain (the levels of their codes)."""
    p = side.payload
    d = side.head_dim
    if side.kind == "turbo":
        return decode_codes(p["idx"], side.bits, d, side.levels.to(dtype))
    if side.kind == "pcaq":
        idx = torch.stack([unpack_widths(p["idx"][:, h], side.widths[h]) for h in range(side.widths.shape[0])], 1)
        lv = side.levels.to(dtype)[None, :, None].expand(*idx.shape, side.levels.shape[-1])
        return lv.gather(-1, idx[..., None]).squeeze(-1)
    codes_per_row = side.group * d if layout_of(side.kind).grouped_rows else d
    if side.bits == 8:
        codes = p["q"].to(dtype)
    else:
        codes = decode_codes(p["q"], side.bits, codes_per_row, code_values(side.bits, dtype, p["q"].device))
    scale, zero = p["scale"].to(dtype), p["zero"].to(dtype)
    if side.kind == "affine-channel":
        b, h, u, _ = scale.shape
        x = codes.view(b, h, u, side.group, d) * scale[:, :, :, None] + zero[:, :, :, None]
        return x.view(b, h, u * side.group, d)
    g = scale.shape[-1]
    if g * side.group != d:
        raise ValueError(f"affine-token: head_dim {d} is not groups {g} x group {side.group}")
    b, h, n, _ = codes.shape
    x = codes.view(b, h, n, g, side.group) * scale[..., None] + zero[..., None]
    return x.view(b, h, n, d)


def packed_scores(q: torch.Tensor, side: PackedSide) -> torch.Tensor:
    """``q`` ``[B, H, Q, D]`` (compute dtype, already scaled) -> scores ``[B, H, Q, N]`` over the packed rows."""
    dt = q.dtype
    rows = dequantize_side(side, dt)
    if side.kind not in TRANSFORMED:
        return q @ rows.transpose(-1, -2)
    if side.kind == "pcaq":
        s = torch.einsum("bhqd,hjd->bhqj", q, side.rotation.to(dt)) @ rows.transpose(-1, -2)
    else:
        q_rot = q @ side.rotation.to(dt).T
        s = (q_rot @ rows.transpose(-1, -2)) * side.payload["norm"].to(dt).transpose(-1, -2)
    if side.mu is not None:
        s = s + q @ side.mu.to(dt).transpose(-1, -2)
    return s


def packed_values(p: torch.Tensor, side: PackedSide) -> torch.Tensor:
    """``p`` ``[B, H, Q, N]`` (weights of the packed rows) -> ``sum_n p_n v_n`` ``[B, H, Q, D]``."""
    dt = p.dtype
    rows = dequantize_side(side, dt)
    if side.kind not in TRANSFORMED:
        return p @ rows
    if side.kind == "pcaq":
        out = torch.einsum("bhqj,hjd->bhqd", p @ rows, side.rotation.to(dt))
    else:
        out = ((p * side.payload["norm"].to(dt).transpose(-1, -2)) @ rows) @ side.rotation.to(dt)
    if side.mu is not None:
        out = out + p.sum(-1, keepdim=True) * side.mu.to(dt)
    return out


def packed_attention_partials(
    q: torch.Tensor, k: PackedSide, v: PackedSide, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` ``[B, Hq, L, D]`` over packed rows only: ``(out [B, Hq, L, D], lse [B, Hq, L])``.

    ``mask``: bool ``[B, L, N]`` (True = attend) or None. What the Triton kernel computes (its split-K
    partials merged); rows with nothing to attend give ``out = 0`` and ``lse = -inf``.
    """
    b, hq, seq, d = q.shape
    hkv = k.payload[layout_of(k.kind).code_field].shape[1]
    g = hq // hkv
    dt = torch.promote_types(q.dtype, torch.float32)
    qk = (q.to(dt) * scale).reshape(b, hkv, g * seq, d)
    s = packed_scores(qk, k).view(b, hkv, g, seq, -1)
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = packed_values(p.view(b, hkv, g * seq, -1), v)
    return out.view(b, hq, seq, d), lse.view(b, hq, seq)


def merge_partials(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine ``(out, lse)`` pairs over disjoint key ranges into one (the split-K reduction)."""
    lses = torch.stack([lse for _, lse in parts])
    total = torch.logsumexp(lses, dim=0)
    w = torch.exp(lses - total).nan_to_num(0.0)
    out = sum(w[i][..., None] * parts[i][0] for i in range(len(parts)))
    return out, total


def dense_partials(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float):
    """``(out, lse)`` of ``q`` ``[B, Hq, L, D]`` over dense rows ``[B, Hkv, M, D]``; mask bool ``[B, L, M]``."""
    b, hq, seq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    dt = torch.promote_types(q.dtype, torch.float32)
    qk = (q.to(dt) * scale).reshape(b, hkv, g * seq, d)
    s = (qk @ k.to(dt).transpose(-1, -2)).view(b, hkv, g, seq, -1)
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = p.view(b, hkv, g * seq, -1) @ v.to(dt)
    return out.view(b, hq, seq, d), lse.view(b, hq, seq)


def turbo_quantize_pack(
    x: torch.Tensor, mu: torch.Tensor | None, rotation: torch.Tensor, levels: torch.Tensor, bits: int,
    norm_correction: bool = True,
) -> dict[str, torch.Tensor]:
    """Reference of the quantize+pack kernel: rows ``[B, H, T, D]`` -> ``{"idx", "norm"}`` as TurboCodec stores."""
    dt = torch.promote_types(x.dtype, torch.float32)
    xc = x.to(dt) if mu is None else x.to(dt) - mu.to(dt)
    n = torch.linalg.vector_norm(xc, dim=-1, keepdim=True)
    u_rot = (xc / n.clamp_min(torch.finfo(dt).tiny)) @ rotation.to(dt).T
    lv = levels.to(dt)
    idx = torch.bucketize(u_rot, 0.5 * (lv[1:] + lv[:-1]))
    if norm_correction:
        c = lv[idx]
        n = n * (u_rot * c).sum(-1, keepdim=True) / (c * c).sum(-1, keepdim=True)
    norm = n.clamp(0, torch.finfo(torch.float16).max).to(torch.float16)
    return {"idx": pack_bits(idx.to(torch.uint8), bits, check=False), "norm": norm}
