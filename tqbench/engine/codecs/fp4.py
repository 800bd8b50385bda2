"""SGLang's ``fp4_mx_block16`` KV cache (``--kv-cache-dtype fp4_mx_block16``): FP4 E2M1 values in blocks of 16
along head_dim, each block with one exponent-only scale byte (MX style, but 16 values where OCP MXFP4 has 32).

As SGLang 0.5.23 computes it (``FP4MXBlock16KVQuantizeUtil`` in ``srt/layers/quantization/kvfp4_tensor.py``):
``e = ceil(log2(max(amax / 6, 1e-10)))``, stored as ``e + 127`` (uint8); each value ``x / 2**e`` becomes the E2M1
code whose magnitude bucket it reaches (bounds 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5: a value on a bound goes
up), sign in bit 3; two codes per byte, the even element in the low nibble. In the model's own dtype, as
SGLang does (fp64 rows are quantized in fp32). 16 values = 8 bytes of codes + 1 scale byte: 4.5 bits/element.
"""

from __future__ import annotations

import torch

from .base import Codec, Encoded

__all__ = ["E2M1_LEVELS", "Fp4Block16Codec"]

BLOCK = 16
E2M1_MAX = 6.0
E2M1_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


class Fp4Block16Codec(Codec):
    """Fields ``q`` (uint8 ``[B, H, T, D/2]``: the codes) and ``scale`` (uint8 ``[B, H, T, D/16]``: ``e + 127``)."""

    tokens_per_unit = 1

    def __init__(self) -> None:
        self.spec = "fp4_mx_block16"

    def _check_dim(self, head_dim: int) -> None:
        if head_dim % BLOCK:
            raise ValueError(f"{self.spec}: head_dim {head_dim} is not a multiple of its block of {BLOCK} values")

    def encode(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> Encoded:
        self.check_input(x)
        b, h, t, d = x.shape
        self._check_dim(d)
        xc = x if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else x.to(torch.float32)
        blocks = xc.reshape(b, h, t, d // BLOCK, BLOCK)
        amax = blocks.abs().amax(-1, keepdim=True)
        e = torch.ceil(torch.log2(torch.clamp(amax / E2M1_MAX, min=1e-10)))
        scaled = blocks / torch.exp2(e)
        sign = (scaled < 0).to(torch.uint8) << 3
        bounds = torch.tensor(E2M1_BOUNDS, dtype=torch.float32, device=x.device)
        mag = (scaled.abs().unsqueeze(-1) >= bounds).sum(-1).to(torch.uint8)
        codes = (sign + mag).reshape(b, h, t, d)
        return {"q": (codes[..., 1::2] << 4) + codes[..., 0::2], "scale": (e + 127).squeeze(-1).to(torch.uint8)}

    def decode(self, enc: Encoded, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        q, scale = enc["q"], enc["scale"]
        b, h, t, half = q.shape
        codes = torch.stack([q & 0x0F, (q >> 4) & 0x0F], dim=-1).reshape(b, h, t, 2 * half)
        levels = torch.tensor(E2M1_LEVELS, dtype=torch.float32, device=q.device)
        vals = levels[(codes & 0x07).long()]
        vals = torch.where((codes & 0x08) != 0, -vals, vals).reshape(b, h, t, -1, BLOCK)
        vals = vals * torch.exp2(scale.to(torch.float32) - 127).unsqueeze(-1)
        return vals.reshape(b, h, t, 2 * half).to(dtype)

    def unit_bytes(self, head_dim: int) -> int:
        self._check_dim(head_dim)
        return head_dim // 2 + head_dim // BLOCK
