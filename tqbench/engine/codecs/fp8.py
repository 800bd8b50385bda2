"""fp8 KV storage as vLLM, SGLang and TensorRT-LLM keep it: one byte per value and one scale per tensor.

``fp8_e4m3`` / ``fp8_e5m2``: the stored byte is ``fp8(x / scale)``, saturated to the format's largest finite
value (CUDA's ``__NV_SATFINITE`` conversion the engines use), rounded to nearest even (torch's float8 casts
give that rounding exactly); read back as ``fp8 * scale``. The scale:
- static (``fp8_e4m3``, ``fp8_e5m2``): 1.0, vLLM's ``k_scale``/``v_scale`` when the checkpoint carries none
  (its ``--kv-cache-dtype fp8`` on a model without scales), so nothing is stored for it;
- prefill (``fp8_e4m3-prefill``, ``fp8_e5m2-prefill``): one fp32 scale per layer and role, ``amax / max
  finite`` of the first rows the layer quantizes (its prefill), like a checkpoint's calibrated scale; later
  rows beyond it saturate. Its 4 bytes are per-layer state and counted as such.
"""

from __future__ import annotations

import torch

from .base import Codec, Encoded, compute_dtype

__all__ = ["FP8_FORMATS", "Fp8Codec"]

FP8_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
SCALES = ("static", "prefill")


class Fp8Codec(Codec):
    """Field ``q``: uint8 ``[B, H, T, D]`` (the fp8 bits). State ``scale`` (fp32 scalar) for the prefill scale."""

    tokens_per_unit = 1

    def __init__(self, fmt: str = "e4m3", scale: str = "static") -> None:
        if fmt not in FP8_FORMATS:
            raise ValueError(f"unknown fp8 format {fmt!r}: valid formats are {', '.join(FP8_FORMATS)}")
        if scale not in SCALES:
            raise ValueError(f"unknown fp8 scale {scale!r}: valid scales are {', '.join(SCALES)}")
        self.fmt, self.scale = fmt, scale
        self.dtype = FP8_FORMATS[fmt]
        self.max = float(torch.finfo(self.dtype).max)
        self.spec = f"fp8_{fmt}" + ("-prefill" if scale == "prefill" else "")

    def calibrate(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.scale == "static":
            return {}
        amax = x.detach().abs().amax().to(torch.float32)
        scale = torch.where(amax > 0, amax / self.max, torch.ones_like(amax))
        return {"scale": scale.reshape(())}

    def _scale(self, state: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor | None:
        s = state.get("scale") if state else None
        return None if s is None else s.to(x.device)

    def encode(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> Encoded:
        self.check_input(x)
        xf = x.to(compute_dtype(x.dtype))
        s = self._scale(state, xf)
        if s is not None:
            xf = xf / s.to(xf.dtype)
        q = xf.clamp(-self.max, self.max).to(self.dtype)
        return {"q": q.view(torch.uint8)}

    def decode(self, enc: Encoded, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        cd = compute_dtype(dtype)
        x = enc["q"].view(self.dtype).to(torch.float32).to(cd)
        s = self._scale(state, x)
        if s is not None:
            x = x * s.to(cd)
        return x.to(dtype)

    def unit_bytes(self, head_dim: int) -> int:
        return head_dim

    def __repr__(self) -> str:
        return f"Fp8Codec({self.spec!r})"
