"""Kernels for attention straight from the packed KV store, and their pure-torch references.

- ``packing.py``: the dense bit packing of codes (LSB-first stream) that the engine's codecs also use;
- ``reference.py``: the torch implementation (what runs on CPU, and what every kernel is tested against);
- ``packed_attention.py``: Triton decode attention over packed history (split-K partials), with its launcher;
- ``turbo_quantize.py``: Triton quantize + pack of new TurboQuant rows, with its launcher (the GPU append path:
  ``TurboCodec.encode`` calls it for fp32 rows on CUDA; on CPU the native kernel's ``turbo_encode`` does the same);
- ``cpu/``: the native C++ kernel (attention straight from the packed store, and the CPU quantize + pack).

Every launcher checks its inputs (shapes, dtypes, strides, lengths, devices) and names the wrong argument.
The engine builds on these (``tqbench/engine/cache/fused/``: ``torch_ref.py``, ``triton_glue.py``,
``native_glue.py``; ``tqbench/engine/codecs/turbo.py``); this package
never imports the engine (import-linter contract): it works on plain tensors and the packed layout of ``packing.py``.

Importing this package never imports triton: ``triton_status()`` says whether the kernels can run and why
not. Set ``TRITON_INTERPRET=1`` before the first kernel import to run them on CPU (tests only: ~2 ms per
program iteration).
"""

from __future__ import annotations

import importlib.util
import os

__all__ = ["needs_interpreter", "triton_status"]


def triton_status() -> tuple[bool, str]:
    """``(usable, why)`` for the Triton kernels on this machine (imports nothing heavy when not usable)."""
    try:
        found = importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a None entry in sys.modules (import blocked) raises ValueError
        found = False
    if not found:
        return False, "triton is not installed (pip install triton)"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True, "triton interpreter (TRITON_INTERPRET=1)"
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA device (set TRITON_INTERPRET=1 to run the kernels in the interpreter)"
    return True, "cuda device"


def needs_interpreter() -> bool:
    """True where no CUDA device is present: the Triton kernels can run here only under ``TRITON_INTERPRET=1``
    (which must be set before the first kernel import). Imports torch, never triton."""
    import torch

    return not torch.cuda.is_available()
