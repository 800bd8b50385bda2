"""Pick the torch device and dtype: ``auto`` or a name, with a clear error for an absent accelerator."""

from __future__ import annotations

import re

import torch

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float64": torch.float64, "fp64": torch.float64,
}  # fmt: skip


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps and mps.is_available())


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``auto`` picks cuda, then mps, then cpu. Asking for an absent accelerator is an error."""
    if isinstance(device, torch.device):
        device = str(device)
    name = (device or "auto").strip().lower()
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps") if _mps_available() else torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "mps":
        if not _mps_available():
            raise ValueError("Device 'mps' was requested but MPS is not available here; use 'cpu' or 'auto'.")
        return torch.device("mps")
    match = re.fullmatch(r"cuda(?::(\d+))?", name)
    if match:
        if not torch.cuda.is_available():
            raise ValueError(
                f"Device {name!r} was requested but CUDA is not available (torch {torch.__version__}); "
                "use 'cpu' or 'auto'."
            )
        index = int(match.group(1) or 0)
        if index >= torch.cuda.device_count():
            raise ValueError(f"Device {name!r}: only {torch.cuda.device_count()} CUDA device(s) present.")
        return torch.device("cuda", index) if match.group(1) else torch.device("cuda")
    raise ValueError(f"Unknown device {device!r}; choose one of: auto, cpu, cuda, cuda:N, mps.")


def resolve_dtype(dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu") -> torch.dtype:
    """``auto``: bf16 on cuda when supported (else fp16), fp16 on mps, fp32 on cpu."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"Unsupported dtype {dtype}; choose one of: auto, {', '.join(_DTYPES)}.")
        return dtype
    name = (dtype or "auto").strip().lower().removeprefix("torch.")
    if name == "auto":
        kind = torch.device(device).type
        if kind == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float16 if kind == "mps" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}; choose one of: auto, {', '.join(_DTYPES)}.")
    return _DTYPES[name]
