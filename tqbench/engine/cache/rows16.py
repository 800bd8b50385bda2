"""``Rows16``: a transformers ``DynamicLayer`` mixin whose K/V rows are stored in 16 bits (the dense 16-bit
baselines: ``dense_baseline`` upcasts them for the model's attention, ``dense_kernel`` hands them as stored)."""

from __future__ import annotations

import torch

__all__ = ["Rows16", "swap_layers"]


class Rows16:
    """Mixin for a ``DynamicLayer`` (or its sliding-window subclass): rows stored in ``kv_dtype``, returned upcast
    to the dtype the model handed them in."""

    kv_dtype: torch.dtype
    compute_dtype: torch.dtype | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.compute_dtype = key_states.dtype
        super().lazy_initialization(key_states.to(self.kv_dtype), value_states.to(self.kv_dtype))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = super().update(key_states.to(self.kv_dtype), value_states.to(self.kv_dtype), *args, **kwargs)
        return keys.to(self.compute_dtype), values.to(self.compute_dtype)


def swap_layers(cache, kv_dtype: torch.dtype, full, sliding, what: str) -> None:
    """Replace each full-attention layer of ``cache`` (a fresh ``DynamicCache``) by ``full(kv_dtype)`` and each
    sliding-window one by ``sliding(kv_dtype, window)``; any other layer type is refused, naming ``what``."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            cache.layers[i] = full(kv_dtype)
        elif type(layer) is DynamicSlidingWindowLayer:
            cache.layers[i] = sliding(kv_dtype, layer.sliding_window)
        else:
            raise ValueError(f"{what} cannot hold a {type(layer).__name__} layer (only full and sliding-window "
                             "attention layers); use the dense baseline")
