"""The kernel-attended 16-bit dense baselines (``dense-fp16-kernel``, ``dense-bf16-kernel``): K/V rows stored in 16
bits and attended where they lie, as an engine's f16 cache is (llama.cpp's CPU flash attention reads its f16 rows
in the kernel): one native kernel call per layer per step over a dense side whose row chunks are the stored 16-bit
rows (each row converted exactly to float32 in the kernel as it is read; scores and sums in the query's dtype).

Same rows as ``dense-fp16`` / ``dense-bf16`` (``dense_baseline.py``: there attention reads the rows upcast to the
model's dtype, a float32 copy of the history every step), so the two differ only in how attention reads them:
outputs agree to float32 rounding. Full-attention layers append into a buffer that grows in whole blocks of
``KV_BLOCK_ROWS`` rows (an engine's cache is allocated, not concatenated each step: no per-step copy of the
history; at most ``KV_BLOCK_ROWS - 1`` spare rows per layer); sliding-window layers keep their window exactly as
``DynamicSlidingWindowLayer`` does. A prefill with no history runs the model's own attention on the upcast rows
(exactly ``dense-fp16``'s); every call with history is a kernel call, counted per layer (``native_calls``).

The baseline needs the native CPU kernel and a CPU model: ``check_kernel_baseline`` refuses otherwise, saying why.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from tqbench.engine.cache.handles import DenseKV
from tqbench.engine.cache.rows16 import Rows16, swap_layers

__all__ = ["KV_BLOCK_ROWS", "DenseKernelCache", "check_kernel_baseline", "kernel_calls"]

KV_BLOCK_ROWS = 1024  # a full-attention layer's row buffer grows by whole blocks of this many rows


class _KernelRows(Rows16):
    """Rows stored in ``kv_dtype`` (``Rows16``), handed to attention as stored (``DenseKV``), never upcast."""

    native_calls: int = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self._store(key_states.to(self.kv_dtype), value_states.to(self.kv_dtype), *args, **kwargs)
        kv = DenseKV(keys, values, self)
        return kv, kv  # (the model unpacks a key and a value: both are the handle)

    def _store(self, k, v, *args, **kwargs):
        return super(Rows16, self).update(k, v, *args, **kwargs)


def _append(view: torch.Tensor, buf: torch.Tensor | None, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, buffer)``: ``view`` (the rows held, a prefix of ``buf`` when it came from it) + ``new`` written
    into ``buf``, which is reallocated (whole blocks of ``KV_BLOCK_ROWS`` rows) when it is full or ``view`` is not
    its prefix (the cache cropped, reordered or reset it)."""
    n = view.shape[2] if view.dim() == 4 else 0
    need = n + new.shape[2]
    reuse = buf is not None and buf.dtype == new.dtype and buf.shape[2] >= need \
        and (buf.shape[0], buf.shape[1], buf.shape[3]) == (new.shape[0], new.shape[1], new.shape[3]) \
        and (n == 0 or (view.data_ptr() == buf.data_ptr() and view.shape[:2] == buf.shape[:2]
                        and view.stride() == buf.stride()))
    if not reuse:
        cap = -(-need // KV_BLOCK_ROWS) * KV_BLOCK_ROWS
        grown = new.new_empty(new.shape[0], new.shape[1], cap, new.shape[3])
        if n:
            grown[:, :, :n] = view
        buf = grown
    buf[:, :, n:need] = new
    return buf[:, :, :need], buf


class DenseKernelLayer(_KernelRows, DynamicLayer):
    def __init__(self, kv_dtype: torch.dtype, **kwargs) -> None:
        super().__init__(**kwargs)
        self.kv_dtype = kv_dtype
        self._kbuf = self._vbuf = None

    def _store(self, k, v, *args, **kwargs):
        self.keys, self._kbuf = _append(self.keys, self._kbuf, k)
        self.values, self._vbuf = _append(self.values, self._vbuf, v)
        return self.keys, self.values

    def reset(self) -> None:
        self._kbuf = self._vbuf = None
        super().reset()


class DenseKernelSlidingLayer(_KernelRows, DynamicSlidingWindowLayer):
    def __init__(self, kv_dtype: torch.dtype, sliding_window: int, **kwargs) -> None:
        super().__init__(sliding_window=sliding_window, **kwargs)
        self.kv_dtype = kv_dtype


class DenseKernelCache(DynamicCache):
    """A ``DynamicCache`` (same layer types and windows, from ``config``) whose layers store K/V rows in
    ``kv_dtype`` and hand them, as stored, to the native kernel's attention."""

    def __init__(self, config, kv_dtype: torch.dtype) -> None:
        super().__init__(config=config)
        self.kv_dtype = kv_dtype
        swap_layers(self, kv_dtype, DenseKernelLayer, DenseKernelSlidingLayer,
                    f"a kernel-attended {kv_dtype} dense baseline")


def kernel_calls(cache) -> int | None:
    """Native kernel calls a kernel-attended baseline's layers ran (None: ``cache`` is not one)."""
    if not isinstance(cache, DenseKernelCache):
        return None
    return sum(la.native_calls for la in cache.layers)


def check_kernel_baseline(name: str, device: torch.device | str | None = None) -> None:
    """Refuse (``RuntimeError`` saying why) a kernel-attended baseline where the native CPU kernel cannot run."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type != "cpu":
        raise RuntimeError(f"the {name} baseline attends with tqbench's native CPU kernel, and this model is on "
                           f"{dev.type}: use dense-fp16 or dense-bf16 (attention on the upcast rows)")
    from tqbench.kernels.cpu import native_status

    ok, why = native_status()
    if not ok:
        raise RuntimeError(f"the {name} baseline needs tqbench's native CPU kernel, which cannot run here: {why}; "
                           "use dense-fp16 or dense-bf16 (attention on the upcast rows)")
