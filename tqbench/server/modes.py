"""Which cache mode ``tqbench serve`` runs by default, and which fused implementation runs (for ``/health``).

The rule is ``tqbench.constants.fastest_quality_mode`` (one definition, shared with the workbench): where it
names ``fused`` and the fused kernel for the device runs (the native C++ kernel on CPU, Triton on CUDA), the
server serves fused, which batches (``engine.batch``); elsewhere ``compressed`` (serving never defaults to
``simulate``, which keeps more than fp16 resident), and the reason is printed at start-up and in ``/health``.
"""

from __future__ import annotations

from tqbench.constants import fastest_quality_mode


def fused_implementation(engine) -> tuple[str, str]:
    """(implementation a fused attention call on this engine's device and dtype runs, why)."""
    import torch

    from tqbench.engine.cache.fused.choose import choose_impl

    loaded = getattr(engine, "loaded", None)
    device = getattr(loaded, "device", "cpu")
    dtype = getattr(getattr(engine, "model", None), "dtype", torch.float32)
    return choose_impl(torch.empty(0, device=device, dtype=dtype))


def auto_mode(engine) -> tuple[str, str]:
    """(cache mode, why) for ``--cache-mode auto``."""
    from tqbench.engine.cache.fused.choose import REFERENCE

    loaded = getattr(engine, "loaded", None)
    device_type = str(getattr(loaded, "device", "cpu")).split(":")[0]
    if fastest_quality_mode(device_type) != "fused":
        return "compressed", (f"auto: no fused kernel is measured on {device_type} "
                              "(tqbench.constants.FASTEST_QUALITY_MODE); compressed keeps one layer decoded per step")
    try:
        impl, why = fused_implementation(engine)
    except RuntimeError as exc:
        return "compressed", f"auto: the fused kernel cannot run ({exc})"
    if impl == REFERENCE:
        return "compressed", f"auto: the fused kernel does not run here ({why}), and its torch reference is slow"
    return "fused", f"auto: the {impl} kernel runs ({why}); fused reads the packed codes and batches"
