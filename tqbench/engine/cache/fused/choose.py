"""Which implementation a ``fused`` attention call runs: Triton (GPU), the native CPU kernel, or the torch reference.

Triton and the native kernel are loaded lazily, only when a call could use them; ``TQBENCH_FUSED_IMPL`` forces
one side (``auto``, ``torch``, ``native``, ``triton``).
"""

from __future__ import annotations

import os

import torch

from tqbench.constants import FUSED_NATIVE, FUSED_TRITON

IMPL_ENV = "TQBENCH_FUSED_IMPL"  # "auto" (default), "torch", "native" or "triton" (forces the kernels, e.g. interpreter)
IMPLS = ("auto", "torch", "native", "triton")
NATIVE = FUSED_NATIVE
TRITON = FUSED_TRITON
REFERENCE = "torch-reference"


def wanted_impl() -> str:
    want = os.environ.get(IMPL_ENV, "auto").strip().lower() or "auto"
    if want not in IMPLS:
        raise ValueError(f"{IMPL_ENV}={want!r} is invalid: use {', '.join(IMPLS)}")
    return want


def choose_impl(query: torch.Tensor) -> tuple[str, str]:
    """``(impl, why)``: ``triton`` on a CUDA device with triton, ``native-cpu`` on a CPU where the C++ kernel
    builds, else the torch reference (``why`` says which and why)."""
    want = wanted_impl()
    if want == "torch":
        return REFERENCE, f"{IMPL_ENV}=torch"
    if query.device.type == "cpu" and want in ("auto", "native"):
        from tqbench.kernels.cpu import native_status

        ok, why = native_status()
        if ok:
            return NATIVE, why
        if want == "native":
            raise RuntimeError(f"{IMPL_ENV}=native but {why}")
        return REFERENCE, why
    if want == "native":
        raise RuntimeError(f"{IMPL_ENV}=native but the native kernel runs on CPU tensors ({query.device.type})")
    if query.dtype == torch.float64:
        return REFERENCE, "float64 activations (the triton kernels compute in fp32)"
    if want == "auto" and query.device.type != "cuda":
        return REFERENCE, f"{query.device.type} device (the triton kernels need a GPU)"
    from tqbench.kernels import triton_status

    ok, why = triton_status()
    if not ok:
        if want == "triton":
            raise RuntimeError(f"{IMPL_ENV}=triton but {why}")
        return REFERENCE, why
    return TRITON, f"{IMPL_ENV}=triton" if want == "triton" else "cuda device"
