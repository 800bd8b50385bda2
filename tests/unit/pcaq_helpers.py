"""A random calibrated (``pcaq``) packed side for the kernel tests (native CPU and Triton)."""

from __future__ import annotations

import torch

from tqbench.kernels.packing import pack_widths
from tqbench.kernels.reference import PackedSide


def random_pcaq_side(b, h, n, d, maxw, dt, gen, *, centred=True, device="cpu"):
    """(PackedSide, its rows in float64 [b, h, n, d]): random widths (a permutation per head: equal bytes),
    levels, transforms and codes."""
    base = torch.randint(0, maxw + 1, (d,), generator=gen)
    base[0] = maxw  # the widest width is in use
    widths = torch.stack([base[torch.randperm(d, generator=gen)] for _ in range(h)]).to(torch.uint8)
    levels = torch.randn(h, d, 1 << maxw, generator=gen, dtype=torch.float64)
    transform = torch.randn(h, d, d, generator=gen, dtype=torch.float64) / d ** 0.5
    idx = torch.stack([torch.randint(0, 1 << int(w), (b, n), generator=gen) for w in widths.flatten()], -1)
    idx = idx.view(b, n, h, d).permute(0, 2, 1, 3)
    packed = torch.stack([pack_widths(idx[:, i], widths[i].long()) for i in range(h)], 1)
    mu = (torch.randn(b, h, 1, d, generator=gen) * 0.5).half() if centred else None
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    side = PackedSide("pcaq", maxw, {"idx": packed.to(device)}, n, d, levels=levels.to(device, dt),
                      rotation=transform.to(device, dt), mu=dev(mu), widths=widths.to(device))
    z = levels[None, :, None].expand(b, h, n, d, 1 << maxw).gather(-1, idx[..., None]).squeeze(-1)
    rows = torch.einsum("bhnj,hjd->bhnd", z, transform) + (0 if mu is None else mu.double())
    return side, rows
