"""Lloyd-Max codebooks for one coordinate of a uniformly random unit vector in R^d.

The coordinate has density ``f(x) ∝ (1 - x^2)^((d-3)/2)`` on ``[-1, 1]`` (a scaled Beta, close to
``N(0, 1/d)``). We substitute ``x = sin(t)``, which turns it into the smooth density ``cos(t)^(d-2)`` on
``[-pi/2, pi/2]`` for every ``d >= 2``, tabulate the cumulative mass and first moment on a fine grid, and run
Lloyd's centroid/boundary iteration to convergence in float64.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

__all__ = ["codebook_mse", "lloyd_max_codebook"]

_GRID = 1 << 17
_TAIL_SIGMAS = 14.0


@lru_cache(maxsize=64)
def _tables(head_dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Grid ``x`` and cumulative mass / first / second moment of the coordinate density."""
    limit = min(1.0, _TAIL_SIGMAS / np.sqrt(head_dim))
    tmax = np.pi / 2 if limit >= 1.0 else float(np.arcsin(limit))
    t = np.linspace(-tmax, tmax, _GRID + 1)
    logw = (head_dim - 2) * np.log(np.maximum(np.cos(t), 1e-300)) if head_dim > 2 else np.zeros_like(t)
    w = np.exp(logw - logw.max())
    x = np.sin(t)
    cum = []
    for p in (w, w * x, w * x * x):  # trapezoid cumulative integrals over t
        seg = 0.5 * (p[1:] + p[:-1]) * np.diff(t)
        cum.append(np.concatenate([[0.0], np.cumsum(seg)]))
    mass = cum[0][-1]
    return x, cum[0] / mass, cum[1] / mass, cum[2] / mass


def _validate(head_dim: int, bits: int) -> None:
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2:
        raise ValueError(f"head_dim must be an integer >= 2, got {head_dim!r}")
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")


@lru_cache(maxsize=128)
def _levels(head_dim: int, bits: int) -> np.ndarray:
    _validate(head_dim, bits)
    x, cdf, m1, _ = _tables(head_dim)
    k = 1 << bits
    # start from equal-probability cells, then iterate Lloyd-Max to convergence
    edges = np.interp(np.linspace(0.0, 1.0, k + 1), cdf, x)
    edges[0], edges[-1] = x[0], x[-1]
    levels = 0.5 * (edges[1:] + edges[:-1])
    tol = 1e-13 / np.sqrt(head_dim)
    for _ in range(100_000):
        bounds = np.concatenate([[x[0]], 0.5 * (levels[1:] + levels[:-1]), [x[-1]]])
        p = np.diff(np.interp(bounds, x, cdf))
        mom = np.diff(np.interp(bounds, x, m1))
        new = np.where(p > 0, mom / np.maximum(p, 1e-300), levels)
        done = np.max(np.abs(new - levels)) < tol
        levels = new
        if done:
            break
    levels = 0.5 * (levels - levels[::-1])  # exact symmetry
    levels.setflags(write=False)
    return levels


def lloyd_max_codebook(head_dim: int, bits: int) -> torch.Tensor:
    """Sorted float64 levels ``[2**bits]`` of the Lloyd-Max quantizer for one coordinate of a random unit vector.

    ``head_dim`` is the dimension of the vector being rotated (a sub-block's size for outlier splits).
    """
    return torch.from_numpy(_levels(head_dim, bits).copy())


@lru_cache(maxsize=128)
def codebook_mse(head_dim: int, bits: int) -> float:
    """Expected ``||u - u_hat||^2`` for a random unit vector quantized coordinate-wise with this codebook."""
    levels = _levels(head_dim, bits)
    x, cdf, m1, m2 = _tables(head_dim)
    bounds = np.concatenate([[x[0]], 0.5 * (levels[1:] + levels[:-1]), [x[-1]]])
    p = np.diff(np.interp(bounds, x, cdf))
    mom1 = np.diff(np.interp(bounds, x, m1))
    mom2 = np.diff(np.interp(bounds, x, m2))
    per_coord = float(np.sum(mom2 - 2 * levels * mom1 + levels * levels * p))
    return head_dim * per_coord
