"""Which implementation a ``fused`` attention call runs: the Triton kernels or the torch reference.

Triton is imported lazily, only when a call could use it; ``TQBENCH_FUSED_IMPL`` forces one side.
"""

from __future__ import annotations

import os

import torch

IMPL_ENV = "TQBENCH_FUSED_IMPL"  # "auto" (default), "torch" or "triton" (forces the kernels, e.g. interpreter)


def choose_impl(query: torch.Tensor) -> tuple[str, str]:
    """``(impl, why)``: ``triton`` on a CUDA device with triton installed, else the torch reference."""
    want = os.environ.get(IMPL_ENV, "auto").strip().lower() or "auto"
    if want not in ("auto", "torch", "triton"):
        raise ValueError(f"{IMPL_ENV}={want!r} is invalid: use auto, torch or triton")
    if want == "torch":
        return "torch-reference", f"{IMPL_ENV}=torch"
    if query.dtype == torch.float64:
        return "torch-reference", "float64 activations (the kernels compute in fp32)"
    if want == "auto" and query.device.type != "cuda":
        return "torch-reference", f"{query.device.type} device (the triton kernels need a GPU)"
    from tqbench.kernels import triton_status

    ok, why = triton_status()
    if not ok:
        if want == "triton":
            raise RuntimeError(f"{IMPL_ENV}=triton but {why}")
        return "torch-reference", why
    return "triton", f"{IMPL_ENV}=triton" if want == "triton" else "cuda device"
