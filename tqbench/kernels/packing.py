"""Dense bit packing of small unsigned indices along the last dimension: the one packer of KV codes.

The codecs (``tqbench.engine.codecs``) pack with it and the kernels' torch reference decodes with it; it
lives here because ``tqbench.kernels`` never imports the engine.

Layout: an LSB-first bit stream. Value ``i`` of a row occupies stream bits ``[i*bits, (i+1)*bits)`` and
stream bit ``k`` is bit ``k % 8`` of byte ``k // 8``. So 4-bit packs ``v0 | v1 << 4``, 2-bit packs
``v0 | v1 << 2 | v2 << 4 | v3 << 6``, and 3-bit packs 8 values into 3 bytes. Trailing pad bits are zero.
"""

from __future__ import annotations

import torch

__all__ = ["byte_table", "lookup_packed", "max_values", "pack_bits", "pack_widths", "packed_nbytes", "unpack_bits",
           "unpack_widths"]


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes that ``n`` values of ``bits`` bits occupy when packed: ``ceil(n * bits / 8)``."""
    _check_bits(bits)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return (n * bits + 7) // 8


def max_values(nbytes: int, bits: int) -> int:
    """Largest ``n`` whose packing fits ``nbytes`` (decoders bound ``n`` with it when only bytes are known)."""
    _check_bits(bits)
    return nbytes * 8 // bits


def _pad_last(x: torch.Tensor, size: int) -> torch.Tensor:
    """Zero-pad the last dimension of ``x`` to ``size``."""
    extra = size - x.shape[-1]
    if extra == 0:
        return x
    return torch.cat([x, x.new_zeros(*x.shape[:-1], extra)], dim=-1)


def pack_bits(idx: torch.Tensor, bits: int, *, check: bool = True) -> torch.Tensor:
    """Pack ``uint8`` values ``[..., n]`` (each ``< 2**bits``) into ``uint8 [..., ceil(n*bits/8)]``.

    ``check=False`` skips the range check (a device sync); codecs use it for indices valid by construction.
    """
    _check_bits(bits)
    if idx.dtype != torch.uint8:
        raise TypeError(f"pack_bits expects a uint8 tensor, got {idx.dtype}")
    if idx.dim() == 0:
        raise ValueError("pack_bits expects at least one dimension (the values to pack)")
    n = idx.shape[-1]
    if check and bits < 8 and idx.numel() and int(idx.max()) >= (1 << bits):
        raise ValueError(f"pack_bits: value {int(idx.max())} does not fit in {bits} bits")
    nbytes = packed_nbytes(n, bits)
    if bits == 8:
        return idx.clone()
    if 8 % bits == 0:  # 1, 2, 4: whole values per byte, shifts in uint8
        per = 8 // bits
        v = _pad_last(idx, nbytes * per).reshape(*idx.shape[:-1], nbytes, per)
        out = v[..., 0].clone()
        for k in range(1, per):
            out |= v[..., k] << (k * bits)
        return out
    # 3, 5, 6, 7: 8 values -> `bits` bytes through one int64 word per group of 8
    groups = (n + 7) // 8
    v = _pad_last(idx, groups * 8).reshape(*idx.shape[:-1], groups, 8).to(torch.int64)
    word = v[..., 0].clone()
    for k in range(1, 8):
        word |= v[..., k] << (k * bits)
    shifts = torch.arange(0, 8 * bits, 8, device=idx.device, dtype=torch.int64)
    out = ((word.unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8)
    return out.reshape(*idx.shape[:-1], groups * bits)[..., :nbytes].contiguous()


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``uint8 [..., ceil(n*bits/8)]`` -> ``uint8 [..., n]``."""
    _check_bits(bits)
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_bits expects a uint8 tensor, got {packed.dtype}")
    if packed.dim() == 0:
        raise ValueError("unpack_bits expects at least one dimension (the packed bytes)")
    nbytes = packed_nbytes(n, bits)
    if packed.shape[-1] != nbytes:
        raise ValueError(
            f"unpack_bits: {n} values of {bits} bits need {nbytes} bytes, got {packed.shape[-1]}"
        )
    lead = packed.shape[:-1]
    if bits == 8:
        return packed.clone()
    if 8 % bits == 0:
        per = 8 // bits
        mask = (1 << bits) - 1
        parts = [(packed >> (k * bits)) & mask for k in range(per)]
        return torch.stack(parts, dim=-1).reshape(*lead, nbytes * per)[..., :n].contiguous()
    groups = (n + 7) // 8
    b = _pad_last(packed, groups * bits).reshape(*lead, groups, bits).to(torch.int64)
    word = b[..., 0].clone()
    for j in range(1, bits):
        word |= b[..., j] << (8 * j)
    shifts = torch.arange(0, 8 * bits, bits, device=packed.device, dtype=torch.int64)
    vals = ((word.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).to(torch.uint8)
    return vals.reshape(*lead, groups * 8)[..., :n].contiguous()


def byte_table(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """``[256, 8 // bits]``: the levels every byte value decodes to (1, 2, 4 and 8 bits); else ``levels``."""
    _check_bits(bits)
    if 8 % bits:
        return levels
    byte = torch.arange(256, device=levels.device, dtype=torch.int32)
    shifts = torch.arange(8 // bits, device=levels.device, dtype=torch.int32) * bits
    return levels[(byte[:, None] >> shifts) & ((1 << bits) - 1)]


def lookup_packed(packed: torch.Tensor, bits: int, n: int, table: torch.Tensor) -> torch.Tensor:
    """``levels[unpack_bits(packed, bits, n)]`` without materialising the indices; ``table = byte_table(...)``.

    For 1, 2, 4 and 8 bits every byte holds whole values, so one ``index_select`` into the 256-row table of
    value tuples decodes a byte at a time (about 3x faster than unpack + gather on CPU). Other widths
    unpack first and gather from the levels.
    """
    if 8 % bits:
        idx = unpack_bits(packed, bits, n)
        return table.index_select(0, idx.reshape(-1).int()).view(*idx.shape)
    vals = table.index_select(0, packed.reshape(-1).int()).view(*packed.shape[:-1], packed.shape[-1] * (8 // bits))
    return vals if vals.shape[-1] == n else vals[..., :n]


# -- a bit stream of per-coordinate widths (calibrated ``pcaq`` keys) --------------------------------------
def _stream_index(widths: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(positions in the ``[D, maxw]`` bit grid that carry stream bits, in stream order; total bits; maxw)."""
    maxw = max(int(widths.max()), 1)
    grid = torch.arange(maxw)[None, :] < widths[:, None]
    return grid.flatten().nonzero().flatten(), int(widths.sum()), maxw


def pack_widths(idx: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """``idx`` ``[..., D]`` (value ``j`` below ``2**widths[j]``) -> uint8 ``[..., ceil(sum(widths) / 8)]``: value
    ``j`` at stream bits ``[sum(widths[:j]), sum(widths[:j+1]))``, LSB first (this module's layout, one stream per row)."""
    pos, total, maxw = _stream_index(widths)
    shifts = torch.arange(maxw, device=idx.device)
    bits = ((idx.long()[..., None] >> shifts) & 1).flatten(-2)[..., pos.to(idx.device)]
    nbytes = (total + 7) // 8
    pad = nbytes * 8 - total
    if pad:
        bits = torch.cat([bits, bits.new_zeros(*bits.shape[:-1], pad)], dim=-1)
    weights = (1 << torch.arange(8, device=idx.device))
    return (bits.view(*bits.shape[:-1], nbytes, 8) * weights).sum(-1).to(torch.uint8)


def unpack_widths(packed: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_widths``: int64 ``[..., D]``."""
    pos, total, maxw = _stream_index(widths)
    d = widths.shape[0]
    shifts = torch.arange(8, device=packed.device)
    stream = ((packed.long()[..., None] >> shifts) & 1).flatten(-2)[..., :total]
    grid = stream.new_zeros(*stream.shape[:-1], d * maxw)
    grid[..., pos.to(packed.device)] = stream
    return (grid.view(*stream.shape[:-1], d, maxw) << torch.arange(maxw, device=packed.device)).sum(-1)
