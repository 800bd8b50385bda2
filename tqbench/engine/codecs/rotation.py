"""Fixed random orthogonal rotations (and the QJL Gaussian sketch), deterministic per (dim, kind, seed)."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

__all__ = ["ROTATIONS", "gaussian_matrix", "gaussian_matrix_bytes", "rotation_bytes", "rotation_matrix"]

ROTATIONS = ("qr", "hadamard")

# distinct seed streams so that a rotation and a QJL sketch with the same seed are independent
_STREAM = {"qr": 1, "hadamard": 2, "gaussian": 3}


def _rng(head_dim: int, seed: int, stream: str) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, head_dim, _STREAM[stream]]))


def _check(head_dim: int, kind: str) -> None:
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim must be a positive integer, got {head_dim!r}")
    if kind not in ROTATIONS:
        raise ValueError(f"unknown rotation {kind!r}: valid rotations are {', '.join(ROTATIONS)}")
    if kind == "hadamard" and head_dim & (head_dim - 1):
        raise ValueError(
            f"rotation=hadamard needs a power-of-two dimension, got {head_dim}: use rotation=qr for this head_dim"
        )


def _sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


@lru_cache(maxsize=64)
def _rotation(head_dim: int, kind: str, seed: int) -> np.ndarray:
    _check(head_dim, kind)
    rng = _rng(head_dim, seed, kind)
    if kind == "qr":
        q, r = np.linalg.qr(rng.standard_normal((head_dim, head_dim)))
        rot = q * np.where(np.diag(r) < 0, -1.0, 1.0)  # sign fix: Haar-distributed
    else:
        signs = rng.choice(np.array([-1.0, 1.0]), size=head_dim)
        rot = _sylvester(head_dim) * signs / np.sqrt(head_dim)  # H @ diag(signs), normalized
    rot.setflags(write=False)
    return rot


def rotation_matrix(head_dim: int, kind: str = "qr", seed: int = 0) -> torch.Tensor:
    """Orthogonal float64 ``[d, d]``: QR of a seeded Gaussian (sign-fixed) or a randomized Hadamard."""
    return torch.from_numpy(_rotation(head_dim, kind, seed).copy())


def rotation_bytes(head_dim: int, kind: str = "qr") -> int:
    """Bytes we count for storing the rotation: a dense fp32 matrix (qr) or the ``d`` random signs (hadamard)."""
    _check(head_dim, kind)
    return head_dim * head_dim * 4 if kind == "qr" else (head_dim + 7) // 8


@lru_cache(maxsize=32)
def _gaussian(head_dim: int, seed: int) -> np.ndarray:
    _check(head_dim, "qr")
    g = _rng(head_dim, seed, "gaussian").standard_normal((head_dim, head_dim))
    g.setflags(write=False)
    return g


def gaussian_matrix(head_dim: int, seed: int = 0) -> torch.Tensor:
    """Seeded i.i.d. ``N(0, 1)`` float64 ``[d, d]`` (the QJL sketch ``S``), independent of the rotations."""
    return torch.from_numpy(_gaussian(head_dim, seed).copy())


def gaussian_matrix_bytes(head_dim: int) -> int:
    """Bytes we count for the QJL sketch: a dense fp32 matrix."""
    return head_dim * head_dim * 4
