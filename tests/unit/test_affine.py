"""Affine int8/int4/int2: half-step round trips in both layouts, exact bytes, edge cases."""

from __future__ import annotations

import pytest
import torch

from tqbench.engine.codecs.affine import AffineChannelCodec, AffineTokenCodec, affine_params

F64 = torch.float64


def rows(b: int, h: int, t: int, d: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    spread = 5 * torch.rand(b, h, t, d, generator=g, dtype=F64)
    x = torch.randn(b, h, t, d, generator=g, dtype=F64) * spread
    return (x + 3 * torch.randn(1, h, 1, d, generator=g, dtype=F64)).to(dtype)


def field_bytes(enc: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in enc.values())


def _check_half_step(x: torch.Tensor, y: torch.Tensor, step: torch.Tensor) -> None:
    err = (x.double() - y.double()).abs()
    bound = step.double() / 2 * (1 + 1e-6) + 1e-6 * x.double().abs()
    assert bool((err <= bound).all()), (err - bound).max().item()


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("d,group", [(64, 32), (128, 32), (64, 5), (63, 7), (64, 64), (16, 32)])
def test_token_layout_half_step(bits: int, d: int, group: int) -> None:
    c = AffineTokenCodec(bits, group)
    x = rows(2, 3, 11, d, seed=bits + d + group)
    enc = c.encode(x, {})
    y = c.decode(enc, {}, torch.float32)
    assert y.shape == x.shape and y.dtype == torch.float32
    groups = -(-d // group)
    assert enc["scale"].shape == (2, 3, 11, groups) and enc["scale"].dtype == torch.float16
    assert enc["zero"].shape == (2, 3, 11, groups) and enc["zero"].dtype == torch.float16
    step = enc["scale"].repeat_interleave(group, dim=-1)[..., :d]
    _check_half_step(x, y, step)
    assert field_bytes(enc) == 2 * 3 * 11 * c.unit_bytes(d)
    # per-group min is at or above the stored zero, max within the covered range
    assert bool((enc["zero"].double().repeat_interleave(group, -1)[..., :d] <= x.double()).all())


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("d,block", [(64, 32), (128, 32), (63, 7), (16, 1)])
def test_channel_layout_half_step(bits: int, d: int, block: int) -> None:
    c = AffineChannelCodec(bits, block)
    assert c.tokens_per_unit == block
    x = rows(2, 2, 3 * block, d, seed=bits * d + block)
    enc = c.encode(x, {})
    assert enc["q"].shape == (2, 2, 3, (block * d * bits + 7) // 8)
    assert enc["scale"].shape == (2, 2, 3, d) and enc["zero"].shape == (2, 2, 3, d)
    y = c.decode(enc, {}, torch.float32)
    assert y.shape == x.shape
    step = enc["scale"].repeat_interleave(block, dim=2)
    _check_half_step(x, y, step)
    assert field_bytes(enc) == 2 * 2 * 3 * c.unit_bytes(d)
    # blocks are independent: encoding chunk by chunk gives the same bytes
    parts = [c.encode(x[:, :, i * block : (i + 1) * block], {}) for i in range(3)]
    for name in enc:
        assert torch.equal(enc[name], torch.cat([p[name] for p in parts], dim=2))


def test_channel_layout_is_per_channel() -> None:
    """KIVI keys: one channel with a huge range must not spoil the others' precision."""
    x = rows(1, 1, 32, 64, seed=0)
    x[..., 3] *= 1000
    y = AffineChannelCodec(4, 32).decode(AffineChannelCodec(4, 32).encode(x, {}), {}, torch.float32)
    others = torch.cat([x[..., :3], x[..., 4:]], -1) - torch.cat([y[..., :3], y[..., 4:]], -1)
    assert others.abs().max() < 2.0


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_hard_ranges(bits: int) -> None:
    """Offsets far from zero with a tiny spread (fp16 zero rounding), constant groups, fp16 and fp64 inputs."""
    g = torch.Generator().manual_seed(bits)
    x = 1000 + 1e-3 * torch.randn(1, 2, 4, 64, generator=g, dtype=F64)
    x[0, 1, 2] = -7.25  # constant row: scale 0, exact
    for dtype in (torch.float16, torch.float32, F64):
        xi = x.to(dtype)
        for c in (AffineTokenCodec(bits, 16), AffineChannelCodec(bits, 2)):
            enc = c.encode(xi, {})
            y = c.decode(enc, {}, F64)
            if isinstance(c, AffineTokenCodec):
                step = enc["scale"].repeat_interleave(16, dim=-1)
                assert torch.equal(y[0, 1, 2], xi[0, 1, 2].double())
            else:
                step = enc["scale"].repeat_interleave(2, dim=2)
            _check_half_step(xi, y, step)
            assert c.decode(enc, {}, dtype).dtype == dtype


def test_affine_params_bound_the_range() -> None:
    vmin = torch.tensor([0.1, -3.3, 1000.0001, 5.0], dtype=F64)
    vmax = torch.tensor([0.7, 2.2, 1000.0002, 5.0], dtype=F64)
    scale, zero = affine_params(vmin, vmax, 4)
    assert scale.dtype == zero.dtype == torch.float16
    assert bool((zero.double() <= vmin).all())
    assert bool((zero.double() + 15 * scale.double() >= vmax).all())
    assert scale[3] == 0 and zero[3] == 5.0


def test_validation() -> None:
    with pytest.raises(ValueError, match="8, 4, 2"):
        AffineTokenCodec(3)
    with pytest.raises(ValueError, match="group"):
        AffineTokenCodec(8, 0)
    with pytest.raises(ValueError, match="block"):
        AffineChannelCodec(8, -1)
    with pytest.raises(ValueError, match="multiple of the codec's block"):
        AffineChannelCodec(4, 32).encode(rows(1, 1, 20, 64, seed=0), {})
    with pytest.raises(ValueError, match="unambiguously"):
        AffineTokenCodec(4, 32).encode(rows(1, 1, 2, 63, seed=0), {})
