"""Grouped-query attention without copying K/V per query head, for the chunk forwards (``chunk.ChunkRunner``).

transformers' SDPA path repeats every K/V head to its query heads (``repeat_kv``: a copy of the whole history per
layer) unless it may pass ``enable_gqa=True``, which on CPU it does only without a mask; a chunk forward always has
one (1024 cached tokens + a causal chunk). ``grouped_sdpa(model, device)`` switches that one model, for the block
only, to ``grouped_sdpa_forward``: transformers' SDPA call with ``enable_gqa=True`` (PyTorch's CPU flash kernel
then reads each K/V head for its query group), registered as its own attention implementation (``GQA_NAME``, with
SDPA's masks). Nothing process-wide is set: the model's own configs are switched and restored (a model with the
fused attention installed keeps it; the implementation its plain tensors go to is switched instead), so another
model, thread or subprocess never sees it. Measured on the default model (4 x 32 chunk tokens over 1024 cached,
1 thread, CPU seconds): a 20-layer chunk forward 0.556 -> 0.351, the log-probabilities bit-identical
(``torch.equal``). Only applied on CPU (a CUDA SDPA with a mask and GQA falls back to the math kernel) and to
models on SDPA (eager models keep their own attention).
"""

from __future__ import annotations

import contextlib

import torch

GQA_NAME = "tqbench_sdpa_gqa"
_registered: list[bool] = []


def grouped_sdpa_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                         is_causal=None, **kwargs):
    """transformers' ``sdpa_attention_forward`` as it runs when it may use ``enable_gqa`` (no ``repeat_kv`` copy);
    calls it cannot take that way (no query groups, a position bias, soft-capping) go to it unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if groups <= 1 or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    q_length = query.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = q_length > 1 and attention_mask is None and is_causal
    if is_causal and key.shape[2] > q_length:  # (as transformers: the flash kernel needs q_length == kv_length)
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, is_causal=is_causal,
                                                           enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(GQA_NAME, grouped_sdpa_forward)
        AttentionMaskInterface.register(GQA_NAME, sdpa_mask)
        _registered.append(True)


@contextlib.contextmanager
def grouped_sdpa(model, device):
    """Within the block, ``model``'s SDPA attention reads K/V heads per query group (CPU only; restored after)."""
    from tqbench.engine.cache.fused.install import ATTN_NAME, model_configs
    from tqbench.engine.cache.fused.support import forget_previous, recorded_previous, remember_previous

    if getattr(device, "type", str(device)) != "cpu":
        yield
        return
    _register()
    switched: list[tuple] = []  # (config, "impl" | "previous", what it was)
    for cfg in model_configs(model):
        current = getattr(cfg, "_attn_implementation_internal", None)
        if current == "sdpa":
            switched.append((cfg, "impl", current))
            cfg._attn_implementation_internal = GQA_NAME
        elif current == ATTN_NAME and recorded_previous(cfg) in ("sdpa", None):
            switched.append((cfg, "previous", recorded_previous(cfg)))
            remember_previous(cfg, GQA_NAME)
    try:
        yield
    finally:
        for cfg, what, was in reversed(switched):
            if what == "impl":
                cfg._attn_implementation_internal = was
            elif was is None:
                forget_previous(cfg)
            else:
                remember_previous(cfg, was)
