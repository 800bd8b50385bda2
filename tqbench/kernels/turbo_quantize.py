"""Quantize + pack new TurboQuant rows in one pass (Triton): ``_turbo_quantize_kernel`` and its launcher.

Per row: subtract the centering mean, take the norm, rotate the unit row (``u @ R.T``, one ``tl.dot``),
pick each coordinate's Lloyd-Max level (count of boundaries below it, as ``torch.bucketize``), apply the
least-squares norm correction, and write the codes packed LSB-first (any width 1..8: each code's low and
high byte contributions are summed into their bytes through a one-hot reduction; bits never overlap) plus
the fp16 norm: exactly the ``{"idx", "norm"}`` that ``TurboCodec.encode`` stores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _turbo_quantize_kernel(
    X, MU, R, LV, BND, IDX_OUT, NORM_OUT,
    rows, H, T, sxb, sxh, sxt,
    D: tl.constexpr, BITS: tl.constexpr, NBYTES: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr, HAS_MU: tl.constexpr, NORM_FIX: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_r = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    r_mask = offs_r < rows
    d_mask = offs_d < D
    m2 = r_mask[:, None] & d_mask[None, :]
    bi = offs_r // (H * T)
    hi = (offs_r // T) % H
    ti = offs_r % T
    x = tl.load(X + (bi * sxb + hi * sxh + ti * sxt)[:, None] + offs_d[None, :], mask=m2, other=0.0)
    x = x.to(tl.float32)
    if HAS_MU:
        mu = tl.load(MU + (bi * H + hi)[:, None] * D + offs_d[None, :], mask=m2, other=0.0).to(tl.float32)
        x = tl.where(m2, x - mu, 0.0)
    n = tl.sqrt(tl.sum(x * x, axis=1))
    u = x / tl.maximum(n, 1.1754943508222875e-38)[:, None]
    rmat = tl.load(R + offs_d[:, None] * D + offs_d[None, :], mask=d_mask[:, None] & d_mask[None, :], other=0.0)
    u_rot = tl.dot(u, tl.trans(rmat), input_precision="ieee")
    code = tl.zeros((BLOCK_T, BLOCK_D), tl.int32)
    for i in tl.static_range((1 << BITS) - 1):
        code += (u_rot > tl.load(BND + i)).to(tl.int32)
    if NORM_FIX:
        c = tl.load(LV + code, mask=m2, other=0.0)
        n = n * tl.sum(u_rot * c, axis=1) / tl.maximum(tl.sum(c * c, axis=1), 1.1754943508222875e-38)
    code = tl.where(m2, code, 0)
    pos = offs_d * BITS
    sh = pos % 8
    low = (code << sh[None, :]) & 255
    high = code >> (8 - sh)[None, :]
    offs_b = tl.arange(0, BLOCK_B)
    hit_lo = (pos // 8)[:, None] == offs_b[None, :]
    hit_hi = ((pos // 8) + 1)[:, None] == offs_b[None, :]
    packed = tl.sum(tl.where(hit_lo[None, :, :], low[:, :, None], 0), axis=1)
    packed += tl.sum(tl.where(hit_hi[None, :, :], high[:, :, None], 0), axis=1)
    b_mask = r_mask[:, None] & (offs_b < NBYTES)[None, :]
    tl.store(IDX_OUT + offs_r[:, None] * NBYTES + offs_b[None, :], packed.to(tl.uint8), mask=b_mask)
    n = tl.minimum(tl.maximum(n, 0.0), 65504.0)
    tl.store(NORM_OUT + offs_r, n.to(tl.float16), mask=r_mask)


def turbo_quantize(
    x: torch.Tensor, mu: torch.Tensor | None, rotation: torch.Tensor, levels: torch.Tensor, bits: int,
    norm_correction: bool = True, *, block_t: int = 16,
) -> dict[str, torch.Tensor]:
    """Triton twin of :func:`tqbench.kernels.reference.turbo_quantize_pack`: ``[B, H, T, D]`` -> idx, norm."""
    if x.dim() != 4:
        raise ValueError(f"x (the rows) must be [batch, kv_heads, tokens, head_dim], got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x: row dtype {x.dtype} is not supported by the kernel (fp16, bf16, fp32)")
    if x.stride(-1) != 1:
        raise ValueError(f"x: the last dimension must be contiguous (strides {x.stride()})")
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")
    b, h, t, d = x.shape
    if d < 1:
        raise ValueError("x has head_dim 0")
    for name, c in (("rotation", rotation), ("levels", levels), ("mu", mu)):
        if (c is not None or name != "mu") and (not isinstance(c, torch.Tensor) or not c.is_floating_point()):
            raise ValueError(f"{name} must be a floating-point tensor, got "
                             f"{c.dtype if isinstance(c, torch.Tensor) else type(c).__name__}")
    if tuple(rotation.shape) != (d, d):
        raise ValueError(f"rotation must be [{d}, {d}], got {tuple(rotation.shape)}")
    if tuple(levels.shape) != (1 << bits,):
        raise ValueError(f"levels must hold {1 << bits} values, got {tuple(levels.shape)}")
    if mu is not None and tuple(mu.shape) != (b, h, 1, d):
        raise ValueError(f"mu must be [{b}, {h}, 1, {d}], got {tuple(mu.shape)}")
    dev = x.device
    lv = levels.to(device=dev, dtype=torch.float32).contiguous()
    bounds = (0.5 * (lv[1:] + lv[:-1])).contiguous()
    rot = rotation.to(device=dev, dtype=torch.float32).contiguous()
    nbytes = (d * bits + 7) // 8
    rows = b * h * t
    idx = torch.empty(b, h, t, nbytes, device=dev, dtype=torch.uint8)
    norm = torch.empty(b, h, t, 1, device=dev, dtype=torch.float16)
    mu_c = mu.to(device=dev).contiguous() if mu is not None else x
    grid = (triton.cdiv(max(rows, 1), block_t),)
    _turbo_quantize_kernel[grid](
        x, mu_c, rot, lv, bounds, idx, norm, rows, h, t, x.stride(0), x.stride(1), x.stride(2),
        D=d, BITS=bits, NBYTES=nbytes, BLOCK_T=block_t, BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_B=max(16, triton.next_power_of_2(nbytes)), HAS_MU=mu is not None, NORM_FIX=norm_correction,
    )
    return {"idx": idx, "norm": norm}
