"""Dense bit packing: round trips, exact byte counts, the documented bit layout, errors."""

from __future__ import annotations

import pytest
import torch

from tqbench.kernels.packing import max_values, pack_bits, packed_nbytes, unpack_bits


def _reference_pack(values: list[int], bits: int) -> list[int]:
    """LSB-first bit stream, written the slow obvious way."""
    stream = 0
    for i, v in enumerate(values):
        stream |= v << (i * bits)
    return [(stream >> (8 * j)) & 0xFF for j in range((len(values) * bits + 7) // 8)]


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [1, 7, 8, 63, 64, 65])
@pytest.mark.parametrize("lead", [(), (3,), (2, 1, 5)])
def test_round_trip_and_byte_count(bits: int, n: int, lead: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(bits * 1000 + n)
    idx = torch.randint(0, 1 << bits, (*lead, n), generator=g, dtype=torch.uint8)
    packed = pack_bits(idx, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (*lead, (n * bits + 7) // 8)
    assert packed_nbytes(n, bits) == packed.shape[-1]
    assert torch.equal(unpack_bits(packed, bits, n), idx)


@pytest.mark.parametrize("bits", range(1, 9))
def test_layout_matches_reference_bit_stream(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    idx = torch.randint(0, 1 << bits, (4, 37), generator=g, dtype=torch.uint8)
    packed = pack_bits(idx, bits)
    for row in range(4):
        assert packed[row].tolist() == _reference_pack(idx[row].tolist(), bits)


def test_known_layouts() -> None:
    assert pack_bits(torch.tensor([1, 2], dtype=torch.uint8), 4).tolist() == [0x21]
    assert pack_bits(torch.tensor([1, 2, 3, 0], dtype=torch.uint8), 2).tolist() == [0b00111001]
    assert pack_bits(torch.tensor([1, 0, 1, 1, 0, 0, 0, 1, 1], dtype=torch.uint8), 1).tolist() == [0x8D, 0x01]
    # 3-bit is dense: 8 values in 3 bytes, 128 values in 48 bytes
    assert pack_bits(torch.arange(8, dtype=torch.uint8), 3).shape == (3,)
    assert packed_nbytes(128, 3) == 48 and packed_nbytes(63, 3) == 24 and packed_nbytes(65, 5) == 41


def test_non_contiguous_input() -> None:
    idx = torch.randint(0, 8, (16, 10), dtype=torch.uint8).t()  # [10, 16], non-contiguous
    assert torch.equal(unpack_bits(pack_bits(idx, 3), 3, 16), idx)


def test_max_values() -> None:
    assert max_values(packed_nbytes(64, 3), 3) == 64
    assert max_values(packed_nbytes(63, 4), 4) == 64


def test_errors() -> None:
    idx = torch.zeros(5, dtype=torch.uint8)
    for bad in (0, 9, 2.0, True):
        with pytest.raises(ValueError, match="bits"):
            pack_bits(idx, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="does not fit in 2 bits"):
        pack_bits(torch.tensor([0, 4], dtype=torch.uint8), 2)
    with pytest.raises(TypeError, match="uint8"):
        pack_bits(torch.zeros(4, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="need 2 bytes, got 3"):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), 3, 5)
    with pytest.raises(TypeError, match="uint8"):
        unpack_bits(torch.zeros(3, dtype=torch.int32), 3, 8)
