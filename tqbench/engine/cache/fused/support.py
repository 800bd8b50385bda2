"""Which models can run the ``fused`` cache mode, and the error for those that cannot.

The fused mode swaps the model's attention function through transformers' ``AttentionInterface``, so a
model must (1) route its attention through that interface (Falcon before transformers 5.25 calls SDPA directly)
and take its positions from rotary keys, not an ALiBi bias carried in the mask (ALiBi Falcon), (2) have
had an implementation whose masks are tensors (eager, sdpa; flex attention's block masks and flash
attention's varlen metadata are not), (3) be a plain attention decoder (no state-space / linear-attention
layers, whose state the compressed cache does not hold) and (4) hand the cache the K/V rows attention reads
(multi-head latent attention caches a latent and expands it afterwards: compressed modes only). ``check_fused_support`` refuses the others before
any generation, naming the model class, the reason and the modes that work.
"""

from __future__ import annotations

import weakref

from tqbench.engine.cache.geometry import is_mla, unsupported_attention

#: config id -> (weak reference to the config, the attention implementation it had before fused was
#: installed); kept beside the config, not on it, so ``config.to_dict()`` / ``save_pretrained`` stay clean
_PREVIOUS: dict[int, tuple[weakref.ref, str]] = {}
#: previous implementations whose masks the fused path can read, and that plain tensors are routed back to
ROUTABLE = ("eager", "sdpa")
#: the cache modes that do not replace the model's attention function
NON_FUSED_MODES = ("compressed", "simulate", "dense-shadow")


class FusedUnsupportedError(ValueError):
    """The fused cache mode cannot run on this model (raised before any generation)."""

    def __init__(self, model_class: str, reason: str, modes: tuple[str, ...] = NON_FUSED_MODES) -> None:
        self.model_class = model_class
        self.reason = reason
        self.modes = modes
        works = (f"use cache mode {' / '.join(modes)}, which keep the model's own attention"
                 if modes else "no compressed cache mode works on it; the fp16 DynamicCache baseline does")
        super().__init__(f"{model_class} cannot run the fused cache mode: {reason}; {works}")


def remember_previous(config, implementation: str) -> None:
    key = id(config)
    _PREVIOUS[key] = (weakref.ref(config, lambda _ref: _PREVIOUS.pop(key, None)), implementation)


class EvictionUnsupportedError(FusedUnsupportedError):
    """A policy that evicts tokens cannot run on this model in any mode: eviction ranks rows by the queries that
    tqbench's attention function records, and the model cannot take that function (same reasons as fused)."""

    def __init__(self, refused: FusedUnsupportedError) -> None:
        ValueError.__init__(self, f"{refused.model_class} cannot evict tokens (keep=) in any cache mode: eviction "
                            "ranks rows by the queries tqbench's attention function records, and "
                            f"{refused.reason}; run this model with a policy that keeps every token (no keep=)")
        self.model_class, self.reason, self.modes = refused.model_class, refused.reason, ()


def forget_previous(config) -> None:
    _PREVIOUS.pop(id(config), None)


def recorded_previous(config) -> str | None:
    """The implementation ``config`` had before fused was installed, or None when none was recorded."""
    entry = _PREVIOUS.get(id(config)) if config is not None else None
    return entry[1] if entry is not None and entry[0]() is config else None


def previous_implementation(config) -> str:
    """The implementation plain tensors go to (``sdpa`` when nothing was recorded)."""
    return recorded_previous(config) or "sdpa"


def check_fused_support(model, current: str | None) -> None:
    """Raise ``FusedUnsupportedError`` when ``model`` (now on attention ``current``) cannot run fused."""
    name = type(model).__name__
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        raise FusedUnsupportedError(
            name, "its attention does not go through transformers' AttentionInterface (it calls its kernels "
            "directly), so the fused attention cannot be installed",
        )
    if getattr(model.config, "alibi", False):
        raise FusedUnsupportedError(
            name, "its ALiBi position bias reaches attention inside the attention mask, which the fused attention "
            "does not read (it builds its own causal masks)",
        )
    if current not in ROUTABLE:
        raise FusedUnsupportedError(
            name, f"it was loaded with attn_implementation={current!r}, whose masks the fused attention cannot "
            f"read; load it with one of {', '.join(ROUTABLE)}",
        )
    why = unsupported_attention(model.config)
    if why:
        raise FusedUnsupportedError(name, why, modes=())
    if is_mla(model.config):
        raise FusedUnsupportedError(
            name, "it caches its multi-head latent attention latent and expands K and V from it after the cache, "
            "so attention never sees the store (the fused attention reads K/V rows from it)",
        )
