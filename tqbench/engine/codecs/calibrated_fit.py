"""Fitting calibrated key transforms: PCA in the metric of the queries' second moment, bits by reverse
water-filling, Lloyd-Max levels per group of coordinates. Pure torch (no model): ``engine/calibrate`` captures
the K/Q rows and calls ``fit_layer``; the codec (``calibrated.py``) reads the result (``CalibratedTransforms``).

Why this metric: the score error of a quantized key is ``q.(k - k_hat)``, so its expected square over the
queries is ``(k - k_hat)^T M (k - k_hat)`` with ``M = E[q q^T]``. With ``S = M^(1/2)``, PCA of ``S k`` gives
coordinates whose squared errors add up to exactly that score error: ``z = U^T S (k - mu)``, decoded as
``k_hat = mu + B z_hat`` with ``B = S^-1 U``. ``B`` is orthonormal in the metric ``M`` (``B^T M B = I``), and
``q.k_hat = (B^T q).z_hat + q.mu`` keeps scores computable from the coordinates.

Stored per (layer, KV head), coordinates sorted by variance (largest first):
- ``basis`` ``[D, D]`` (int8) and ``scale`` ``[D]`` (fp16): the columns ``B_j sigma_j`` (``sigma_j`` the
  coordinate's standard deviation, floored at ``1e-3`` of the largest) as int8 with one fp16 scale per column:
  ``B_hat = basis * scale``. The codec encodes with the exact inverse of ``B_hat``, so rounding the basis only
  tilts the coordinates slightly (decode(encode) stays consistent), at half the bytes of an fp16 basis;
- ``var`` ``[D]`` (fp32): ``sigma_j^2``, used only to water-fill the bits at construction;
- ``levels`` ``[G, 126]`` (fp16): Lloyd-Max levels of the standardized coordinates of each group of ``GROUP``
  consecutive coordinates, widths 1..``MAX_BITS`` concatenated (2 + 4 + ... + 64 values);
- ``mse`` ``[G, MAX_BITS + 1]`` (fp32): each group's normalized distortion at widths 0..``MAX_BITS``.
"""

from __future__ import annotations

import math

import torch

from .codebooks import lloyd_max_codebook
from .names import PCAQ_MAX_BITS

__all__ = [
    "GROUP",
    "MAX_BITS",
    "fit_head",
    "level_offset",
    "lloyd_levels",
    "metric_pca",
    "quantize_basis",
    "water_fill",
]

#: coordinates per Lloyd-Max level group
GROUP = 8
#: the widest code one coordinate can get (defined torch-free in names.py, which checks pcaq names)
MAX_BITS = PCAQ_MAX_BITS
#: the unit-sphere dimension whose Lloyd-Max codebook (rescaled) stands in for the Gaussian one
_GAUSS_DIM = 4096
#: samples per group the level fit uses (evenly strided when there are more)
MAX_SAMPLES = 4096
#: total levels per group for widths 1..MAX_BITS
LEVELS_PER_GROUP = sum(1 << b for b in range(1, MAX_BITS + 1))


def level_offset(bits: int) -> int:
    """Where the levels of width ``bits`` start in a group's concatenated table."""
    return sum(1 << b for b in range(1, bits))


def metric_pca(k: torch.Tensor, q: torch.Tensor, ridge: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """(B ``[D, D]``, variances ``[D]``) of centered keys ``k`` ``[N, D]`` in the metric of queries ``q`` ``[M, D]``.

    ``B`` columns are orthonormal in ``M = E[q q^T] + ridge * tr(M)/D * I`` and sorted by the variance of the
    key coordinate along them (descending); ``var_j = E[z_j^2]`` with ``z = B^-1 k``."""
    k, q = k.double(), q.double()
    d = k.shape[-1]
    m = q.T @ q / max(q.shape[0], 1)
    m = m + ridge * torch.trace(m) / d * torch.eye(d, dtype=m.dtype)
    ev, ew = torch.linalg.eigh(m)
    ev = ev.clamp_min(ev.max() * 1e-12)
    s = (ew * ev.sqrt()) @ ew.T  # M^(1/2)
    s_inv = (ew / ev.sqrt()) @ ew.T
    ck = k.T @ k / max(k.shape[0], 1)
    lam, u = torch.linalg.eigh(s @ ck @ s)
    order = lam.argsort(descending=True)
    lam, u = lam[order].clamp_min(0), u[:, order]
    # deterministic signs: the largest-magnitude entry of each column positive
    sign = torch.sign(u.gather(0, u.abs().argmax(0, keepdim=True))).squeeze(0)
    u = u * torch.where(sign == 0, 1.0, sign)
    return s_inv @ u, lam


def lloyd_levels(x: torch.Tensor, bits: int, iters: int = 30) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd-Max levels for each row of samples ``x`` ``[G, N]`` (one quantizer per row): sorted levels
    ``[G, 2**bits]`` and the mean squared error ``[G]`` they give on ``x``. Starts from the Gaussian Lloyd-Max
    levels (``codebooks``: a coordinate of a random unit vector in high dimension, rescaled) fitted to each
    row's standard deviation, which converges in far fewer steps than equal-probability cells at 4-6 bits."""
    x = x.double()
    if x.dim() == 1:
        x = x[None]
    g, n_samples = x.shape
    n = 1 << bits
    gauss = lloyd_max_codebook(_GAUSS_DIM, bits).to(x.dtype) * math.sqrt(_GAUSS_DIM)
    levels = (x.std(dim=1, keepdim=True).clamp_min(1e-12) * gauss[None] + x.mean(dim=1, keepdim=True)).contiguous()
    rows = torch.arange(g)[:, None] * n
    for _ in range(iters):
        bounds = (0.5 * (levels[:, 1:] + levels[:, :-1])).contiguous()
        flat = (torch.searchsorted(bounds, x) + rows).flatten()
        cnt = torch.bincount(flat, minlength=g * n).view(g, n).to(x.dtype)
        tot = torch.bincount(flat, weights=x.flatten(), minlength=g * n).view(g, n)
        new = torch.where(cnt > 0, tot / cnt.clamp_min(1), levels).sort(dim=1).values
        done = bool((new - levels).abs().max() < 1e-7)
        levels = new
        if done:
            break
    bounds = (0.5 * (levels[:, 1:] + levels[:, :-1])).contiguous()
    err = ((x - levels.gather(1, torch.searchsorted(bounds, x))) ** 2).mean(dim=1) if n_samples else x.new_zeros(g)
    return levels, err


def fit_head(k: torch.Tensor, q: torch.Tensor, ridge: float = 1e-4) -> dict[str, torch.Tensor]:
    """One (layer, KV head): centered keys ``k`` ``[N, D]``, its query group's queries ``q`` ``[M, D]`` ->
    ``basis``, ``scale``, ``var``, ``levels``, ``mse`` (see the module docstring)."""
    d = k.shape[-1]
    if d % GROUP:
        raise ValueError(f"calibrated transforms need head_dim divisible by {GROUP}, got {d}")
    b, var = metric_pca(k, q, ridge)
    sigma = var.sqrt()
    sigma = sigma.clamp_min(float(sigma.max()) * 1e-3 + 1e-30)
    basis, col = quantize_basis(b * sigma)
    z = torch.linalg.solve(basis.double() * col.double(), k.double().T).T  # standardized coordinates [N, D]
    groups = d // GROUP
    # one sample row per group of coordinates (at most MAX_SAMPLES, evenly strided)
    xs = z.reshape(-1, groups, GROUP).permute(1, 0, 2).reshape(groups, -1)
    if xs.shape[1] > MAX_SAMPLES:
        xs = xs[:, torch.linspace(0, xs.shape[1] - 1, MAX_SAMPLES).long()]
    levels = torch.zeros(groups, LEVELS_PER_GROUP, dtype=torch.float64)
    mse = torch.ones(groups, MAX_BITS + 1, dtype=torch.float64)
    mse[:, 0] = (xs**2).mean(dim=1)
    for bits in range(1, MAX_BITS + 1):
        lv, err = lloyd_levels(xs, bits)
        off = level_offset(bits)
        levels[:, off:off + (1 << bits)] = lv
        mse[:, bits] = err
    return {"basis": basis, "scale": col, "var": var.float(),
            "levels": levels.to(torch.float16), "mse": mse.float()}


def quantize_basis(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Columns of ``b`` ``[D, D]`` as int8 with one fp16 scale each (``b ~ q * scale``)."""
    col = (b.abs().amax(dim=0) / 127).to(torch.float16).clamp_min(torch.finfo(torch.float16).tiny)
    q = torch.round(b / col.double()).clamp(-127, 127).to(torch.int8)
    return q, col


def water_fill(var: torch.Tensor, mse: torch.Tensor, total_bits: int, max_bits: int = MAX_BITS) -> torch.Tensor:
    """Integer bits per coordinate (``int64 [D]``) summing to exactly ``total_bits``: reverse water-filling by
    greedy marginal gain, one bit at a time to the coordinate whose expected squared error falls most
    (``var_j * mse[group(j), b]``). Ties go to the lower coordinate index (deterministic)."""
    d = var.shape[-1]
    if isinstance(total_bits, bool) or not isinstance(total_bits, int) or not 0 <= total_bits <= d * max_bits:
        raise ValueError(f"total bits {total_bits!r} is out of range 0..{d * max_bits} for {d} coordinates")
    var = var.double()
    per = mse.double().repeat_interleave(GROUP, dim=0)[:d]  # [D, MAX_BITS + 1]
    # make each coordinate's distortion curve non-increasing (an empirical fit may wobble at the top widths)
    per = torch.cummin(per, dim=1).values
    bits = torch.zeros(d, dtype=torch.long)
    gain = var * (per[:, 0] - per[:, 1])
    for _ in range(total_bits):
        j = int(torch.argmax(gain))
        bits[j] += 1
        b = int(bits[j])
        gain[j] = var[j] * (per[j, b] - per[j, b + 1]) if b < max_bits else -math.inf
    return bits
