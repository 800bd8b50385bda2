"""The old import path of the fused attention (``tqbench.engine.cache.fused.attention``), kept so that
existing importers still work; new code imports from ``tqbench.engine.cache.fused``."""

from tqbench.engine.cache.fused.choose import IMPL_ENV, choose_impl
from tqbench.engine.cache.fused.install import (
    ATTN_NAME,
    fused_attention,
    fused_attention_forward,
    install_fused_attention,
)
from tqbench.engine.cache.fused.layout import packed_side
from tqbench.engine.cache.fused.torch_ref import reference_fused_attention

__all__ = [
    "ATTN_NAME",
    "IMPL_ENV",
    "choose_impl",
    "fused_attention",
    "fused_attention_forward",
    "install_fused_attention",
    "packed_side",
    "reference_fused_attention",
]
