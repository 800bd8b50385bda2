"""The ``fused`` cache mode's attention: read the packed store directly, never a dense K/V copy.

``install_fused_attention(model)`` registers an attention implementation with transformers
(``AttentionInterface`` + the sdpa mask builder) and switches the model to it, so plain ``model.generate()``
and a manual decode loop both use it. Calls that carry plain tensors (a ``DynamicCache`` baseline, no
cache) go to transformers' own SDPA unchanged, so one model serves baseline and candidate runs alike.
Calls that carry a ``FusedKV`` handle are computed from the store by ``fused_attention``.

Which implementation ran is counted per call (``TQLayer.fused_impl``): ``triton`` (GPU kernels in
``tqbench.kernels``, through ``triton_glue``, imported lazily, only when a call could use it) or
``torch-reference`` (``torch_ref``) with the reason (``choose.choose_impl``). A prefill with no history
attends exactly over the new rows through SDPA.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from tqbench.engine.cache.fused.choose import NATIVE, REFERENCE, TRITON, choose_impl
from tqbench.engine.cache.fused.torch_ref import reference_fused_attention
from tqbench.engine.cache.tqcache import FusedKV

ATTN_NAME = "tqbench_fused"
_registered = False


def install_fused_attention(model) -> None:
    global _registered
    if not _registered:
        AttentionInterface.register(ATTN_NAME, fused_attention_forward)
        AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
        _registered = True
    if getattr(model.config, "_attn_implementation", None) != ATTN_NAME:
        model.set_attn_implementation(ATTN_NAME)


def fused_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                            is_causal=None, **kwargs):
    if not isinstance(key, FusedKV):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    if not key.k_parts and not key.v_parts:  # prefill with no history: exact attention on the new rows
        return sdpa_attention_forward(module, query, key.new_k, key.new_v, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    key.layer.fused_calls += 1
    out = fused_attention(query, key, attention_mask, scaling if scaling is not None else query.shape[-1] ** -0.5)
    return out.transpose(1, 2).contiguous(), None


def fused_attention(query: torch.Tensor, kv: FusedKV, attention_mask, scaling: float, *,
                    softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``query`` [B, Hq, L, D] over the stored rows plus this call's new rows.

    Counts which implementation ran (``TQLayer.fused_impl``); a call the native kernel cannot take (a codec
    without a native form, an additive bias) runs on the torch reference and is counted as a fallback."""
    impl, why = choose_impl(query)
    layer = kv.layer
    if impl == NATIVE:
        from tqbench.engine.cache.fused.native_glue import native_fused_attention

        out = native_fused_attention(query, kv, attention_mask, scaling, softcap=softcap, sinks=sinks,
                                     sparse_v=layer.policy.sparsev)
        if not isinstance(out, str):
            layer.fused_impl[NATIVE] = layer.fused_impl.get(NATIVE, 0) + 1
            return out
        layer.note_fallback(f"native: {out} (torch reference)")
        impl, why = REFERENCE, f"native kernel: {out}"
    label = TRITON if impl == TRITON else f"{REFERENCE} ({why})"
    layer.fused_impl[label] = layer.fused_impl.get(label, 0) + 1
    if impl == TRITON:
        from tqbench.engine.cache.fused.triton_glue import triton_fused_attention

        return triton_fused_attention(query, kv, attention_mask, scaling)
    return reference_fused_attention(query, kv, attention_mask, scaling)
