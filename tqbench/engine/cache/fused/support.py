"""Which models can run the ``fused`` cache mode, and the error for those that cannot.

The fused mode swaps the model's attention function through transformers' ``AttentionInterface``, so a
model must (1) route its attention through that interface (Falcon, for one, calls SDPA directly), (2) have
had an implementation whose masks are tensors (eager, sdpa; flex attention's block masks and flash
attention's varlen metadata are not) and (3) be a plain attention decoder (no state-space / linear-attention
layers, whose state the compressed cache does not hold). ``check_fused_support`` refuses the others before
any generation, naming the model class, the reason and the modes that work.
"""

from __future__ import annotations

from tqbench.engine.cache.geometry import unsupported_attention

#: config attribute holding the attention implementation a model had before fused was installed
PREVIOUS_ATTR = "_tqbench_previous_attn"
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
        works = (f"use --cache-mode {' / '.join(modes)}, which keep the model's own attention"
                 if modes else "no compressed cache mode works on it; the fp16 DynamicCache baseline does")
        super().__init__(f"{model_class} cannot run the fused cache mode: {reason}; {works}")


def previous_implementation(config) -> str:
    """The implementation plain tensors go to (``sdpa`` when nothing was recorded)."""
    return (getattr(config, PREVIOUS_ATTR, None) if config is not None else None) or "sdpa"


def check_fused_support(model, current: str | None) -> None:
    """Raise ``FusedUnsupportedError`` when ``model`` (now on attention ``current``) cannot run fused."""
    name = type(model).__name__
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        raise FusedUnsupportedError(
            name, "its attention does not go through transformers' AttentionInterface (it calls its kernels "
            "directly), so the fused attention cannot be installed",
        )
    if current not in ROUTABLE:
        raise FusedUnsupportedError(
            name, f"it was loaded with attn_implementation={current!r}, whose masks the fused attention cannot "
            f"read; load it with one of {', '.join(ROUTABLE)}",
        )
    why = unsupported_attention(model.config)
    if why:
        raise FusedUnsupportedError(name, why, modes=())
