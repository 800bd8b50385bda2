"""vLLM's TurboQuant KV cache (``--kv-cache-dtype turboquant_*``), stored byte for byte as vLLM lays it out.

Read in vLLM 0.33.0 (``model_executor/layers/quantization/turboquant/{config,centroids}.py``,
``v1/attention/ops/triton_turboquant_store.py`` (the store kernels), ``triton_turboquant_decode.py`` (the
dequant), ``v1/attention/backends/turboquant_attn.py`` (the rotation)). vLLM packs one slot per token and KV head,
``[key bytes | value bytes]`` padded to an even length; the presets:

- ``turboquant_k8v4``: keys fp8 e4m3 without a scale (``fp8_e4m3``), values 4-bit uniform (``vllm_u4``):
  256 + 132 = 388 bytes per token and head at head_dim 256;
- ``turboquant_4bit_nc``: keys 4-bit Lloyd-Max (``vllm_tq4_nc``), values ``vllm_u4``: 130 + 132 = 262;
- ``turboquant_k3v4_nc``: keys 3-bit Lloyd-Max (``vllm_tq3_nc``), values ``vllm_u4``: 98 + 132 = 230;
- ``turboquant_3bit_nc``: keys ``vllm_tq3_nc``, values 3-bit uniform (``vllm_u3``): 98 + 100 = 198.

Keys (``vllm_tq{3,4}_nc``, the ``_mse`` store path): in fp32, ``norm = ||k||``, ``y = (k / (norm + 1e-8)) @ H``
with ``H`` the normalized Sylvester Hadamard matrix of order head_dim (no random signs: one matrix for every
layer), index ``i`` = the number of codebook midpoints ``<= y`` (the kernel's binary search), packed
little-endian (4-bit: element ``2j`` in the low nibble of byte ``j``; 3-bit: 8 indices in 3 bytes, element
``8g+j`` at bit ``3j``), then ``norm`` as fp16. The codebook is vLLM's Lloyd-Max solution for N(0, 1/D)
(``lloyd_max``: trapezoidal integrals of 200 steps on [-10.5, 10.5] sigma, up to 200 iterations, tolerance 1e-10),
its midpoints the fp32 means of neighbours. "nc" is vLLM's *norm correction*: the read-back centroid vector is
re-normalized to unit length (``c / sqrt(sum c^2 + 1e-16)``) before it is scaled by the stored norm; every MSE
preset has it. Keys read back as ``norm16 * c_unit @ H``.

Values (``vllm_u{3,4}``): per token and head over all head_dim values, ``scale = (max - min) / (2^b - 1)`` (at
least 1e-8), ``q = min(2^b - 1, floor((v - min) / scale + 0.5))``, packed as the keys' indices, then ``scale`` and
``min`` as fp16: read back as ``q * scale16 + min16``. No rotation.

What is not reproduced: the attention arithmetic (vLLM's Triton/CUDA kernels: prefill attends to the chunk's
raw K/V, decode reads these bytes); the CUDA fp32 reductions (``||k||``, the rotation GEMM) sum in another order
than torch on CPU, so an index whose ``y`` lies within an ulp of a midpoint can differ; Triton's fp32 division
may be approximate. On GPUs older than sm89 vLLM stores k8v4 keys as fp8 e4b15, not e4m3 (not reproduced).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from .base import Codec, Encoded, compute_dtype
from .names import BOUNDARY_LAYERS, VLLM_TQ_PRESETS  # torch-free: the policy grammar reads them

__all__ = ["BOUNDARY_LAYERS", "VLLM_TQ_PRESETS", "VllmTqKeyCodec", "VllmUniformCodec", "hadamard", "lloyd_max", "pack_bits",
           "unpack_bits"]



def lloyd_max(d: int, bits: int, max_iter: int = 200, tol: float = 1e-10) -> tuple[float, ...]:
    """vLLM's ``solve_lloyd_max(d, bits)`` rule: the sorted Lloyd-Max centroids for N(0, 1/d), in Python floats
    (then stored as fp32 by the codec), with the same integration and iteration."""
    n = 2**bits
    var = 1.0 / d
    sigma = math.sqrt(var)

    def pdf(x: float) -> float:
        return (1.0 / math.sqrt(2 * math.pi * var)) * math.exp(-x * x / (2 * var))

    def trapz(f, a: float, b: float, steps: int = 200) -> float:
        h = (b - a) / steps
        total = 0.5 * (f(a) + f(b))
        for i in range(1, steps):
            total += f(a + i * h)
        return total * h

    lo, hi = -3.5 * sigma, 3.5 * sigma
    cents = [lo + (hi - lo) * (i + 0.5) / n for i in range(n)]
    for _ in range(max_iter):
        mids = [(cents[i] + cents[i + 1]) / 2.0 for i in range(n - 1)]
        edges = [lo * 3, *mids, hi * 3]
        new = []
        for i in range(n):
            a, b = edges[i], edges[i + 1]
            num = trapz(lambda x: x * pdf(x), a, b)
            den = trapz(pdf, a, b)
            new.append(num / den if den > 1e-15 else cents[i])
        if max(abs(new[i] - cents[i]) for i in range(n)) < tol:
            break
        cents = new
    return tuple(cents)


@lru_cache(maxsize=16)
def _codebook(d: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    c = torch.tensor(lloyd_max(d, bits), dtype=torch.float32)
    c, _ = c.sort()
    return c, (c[:-1] + c[1:]) / 2


@lru_cache(maxsize=8)
def hadamard(d: int) -> torch.Tensor:
    """vLLM's ``_build_hadamard(d)``: the Sylvester matrix of order ``d`` (a power of two) over ``sqrt(d)``."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"vLLM's TurboQuant keys need head_dim a power of two (its Hadamard rotation), got {d}")
    h = torch.tensor([[1.0]])
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Indices ``[..., D]`` -> vLLM's packed bytes: 4-bit two per byte (even element low), 3-bit eight per three
    bytes (element ``8g + j`` at bit ``3j`` of a little-endian 24-bit group)."""
    q = q.to(torch.int32)
    if bits == 4:
        pairs = q.reshape(*q.shape[:-1], -1, 2)
        return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    if bits == 3:
        if q.shape[-1] % 8:
            raise ValueError(f"3-bit packing needs head_dim a multiple of 8, got {q.shape[-1]}")
        grp = q.reshape(*q.shape[:-1], -1, 8)
        word = (grp << (3 * torch.arange(8, dtype=torch.int32, device=q.device))).sum(-1)
        out = torch.stack([word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF], -1)
        return out.reshape(*q.shape[:-1], -1).to(torch.uint8)
    raise ValueError(f"vLLM's TurboQuant packs 3 or 4 bits, not {bits}")


def unpack_bits(b: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: ``[..., bytes]`` -> indices ``[..., d]`` (int64)."""
    b = b.to(torch.int64)
    if bits == 4:
        return torch.stack([b & 0xF, b >> 4], -1).reshape(*b.shape[:-1], d)
    grp = b.reshape(*b.shape[:-1], -1, 3)
    word = grp[..., 0] | (grp[..., 1] << 8) | (grp[..., 2] << 16)
    shifts = 3 * torch.arange(8, device=b.device)
    return ((word.unsqueeze(-1) >> shifts) & 7).reshape(*b.shape[:-1], d)


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).contiguous().view(torch.uint8)


def _read_f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).to(torch.float32)


class VllmTqKeyCodec(Codec):
    """``vllm_tq{3,4}_nc``: field ``bytes`` uint8 ``[B, H, T, ceil(D*b/8) + 2]``, vLLM's key bytes of a slot."""

    def __init__(self, bits: int) -> None:
        if bits not in (3, 4):
            raise ValueError(f"vLLM's TurboQuant keys have 3 or 4 bits, not {bits}")
        self.bits = bits
        self.spec = f"vllm_tq{bits}_nc"

    def _tables(self, d: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c, mids = _codebook(d, self.bits)
        return hadamard(d).to(device), c.to(device), mids.to(device)

    def encode(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> Encoded:
        self.check_input(x)
        d = x.shape[-1]
        h, _, mids = self._tables(d, x.device)
        k = x.to(torch.float32)
        norm = k.norm(dim=-1, keepdim=True)
        y = (k / (norm + 1e-8)) @ h
        idx = torch.bucketize(y, mids, right=True)  # the number of midpoints <= y (the kernel's binary search)
        return {"bytes": torch.cat([pack_bits(idx, self.bits), _f16_bytes(norm)], -1)}

    def decode(self, enc: Encoded, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        raw = enc["bytes"]
        d = (raw.shape[-1] - 2) * 8 // self.bits
        h, c, _ = self._tables(d, raw.device)
        vals = c[unpack_bits(raw[..., :-2], self.bits, d)]
        vals = vals * (1.0 / torch.sqrt((vals * vals).sum(-1, keepdim=True) + 1e-16))  # norm correction
        k = (_read_f16(raw[..., -2:]) * vals) @ h  # H is symmetric and orthonormal: its own inverse
        return k.to(compute_dtype(dtype)).to(dtype)

    def unit_bytes(self, head_dim: int) -> int:
        hadamard(head_dim)  # validates
        if self.bits == 3 and head_dim % 8:
            raise ValueError(f"3-bit packing needs head_dim a multiple of 8, got {head_dim}")
        return math.ceil(head_dim * self.bits / 8) + 2

    def shared_items(self, head_dim: int) -> dict[str, int]:
        # vLLM builds the Hadamard matrix and codebook from head_dim (nothing stored with the cache); counted as
        # tqbench counts its own rotations: D x D fp32 + the fp32 codebook, once
        return {f"vllm-hadamard{head_dim}": head_dim * head_dim * 4,
                f"vllm-lloyd-max{head_dim}x{self.bits}": 4 * 2**self.bits}


class VllmUniformCodec(Codec):
    """``vllm_u{3,4}``: field ``bytes`` uint8 ``[B, H, T, ceil(D*b/8) + 4]``, vLLM's value bytes of a slot."""

    def __init__(self, bits: int) -> None:
        if bits not in (3, 4):
            raise ValueError(f"vLLM's TurboQuant values have 3 or 4 bits, not {bits}")
        self.bits = bits
        self.spec = f"vllm_u{bits}"

    def encode(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> Encoded:
        self.check_input(x)
        v = x.to(torch.float32)
        top = 2**self.bits - 1
        vmin = v.amin(-1, keepdim=True)
        scale = (v.amax(-1, keepdim=True) - vmin) / float(top)
        scale = torch.where(scale > 1e-8, scale, torch.full_like(scale, 1e-8))
        q = ((v - vmin) / scale + 0.5).to(torch.int32).clamp(0, top)  # .to(int32) truncates, as the kernel's cast
        return {"bytes": torch.cat([pack_bits(q, self.bits), _f16_bytes(scale), _f16_bytes(vmin)], -1)}

    def decode(self, enc: Encoded, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        raw = enc["bytes"]
        d = (raw.shape[-1] - 4) * 8 // self.bits
        q = unpack_bits(raw[..., :-4], self.bits, d).to(torch.float32)
        v = q * _read_f16(raw[..., -4:-2]) + _read_f16(raw[..., -2:])
        return v.to(compute_dtype(dtype)).to(dtype)

    def unit_bytes(self, head_dim: int) -> int:
        if head_dim % (8 if self.bits == 3 else 2):
            raise ValueError(f"{self.bits}-bit packing needs head_dim a multiple of {8 if self.bits == 3 else 2}, "
                             f"got {head_dim}")
        return math.ceil(head_dim * self.bits / 8) + 4
