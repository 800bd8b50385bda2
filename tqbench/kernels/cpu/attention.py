"""``native_attention``: the Python side of the native CPU kernel, on the kernels' own types.

Arguments are ``PackedSide`` descriptions of the packed runs (``tqbench.kernels.reference``) plus the
full-precision rows of each side (``[before | after]`` in store order, ``before`` rows first). Torch does only
the per-call O(D^2) work: rotating the queries once for TurboQuant keys and the rotated-domain value sum back
once for TurboQuant values (``+ p * mu`` for centred values).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from tqbench.kernels.cpu import native_module
from tqbench.kernels.packing import byte_table
from tqbench.kernels.reference import PackedSide, code_values

KIND_CODES = {"turbo": 1, "affine-token": 2, "affine-channel": 3}
BLOCKS_PER_THREAD = 8  # token blocks per thread and kv head: keeps every thread busy at batch 1
MIN_BLOCK = 32  # the kernel's smallest token block (see fused_attention.cpp)

_tables: dict[tuple, torch.Tensor] = {}


@dataclass(frozen=True)
class NativeCall:
    """What one call did: Sparse-V counts and the transient bytes it held (partials + joined rows)."""

    skipped_rows: int
    weighted_rows: int
    workspace_bytes: int


def _byte_table(lut: torch.Tensor, bits: int) -> torch.Tensor:
    if 8 % bits:
        return lut.new_empty(0)
    key = (bits, lut.dtype, tuple(lut.tolist()))
    tab = _tables.get(key)
    if tab is None:
        tab = _tables[key] = byte_table(lut, bits).contiguous()
    return tab


def simd_order(bits: int, d: int) -> torch.Tensor:
    """The coordinate each position holds when the kernel decodes ``bits``-bit turbo rows 64 codes at a time."""
    p = torch.arange(64)
    if bits == 1:
        one = p  # a mask blend per 16 codes keeps the natural order
    elif bits == 4:
        one = torch.where(p < 32, 2 * p, 2 * (p - 32) + 1)
    elif bits == 2:
        one = 4 * (p % 16) + p // 16
    elif bits == 3:
        one = 8 * (p % 8) + p // 8
    else:
        raise ValueError(f"no SIMD order for {bits}-bit codes")
    return torch.cat([one + 64 * c for c in range(d // 64)])


_rotations: dict[tuple, tuple[weakref.ref, torch.Tensor]] = {}  # (id of the source rotation, dtype, bits)
_SIMD_BITS: list[tuple[int, ...]] = []


def _simd_bits() -> tuple[int, ...]:
    """The turbo widths the built kernel decodes in SIMD order (asked once per process)."""
    if not _SIMD_BITS:
        _SIMD_BITS.append(tuple(native_module().simd_turbo_bits()))
    return _SIMD_BITS[0]


def _rotation(side: PackedSide, dt: torch.dtype) -> torch.Tensor:
    """The side's rotation, its rows in the kernel's decode order when it decodes in SIMD order."""
    rot = side.rotation.to(dt)
    if dt != torch.float32 or side.head_dim % 64 or side.bits not in _simd_bits():
        return rot
    key = (id(side.rotation), dt, side.bits)
    hit = _rotations.get(key)
    if hit is None or hit[0]() is not side.rotation:
        hit = _rotations[key] = (weakref.ref(side.rotation), rot[simd_order(side.bits, side.head_dim)].contiguous())
        # the entry lives as long as the rotation it was made from (each request's codecs have their own):
        # holding the source here kept every request's rotations alive, 2 MB per request on the default model
        weakref.finalize(side.rotation, _forget_rotation, key, hit[0])
    return hit[1]


def _forget_rotation(key: tuple, ref: weakref.ref) -> None:
    entry = _rotations.get(key)
    if entry is not None and entry[0] is ref:
        del _rotations[key]


def _side_args(side: PackedSide | None, n_before: int, dt: torch.dtype) -> list:
    empty = torch.empty(0, dtype=dt)
    if side is None:
        return [0, 0, 1, 0, 0, torch.empty(0, dtype=torch.uint8), empty, empty, empty, empty]
    p = side.payload
    if side.kind == "turbo":
        lut = side.levels.to(dt).contiguous()
        codes, a, z = p["idx"], p["norm"], empty
    else:
        lut = code_values(side.bits, dt, p["q"].device)
        codes, a, z = p["q"], p["scale"].to(dt), p["zero"].to(dt)  # read per element: converted once per call
    return [KIND_CODES[side.kind], side.bits, side.group, n_before, side.n_tokens, codes, a, z, lut,
            _byte_table(lut, side.bits)]


def native_attention(
    query: torch.Tensor, k_side: PackedSide | None, v_side: PackedSide | None, k_dense: torch.Tensor,
    v_dense: torch.Tensor, k_before: int, v_before: int, mask: torch.Tensor | None, scale: float, *,
    softcap: float | None = None, sinks: torch.Tensor | None = None, sparse_v: float = 0.0,
) -> tuple[torch.Tensor, NativeCall]:
    """Attention of ``query`` ``[B, Hq, L, D]`` over ``total`` tokens in store order; ``(out [B, Hq, L, Dv], call)``.

    ``k_dense``/``v_dense``: ``[B, Hkv, n, D]`` full-precision rows, the first ``k_before``/``v_before`` of
    which come before the packed run; ``mask``: bool ``[B, L, total]`` (True = attend) or None (causal over
    the last ``L`` tokens); ``sinks``: per-query-head sink logits ``[Hq]``; ``softcap``: logit soft-cap.
    """
    b, hq, seq, d = query.shape
    hkv = k_dense.shape[1]
    dv = v_dense.shape[-1]
    g = hq // hkv
    dt = torch.float64 if query.dtype == torch.float64 else torch.float32
    total = k_dense.shape[2] + (k_side.n_tokens if k_side else 0)
    q = (query.to(dt) * scale).reshape(b, hkv, g * seq, d).contiguous()
    qr = qmu = torch.empty(0, dtype=dt)
    if k_side is not None and k_side.kind == "turbo":
        qr = (q @ _rotation(k_side, dt).T).contiguous()
        if k_side.mu is not None:
            qmu = (q * k_side.mu.to(dt)).sum(-1).contiguous()
    k_dense = k_dense.to(dt).contiguous() if k_dense.dtype != dt or k_dense.stride(-1) != 1 else k_dense
    v_dense = v_dense.to(dt).contiguous() if v_dense.dtype != dt or v_dense.stride(-1) != 1 else v_dense
    threads = torch.get_num_threads()
    blocks = max(1, -(-BLOCKS_PER_THREAD * threads // (b * hkv)))
    sink_t = torch.empty(0, dtype=dt) if sinks is None else sinks.to(dt).contiguous()
    out_d, out_p, psum, counts = native_module().attend(
        q, qr, qmu, seq, total, *_side_args(k_side, k_before, dt), k_dense, *_side_args(v_side, v_before, dt),
        v_dense, torch.empty(0, dtype=torch.bool) if mask is None else mask.contiguous(),
        float(softcap or 0.0), sink_t, float(sparse_v), blocks,
    )
    out = out_d
    if v_side is not None and v_side.kind == "turbo":
        out = out + out_p @ _rotation(v_side, dt)
        if v_side.mu is not None:
            out = out + psum[..., None] * v_side.mu.to(dt)
    nblk = max(1, min(blocks, -(-total // MIN_BLOCK)))
    workspace = (k_dense.numel() + v_dense.numel() + b * hkv * nblk * (3 + 2 * dv) * g * seq) * q.element_size()
    skipped, weighted = (int(x) for x in counts.tolist())
    return out.view(b, hq, seq, dv).to(query.dtype), NativeCall(skipped, weighted, workspace)
