"""The ``fused`` cache mode's attention: read the packed store directly, never a dense K/V copy.

``install_fused_attention(model)`` registers an attention implementation with transformers
(``AttentionInterface`` + a mask builder) and switches the model to it, so plain ``model.generate()`` and a
manual decode loop both use it. The implementation the model had before (eager, sdpa, ...) is remembered for
its config (``support.remember_previous``, beside the config, not in it): calls that carry plain tensors (a
``DynamicCache`` baseline, no cache, a bypassed sliding-window layer) go to that implementation unchanged (for eager, the model's own ``eager_attention_forward``, which
knows the family's soft-capping or sinks), and the mask builder is that implementation's, so the baseline's
numbers do not change when fused is installed. Calls that carry a ``FusedKV`` handle are computed from the
store by ``fused_attention``, with the call's soft-cap (Gemma-2) and sink logits (gpt-oss).

Models that cannot run fused are refused before generation (``FusedUnsupportedError``: model class, reason,
the modes that work): ``support.check_fused_support``.

Which implementation ran is counted per call (``TQLayer.fused_impl``): ``native-cpu`` (the C++ kernel,
through ``native_glue``), ``triton`` (GPU kernels in ``tqbench.kernels``, through ``triton_glue``, imported
lazily, only when a call could use it) or ``torch-reference`` (``torch_ref``) with the reason (``choose.choose_impl``). A prefill with no history
attends exactly over the new rows through the model's previous implementation.
"""

from __future__ import annotations

import sys

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

from tqbench.engine.cache.fused.batch_kv import FusedBatch
from tqbench.engine.cache.fused.choose import NATIVE, REFERENCE, TRITON, choose_impl
from tqbench.engine.cache.fused.groups import (
    group_label,
    group_labels,
    group_views,
    is_per_head,
    put_heads,
    query_index,
    take_heads,
)
from tqbench.engine.cache.fused.masks import ragged_mask
from tqbench.engine.cache.fused.support import (
    FusedUnsupportedError,
    check_fused_support,
    forget_previous,
    previous_implementation,
    recorded_previous,
    remember_previous,
)
from tqbench.engine.cache.fused.torch_ref import reference_fused_attention
from tqbench.engine.cache.handles import ATTN_NAME, DenseKV, EvictKV, FusedKV, PrecisionKV
from tqbench.engine.cache.precision import precision_mask

_registered = False

__all__ = ["ATTN_NAME", "FusedUnsupportedError", "fused_attention", "fused_attention_forward",
           "install_fused_attention"]


def install_fused_attention(model) -> None:
    """Switch ``model`` to the fused attention, remembering its previous implementation; refuse (before any
    generation) a model that cannot run fused."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTN_NAME, fused_attention_forward)
        AttentionMaskInterface.register(ATTN_NAME, fused_mask)
        _registered = True
    current = getattr(model.config, "_attn_implementation", None)
    if current == ATTN_NAME:
        return
    check_fused_support(model, current)
    configs = model_configs(model)
    for cfg in configs:
        remember_previous(cfg, getattr(cfg, "_attn_implementation", None) or current)
    model.set_attn_implementation(ATTN_NAME)
    if getattr(model.config, "_attn_implementation", None) != ATTN_NAME:  # transformers declined the switch
        for cfg in configs:
            forget_previous(cfg)
        raise FusedUnsupportedError(
            type(model).__name__, "transformers did not switch its attention implementation "
            f"(it stayed {model.config._attn_implementation!r})",
        )


def model_configs(model) -> list:
    """The model's config and every sub-config (multimodal models nest the decoder's)."""
    out, todo = [], [model.config]
    while todo:
        cfg = todo.pop()
        if any(cfg is c for c in out):
            continue
        out.append(cfg)
        todo += [getattr(cfg, k) for k in getattr(cfg, "sub_configs", {}) if getattr(cfg, k, None) is not None]
    return out


def fused_mask(*args, config=None, **kwargs):
    """The mask builder of the implementation the model had before (eager: additive float masks; sdpa and
    the rest: boolean masks). The fused path reads either kind."""
    prev = recorded_previous(config)
    builder = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(prev, sdpa_mask) if prev else sdpa_mask
    return builder(*args, config=config, **kwargs)


def _previous_forward(module):
    """The attention function the module's model used before fused was installed."""
    prev = previous_implementation(getattr(module, "config", None))
    if prev == "eager":
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is None:
            raise RuntimeError(f"{type(module).__name__}: its module has no eager_attention_forward to route "
                               "plain tensors to")
        return fn
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[prev]


def _scaling(query, args, kwargs) -> float:
    scaling = kwargs.get("scaling", args[1] if len(args) > 1 else None)
    return query.shape[-1] ** -0.5 if scaling is None else scaling


def fused_attention_forward(module, query, key, value, attention_mask, *args, **kwargs):
    if isinstance(key, FusedBatch):
        points = [kv.evict_point for kv in key.members]
        for kv in key.members:
            kv.evict_point = None
        out = fused_batch_attention(module, query, key, attention_mask, *args, **kwargs)
        for b, (kv, point) in enumerate(zip(key.members, points)):
            if point is not None:
                kv.layer.after_attention(query[b : b + 1], _scaling(query, args, kwargs), point)
        return out
    if isinstance(key, EvictKV):  # a layer that evicts tokens: the model's own attention, then the queries
        check_unpadded(attention_mask, key.evict_point)
        mask = fit_causal_mask(attention_mask, query.shape[2], key.keys.shape[2])
        if key.lengths is not None:  # heads=ada: each KV head's padding masked
            mask = ragged_mask(mask, key.lengths, query, key.keys.shape[2],
                               previous_implementation(getattr(module, "config", None)) == "eager")
        out = _previous_forward(module)(module, query, key.keys, key.values, mask, *args, **kwargs)
        if key.evict_point is not None:
            key.layer.after_attention(query, _scaling(query, args, kwargs), key.evict_point)
        return out
    if isinstance(key, FusedKV) and key.evict_point is not None:
        point, key.evict_point = key.evict_point, None
        check_unpadded(attention_mask, point)
        out = fused_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
        key.layer.after_attention(query, _scaling(query, args, kwargs), point)
        return out
    if isinstance(key, PrecisionKV):  # a verification call in compressed/simulate mode: the model's own attention
        mask = precision_mask(attention_mask, key.precision, key.total, query.shape[0], query.device)
        if previous_implementation(getattr(module, "config", None)) == "eager" and mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~mask, torch.finfo(query.dtype).min)
        return _previous_forward(module)(module, query, key.keys, key.values, mask, *args, **kwargs)
    if isinstance(key, DenseKV):  # a kernel-attended dense baseline (``cache.dense_kernel``)
        return dense_kernel_forward(module, query, key, attention_mask, *args, **kwargs)
    if not isinstance(key, FusedKV):  # plain tensors: exactly what the model did before fused was installed
        mask = fit_causal_mask(attention_mask, query.shape[2], key.shape[2])
        return _previous_forward(module)(module, query, key, value, mask, *args, **kwargs)
    ragged = key.ragged is not None and any(kv.k_parts for kv in key.ragged)  # heads=ada with rows held
    if (not ragged and not key.k_parts and not key.v_parts and key.precision is None
            and key.tier is None):  # no history: exact attention
        return _previous_forward(module)(module, query, key.new_k, key.new_v, attention_mask, *args, **kwargs)
    scaling = kwargs.get("scaling", args[1] if len(args) > 1 else None)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    key.layer.fused_calls += 1
    total = key.tier_rows + key.k_store_tokens + key.new_k.shape[2]  # (the mask's columns: [tier | held | new])
    mask = window_mask(attention_mask, total)
    if key.precision is not None:  # a verification call: the column sets after the call's rows
        mask = precision_mask(mask, key.precision, total, query.shape[0], query.device)
    if ragged:
        from tqbench.engine.cache.fused.ragged_heads import ragged_fused_attention

        out = ragged_fused_attention(query, key, mask, scaling, softcap=softcap, sinks=sinks, one=_fused_one,
                                     count=_count)
    else:
        out = fused_attention(query, key, mask, scaling, softcap=softcap, sinks=sinks)
    return out.transpose(1, 2).contiguous(), None


def dense_kernel_forward(module, query, key: DenseKV, attention_mask, *args, **kwargs):
    """A kernel-attended dense baseline's call: a prefill with no history runs the model's own attention on the
    upcast rows (exactly the upcast baseline's); every other call is one native kernel call over the 16-bit rows as
    stored, counted on the layer (``native_calls``)."""
    if key.keys.shape[2] == query.shape[2]:
        dt = query.dtype
        return _previous_forward(module)(module, query, key.keys.to(dt), key.values.to(dt), attention_mask, *args,
                                         **kwargs)
    from tqbench.engine.cache.fused.native_glue import native_dense_attention

    out = native_dense_attention(query, key.keys, key.values, attention_mask, _scaling(query, args, kwargs),
                                 softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux", kwargs.get("sinks")))
    key.layer.native_calls += 1
    return out.transpose(1, 2).contiguous(), None


def fit_causal_mask(attention_mask, q: int, n: int):
    """``attention_mask`` for a layer holding ``n`` rows. transformers builds one mask per layer type from the first
    such layer's cache, so with per-layer keeps (``keep@L=f``) a call over several tokens after an eviction (the
    query-agnostic protocol's question) hands every layer the first one's width. A mask that is the plain causal
    tail (the call's ``q`` queries are the last ``q`` rows, nothing else hidden) is rebuilt at ``n`` columns; any
    other mask of the wrong width (padding) is refused with the reason."""
    if attention_mask is None or attention_mask.shape[-1] == n:
        return attention_mask
    m, dev = attention_mask.shape[-1], attention_mask.device

    def causal(width: int) -> torch.Tensor:
        return torch.arange(width, device=dev)[None, :] <= torch.arange(width - q, width, device=dev)[:, None]

    is_bool = attention_mask.dtype == torch.bool
    allowed = attention_mask if is_bool else attention_mask > torch.finfo(attention_mask.dtype).min / 2
    if attention_mask.shape[-2] != q or not bool((allowed == causal(m)).all()):
        raise ValueError(f"an attention mask of {m} columns (with padding) reached a layer holding {n} rows: layers "
                         "that keep different fractions (keep@L=f) need unpadded calls; run each sequence alone")
    fit = causal(n).expand(*attention_mask.shape[:-1], n)
    if is_bool:
        return fit
    return torch.zeros(fit.shape, dtype=attention_mask.dtype, device=dev).masked_fill(
        ~fit, torch.finfo(attention_mask.dtype).min)


def check_unpadded(attention_mask, point: bool) -> None:
    """Token eviction keeps each KV head's own rows at their positions; a left-padded batch's mask hides
    padding by position, and the padding would count in every sequence's budget: refused, with the reason."""
    if not point or attention_mask is None:
        return
    last = attention_mask[..., -1, :]
    hidden = ~last if last.dtype == torch.bool else last < 0
    if bool(hidden.any()):
        from tqbench.engine.cache.evict.compact import EvictionError

        raise EvictionError("token eviction (keep) cannot run on a left-padded batch: padding would count in "
                            "each sequence's budget and the mask hides it by position; run each sequence in "
                            "its own call (tqbench's batched serving prefills each request alone)")


def fused_batch_attention(module, query, batch: FusedBatch, attention_mask, *args, **kwargs):
    """A batched decode step: sequence b's query rows attend over its own store (``FusedBatch``), with row b
    of the call's mask (its history is right-aligned in the mask, so the mask's last columns are its rows).

    On the native kernel: ONE ragged kernel call for every sequence (``native_fused_attention_ragged``: each
    its own packed store, length and mask; no codes padded, no dense history). Elsewhere (Triton, the torch
    reference, a sequence with no stored rows yet, or a call the kernel refuses) each sequence runs its own
    fused call inside this one forward call, counted as the solo path counts it. Per-head layers are in the same
    one call (each sequence's groups of heads are sides of its store)."""
    members = batch.members
    impl, _ = choose_impl(query)
    if impl == NATIVE and all(kv.k_parts or kv.v_parts for kv in members):
        scaling = kwargs.get("scaling", args[1] if len(args) > 1 else None)
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        masks = None
        if attention_mask is not None:
            masks = [window_mask(attention_mask[b : b + 1], kv.tier_rows + kv.k_store_tokens + kv.new_k.shape[2])
                     for b, kv in enumerate(members)]
        out = _ragged(query, members, masks, scaling, kwargs.get("softcap"), kwargs.get("s_aux", kwargs.get("sinks")))
        if not isinstance(out, str):
            for kv in members:
                kv.layer.fused_calls += 1
            return out.transpose(1, 2).contiguous(), None
    outs = []
    for b, kv in enumerate(members):
        mask = None if attention_mask is None else attention_mask[b : b + 1]
        out, _ = fused_attention_forward(module, query[b : b + 1], kv, kv, mask, *args, **kwargs)
        outs.append(out)
    return torch.cat(outs, dim=0), None


def _count(layer, label: str, group: str | None) -> None:
    layer.fused_impl[label] = layer.fused_impl.get(label, 0) + 1
    if group is not None:
        _count_group(layer, group, label)


def _count_group(layer, group: str, label: str) -> None:
    """A per-head layer: which implementation ran for each group of heads."""
    ran = layer.fused_groups.setdefault(group, {})
    ran[label] = ran.get(label, 0) + 1


def _count_native(kv) -> None:
    """One native kernel call for this layer (a per-head layer: every group of heads ran in it)."""
    _count(kv.layer, NATIVE, None)
    if is_per_head(kv):
        for group in group_labels(kv):
            _count_group(kv.layer, group, NATIVE)


def _ragged(query, members, masks, scaling, softcap, sinks):
    """The native kernel's ragged call over every sequence of a batch (per-head layers too: each sequence's
    groups of heads are sides of its store), or ``str`` (why not: the caller runs each sequence's own fused call)."""
    from tqbench.engine.cache.fused.native_glue import native_fused_attention_ragged

    out = native_fused_attention_ragged(query, members, masks, scaling, softcap=softcap, sinks=sinks,
                                        sparse_v=members[0].layer.policy.sparsev)
    if not isinstance(out, str):
        for kv in members:
            _count_native(kv)
    return out


def window_mask(attention_mask, total: int) -> torch.Tensor | None:
    """The call's mask over all ``total`` rows the fused call reads. A window-bounded store can hold a few
    rows older than the window transformers' mask covers (whole codec units are evicted): those rows are
    out of every query's window, so they are masked here."""
    if attention_mask is None or attention_mask.shape[-1] >= total:
        return attention_mask
    extra = total - attention_mask.shape[-1]
    shape = (*attention_mask.shape[:-1], extra)
    if attention_mask.dtype == torch.bool:
        pad = torch.zeros(shape, dtype=torch.bool, device=attention_mask.device)
    else:
        pad = torch.full(shape, torch.finfo(attention_mask.dtype).min, dtype=attention_mask.dtype,
                         device=attention_mask.device)
    return torch.cat([pad, attention_mask], dim=-1)


def fused_attention(query: torch.Tensor, kv: FusedKV, attention_mask, scaling: float, *,
                    softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``query`` [B, Hq, L, D] over the stored rows plus this call's new rows; ``softcap``:
    scores -> tanh(s / cap) * cap before masking; ``sinks`` [Hq]: one extra logit per query head in the
    softmax denominator (it takes no value).

    Counts which implementation ran (``TQLayer.fused_impl``); a call the native kernel cannot take (a codec
    without a native form, an additive bias) runs on the torch reference and is counted as a fallback. A
    per-head layer is one native call (every group of heads a side of its store); where that cannot run (Triton,
    the torch reference, a group without a native form: said in the report) it runs group by group
    (``groups.py``); each group is counted (``TQLayer.fused_groups``)."""
    if not is_per_head(kv):
        return _fused_one(query, kv, attention_mask, scaling, softcap, sinks, None)
    impl, why = choose_impl(query)
    if impl == NATIVE:
        from tqbench.engine.cache.fused.native_glue import native_fused_attention

        out = native_fused_attention(query, kv, attention_mask, scaling, softcap=softcap, sinks=sinks,
                                     sparse_v=kv.layer.policy.sparsev)
        if not isinstance(out, str):
            _count_native(kv)
            return out
        why = f"the native kernel: {out}"
        if kv.tier is None:
            kv.layer.note_fallback(f"native: {out}: the layer's groups of heads ran one call each")
    if kv.tier is not None:
        from tqbench.engine.cache.evict.compact import EvictionError

        raise EvictionError(
            f"demote={kv.layer.plan.demote} on a layer with per-head codecs runs only in the native CPU kernel "
            f"(one call over every group and the demote tier); here: {why}: use cache mode "
            "compressed, or one codec for the layer's heads")
    n_rep = query.shape[1] // kv.new_k.shape[1]
    out = None
    for kv_g in group_views(kv):
        qi = query_index(kv_g.k_store.heads, n_rep, query.device)
        o = _fused_one(take_heads(query, qi), kv_g, attention_mask, scaling, softcap,
                       None if sinks is None else take_heads(sinks, qi, 0), group_label(kv_g))
        if out is None:
            out = o.new_empty(query.shape[0], query.shape[1], *o.shape[2:])
        put_heads(out, qi, o)
    return out


def _fused_one(query, kv, attention_mask, scaling, softcap, sinks, group: str | None) -> torch.Tensor:
    """One fused call over one store (a whole layer, or one group of heads of a per-head layer)."""
    impl, why = choose_impl(query)
    layer = kv.layer
    if impl == NATIVE:
        from tqbench.engine.cache.fused.native_glue import native_fused_attention

        out = native_fused_attention(query, kv, attention_mask, scaling, softcap=softcap, sinks=sinks,
                                     sparse_v=layer.policy.sparsev)
        if not isinstance(out, str):
            _count(layer, NATIVE, group)
            return out
        layer.note_fallback(f"native: {out} (torch reference)" + (f" [{group}]" if group else ""))
        impl, why = REFERENCE, f"native kernel: {out}"
    if impl == TRITON and (softcap is not None or sinks is not None):  # (the triton kernels have neither)
        impl, why = REFERENCE, "soft-capping or sink logits (the triton kernels have neither)"
    if impl == TRITON and kv.tier is not None:  # (the triton kernels read one store)
        impl, why = REFERENCE, "the demote tier (the triton kernels read one store; the native CPU kernel reads both)"
    label = TRITON if impl == TRITON else f"{REFERENCE} ({why})"
    _count(layer, label, group)
    if impl == TRITON:
        from tqbench.engine.cache.fused.triton_glue import triton_fused_attention

        return triton_fused_attention(query, kv, attention_mask, scaling)
    return reference_fused_attention(query, kv, attention_mask, scaling, softcap=softcap, sinks=sinks)
