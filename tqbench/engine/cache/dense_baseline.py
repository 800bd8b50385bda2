"""The dense baselines every speed ratio is measured against: a transformers ``DynamicCache`` whose K/V rows are
held in the model's dtype (``dense``: float32 for a CPU model) or in 16 bits (``dense-fp16``, ``dense-bf16``).

A 16-bit baseline stores each K/V row rounded to its width (half the bytes of float32 rows) and hands attention
the rows upcast to the model's compute dtype: the model computes as it does with any cache (its own attention
function on float32 rows), only the storage is 16-bit, as in llama.cpp's f16 cache or vLLM's fp16/bf16 cache on a
float32 model. The upcast is part of every step's cost (it is what reading a 16-bit cache costs a float32 model),
so on a CPU this baseline is not faster than ``dense``; it is the baseline with the bytes the engines' 16-bit caches
hold. Sliding-window layers keep their window exactly as ``DynamicCache`` does.

``dense-fp16-kernel`` / ``dense-bf16-kernel`` (``dense_kernel.py``) store the same rows and attend over them as
stored, in the native CPU kernel, as engines read their 16-bit caches: the fair baseline for speed on a CPU.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from tqbench.constants import DENSE_BASELINES, KERNEL_BASELINES, dense_baseline_kv
from tqbench.engine.cache.rows16 import Rows16, swap_layers

__all__ = ["DENSE_BASELINES", "Dense16Cache", "baseline_kv_dtype", "bytes_policy", "check_dense_baseline",
           "dense_cache", "is_dense_baseline"]


def _dtype(name: str | None) -> torch.dtype | None:
    """The dtype baseline ``name`` (None: ``dense``) stores rows in; None for the model's own."""
    dtype = DENSE_BASELINES[check_dense_baseline(name or "dense")]
    return None if dtype is None else getattr(torch, dtype)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def is_dense_baseline(name: object) -> bool:
    return isinstance(name, str) and name in DENSE_BASELINES


def check_dense_baseline(name: str) -> str:
    dense_baseline_kv(name, "")  # refuses an unknown name
    return name


def baseline_kv_dtype(name: str | None, model_dtype: torch.dtype) -> str:
    """The dtype the baseline's K/V rows are stored in, as a name (``float16``); None means ``dense``."""
    return dense_baseline_kv(name or "dense", _name(model_dtype))


class Dense16Layer(Rows16, DynamicLayer):
    def __init__(self, kv_dtype: torch.dtype, **kwargs) -> None:
        super().__init__(**kwargs)
        self.kv_dtype = kv_dtype


class Dense16SlidingLayer(Rows16, DynamicSlidingWindowLayer):
    def __init__(self, kv_dtype: torch.dtype, sliding_window: int, **kwargs) -> None:
        super().__init__(sliding_window=sliding_window, **kwargs)
        self.kv_dtype = kv_dtype


class Dense16Cache(DynamicCache):
    """A ``DynamicCache`` (same layer types and windows, from ``config``) that stores K/V rows in ``kv_dtype``."""

    def __init__(self, config, kv_dtype: torch.dtype) -> None:
        super().__init__(config=config)
        self.kv_dtype = kv_dtype
        swap_layers(self, kv_dtype, Dense16Layer, Dense16SlidingLayer, f"a {kv_dtype} dense baseline")


def bytes_policy(name: str | None, model_dtype: torch.dtype) -> str:
    """The dense policy that counts the same bytes as baseline ``name`` (``fp16`` for ``dense-fp16``; ``k=fp32,
    v=fp32`` for ``dense`` on a float32 model): what a savings figure against the baseline is computed with."""
    width = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}[baseline_kv_dtype(name, model_dtype)]
    return "fp16" if width == "fp16" else f"k={width},v={width}"


def dense_cache(config, name: str | None = None, device: torch.device | str | None = None) -> DynamicCache:
    """The dense baseline ``name`` (``DENSE_BASELINES``; None: ``dense``) for a model with ``config`` on ``device``
    (a kernel-attended one, ``KERNEL_BASELINES``, is refused where the native CPU kernel cannot run, saying why; its
    attention needs tqbench's attention function installed: ``Engine.make_cache`` does it)."""
    dtype = _dtype(name)
    if name in KERNEL_BASELINES:
        from tqbench.engine.cache.dense_kernel import DenseKernelCache, check_kernel_baseline

        check_kernel_baseline(name, device)
        return DenseKernelCache(config, dtype)
    return DynamicCache(config=config) if dtype is None else Dense16Cache(config, dtype)
