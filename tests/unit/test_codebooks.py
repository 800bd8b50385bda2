"""Lloyd-Max codebooks of a random unit vector's coordinate (and the rotations next to them)."""

from __future__ import annotations

import math

import pytest
import torch

from tqbench.engine.codecs.codebooks import codebook_mse, lloyd_max_codebook
from tqbench.engine.codecs.rotation import (
    gaussian_matrix,
    rotation_bytes,
    rotation_matrix,
)

# classic Lloyd-Max levels of N(0, 1) (positive half)
GAUSSIAN_LLOYD_MAX = {
    1: [0.7979],
    2: [0.4528, 1.5104],
    3: [0.2451, 0.7560, 1.3440, 2.1520],
    4: [0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326],
}


def _sphere_coordinates(d: int, n: int, seed: int) -> torch.Tensor:
    """First coordinate of ``n`` uniformly random unit vectors in R^d (the exact target distribution)."""
    g = torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return g[:, 0] / g.norm(dim=1)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_large_d_matches_gaussian_lloyd_max(bits: int) -> None:
    levels = lloyd_max_codebook(4096, bits) * math.sqrt(4096)
    expected = torch.tensor(GAUSSIAN_LLOYD_MAX[bits], dtype=torch.float64)
    half = 1 << (bits - 1)
    assert torch.allclose(levels[half:], expected, atol=1e-2)
    assert torch.allclose(levels[:half], -expected.flip(0), atol=1e-2)


@pytest.mark.parametrize("d", [2, 3, 8, 32, 64, 128])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_symmetric_sorted_float64(d: int, bits: int) -> None:
    c = lloyd_max_codebook(d, bits)
    assert c.dtype == torch.float64 and c.shape == (1 << bits,)
    assert bool((c[1:] > c[:-1]).all())
    assert torch.equal(c, -c.flip(0))
    assert bool((c.abs() < 1).all())


def test_uniform_case_is_exact() -> None:
    # d = 3: a coordinate of a random unit vector is uniform on [-1, 1]
    for bits in (1, 2, 3):
        k = 1 << bits
        exact = torch.tensor([-1 + (2 * i + 1) / k for i in range(k)], dtype=torch.float64)
        assert torch.allclose(lloyd_max_codebook(3, bits), exact, atol=1e-6)


@pytest.mark.parametrize("d,bits", [(32, 2), (64, 3), (128, 4)])
def test_levels_are_centroids_of_their_cells(d: int, bits: int) -> None:
    """Lloyd-Max optimality, checked against samples of the true distribution (independent of the grid)."""
    z = _sphere_coordinates(d, 200_000, seed=d + bits)
    c = lloyd_max_codebook(d, bits)
    cell = torch.bucketize(z, 0.5 * (c[1:] + c[:-1]))
    for i in range(1 << bits):
        zi = z[cell == i]
        se = zi.std() / math.sqrt(zi.numel())
        assert abs(zi.mean() - c[i]) < 5 * se + 1e-9, (i, zi.mean().item(), c[i].item())
    mse = d * ((z - c[cell]) ** 2).mean().item()
    assert mse == pytest.approx(codebook_mse(d, bits), rel=0.02)


def test_not_equal_probability_quantiles() -> None:
    d, bits = 128, 3
    z = _sphere_coordinates(d, 100_000, seed=1).sort().values
    k = 1 << bits
    quantile_levels = z[[int((i + 0.5) / k * z.numel()) for i in range(k)]]
    lm = lloyd_max_codebook(d, bits)
    assert (lm - quantile_levels).abs().max() * math.sqrt(d) > 0.1

    def mse(levels: torch.Tensor) -> float:
        q = levels[torch.bucketize(z, 0.5 * (levels[1:] + levels[:-1]))]
        return d * ((z - q) ** 2).mean().item()

    assert mse(lm) < 0.8 * mse(quantile_levels)


def test_codebook_is_a_copy_and_validated() -> None:
    c = lloyd_max_codebook(64, 2)
    kept = c.clone()
    c.zero_()  # the caller's copy: the cached codebook must not change
    again = lloyd_max_codebook(64, 2)
    assert torch.equal(again, kept), again
    # near the Gaussian Lloyd-Max levels +-0.4528, +-1.510 scaled by 1/sqrt(64) (the rotated coordinate's law)
    gauss = torch.tensor([-1.510, -0.4528, 0.4528, 1.510], dtype=again.dtype) / 8
    torch.testing.assert_close(again, gauss, rtol=0.01, atol=0.0)
    with pytest.raises(ValueError, match="head_dim"):
        lloyd_max_codebook(1, 2)
    with pytest.raises(ValueError, match="bits"):
        lloyd_max_codebook(64, 0)


@pytest.mark.parametrize("kind,d", [("qr", 64), ("qr", 96), ("hadamard", 64), ("hadamard", 128)])
def test_rotation_orthogonal_and_deterministic(kind: str, d: int) -> None:
    r = rotation_matrix(d, kind, seed=3)
    assert r.dtype == torch.float64 and r.shape == (d, d)
    assert torch.allclose(r @ r.T, torch.eye(d, dtype=torch.float64), atol=1e-12)
    assert torch.equal(r, rotation_matrix(d, kind, seed=3))
    assert not torch.equal(r, rotation_matrix(d, kind, seed=4))


def test_rotation_bytes_and_errors() -> None:
    assert rotation_bytes(128, "qr") == 128 * 128 * 4
    assert rotation_bytes(128, "hadamard") == 16
    with pytest.raises(ValueError, match="rotation=qr"):
        rotation_matrix(96, "hadamard")
    with pytest.raises(ValueError, match="qr, hadamard"):
        rotation_matrix(64, "givens")


def test_qjl_sketch_independent_of_rotation() -> None:
    s = gaussian_matrix(64, seed=0)
    assert torch.equal(s, gaussian_matrix(64, seed=0))
    assert abs(s.std().item() - 1) < 0.05
    # a different seed stream: S is not the Gaussian whose (sign-fixed) QR factor is the rotation
    q, r = torch.linalg.qr(s)
    q = q * torch.where(torch.diagonal(r) < 0, -1.0, 1.0)
    assert not torch.allclose(q, rotation_matrix(64, "qr", 0), atol=1e-6)
