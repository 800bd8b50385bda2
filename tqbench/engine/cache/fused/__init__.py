"""The ``fused`` cache mode: attention straight from the packed store.

One job per module, imports in one direction (``install -> choose, torch_ref -> layout``; ``triton_glue ->
torch_ref, layout``, loaded lazily because it imports triton):

- ``install.py``: ``install_fused_attention`` (the transformers registration), ``fused_attention_forward``,
  ``fused_attention`` (picks and counts the implementation of one call);
- ``choose.py``: ``choose_impl`` (Triton kernels or the torch reference, and why);
- ``support.py``: ``check_fused_support`` / ``FusedUnsupportedError`` (which models can run fused, and the
  refusal that names the model class, the reason and the modes that work);
- ``layout.py``: a store's parts around its packed run, ``packed_side`` (the kernels' description of it);
- ``torch_ref.py``: ``reference_fused_attention``, the torch implementation (CPU);
- ``masks.py``: ``bool_mask``, the mask both kernel paths take (or why a mask is not one they take);
- ``triton_glue.py``: ``triton_fused_attention``, the Triton launch (packed kernel + dense rows, merged).
"""

from tqbench.engine.cache.fused.choose import IMPL_ENV, choose_impl
from tqbench.engine.cache.fused.install import (
    ATTN_NAME,
    fused_attention,
    fused_attention_forward,
    install_fused_attention,
)
from tqbench.engine.cache.fused.layout import cat_rows, layout, packed_side
from tqbench.engine.cache.fused.support import FusedUnsupportedError, check_fused_support
from tqbench.engine.cache.fused.torch_ref import reference_fused_attention

__all__ = [
    "ATTN_NAME",
    "FusedUnsupportedError",
    "IMPL_ENV",
    "cat_rows",
    "check_fused_support",
    "choose_impl",
    "fused_attention",
    "fused_attention_forward",
    "install_fused_attention",
    "layout",
    "packed_side",
    "reference_fused_attention",
]
