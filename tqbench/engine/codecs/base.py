"""The codec contract: what a KV row becomes and what it costs.

A codec turns rows ``x`` of shape ``[batch, kv_heads, tokens, head_dim]`` into a dict of packed tensors
(``Encoded``) and back. Every packed tensor has the layout ``[batch, kv_heads, units, ...]``: dim 2 counts
*units*, and a unit is ``tokens_per_unit`` consecutive tokens (1 for per-token codecs; the token block
size for per-channel codecs such as KIVI-style affine keys). The cache appends encoded chunks along dim 2,
so a codec never sees its own history.

Byte accounting is exact: ``unit_bytes(head_dim)`` is the number of bytes one unit of one (batch, head)
occupies in the packed dict (indices + every norm, scale and zero), ``state_bytes`` counts per-layer
calibration tensors (key centering means, ...), and ``shared_items`` names the objects shared by every
layer (rotations, codebooks, QJL matrices) with their bytes, which a cache counts once per name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

Encoded = dict[str, torch.Tensor]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Quantize in at least fp32, and in fp64 when the model runs in fp64 (exactness across paths)."""
    return torch.promote_types(dtype, torch.float32)



def bits_per_element(stored_bytes: int, elements: int) -> float:
    """Stored bits per K/V element (``stored_bytes`` holding ``elements`` values, every byte of metadata that
    was counted included): the one definition every report, estimate, solver and table uses."""
    return stored_bytes * 8 / elements if elements else 0.0

class Codec(ABC):
    """Base class of every codec. Subclasses are small frozen-ish objects built by ``codec_from_spec``."""

    #: canonical spec string, e.g. ``"turbo4"``, ``"int8"``, ``"fp16"``
    spec: str = ""
    #: consecutive tokens per storage unit (encode needs a multiple of it)
    tokens_per_unit: int = 1
    #: True for codecs that store rows unchanged (dense)
    lossless: bool = False
    #: the packed layout the kernels read (a row of ``tqbench/kernels/layouts.py``), None: no fused form
    layout: str | None = None

    # -- the fused form ------------------------------------------------------------------------
    def packed_side(self, payload: dict, n: int, head_dim: int, dtype: torch.dtype, state: dict):
        """The kernels' description of ``n`` packed rows of this codec (``tqbench.kernels.reference.PackedSide``,
        its ``kind`` a row of the layouts table, ``tqbench/kernels/layouts.py``), or None: no fused form. A
        codec whose rows the kernels read sets ``layout`` and overrides this; nothing switches on its type."""
        return None

    # -- calibration -------------------------------------------------------------------------
    def calibrate(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-layer state computed once from the first rows the layer quantizes (its prefill).

        Returned tensors are stored as-is and their nbytes are counted by ``state_bytes``.
        Default: no state.
        """
        return {}

    def state_bytes(self, state: dict[str, torch.Tensor]) -> int:
        return int(sum(t.numel() * t.element_size() for t in state.values()))

    # -- encode / decode ---------------------------------------------------------------------
    @abstractmethod
    def encode(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> Encoded:
        """``x``: ``[B, H, T, D]`` with ``T % tokens_per_unit == 0``. Returns packed tensors ``[B, H, T/tpu, ...]``."""

    @abstractmethod
    def decode(self, enc: Encoded, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Inverse of ``encode``: ``[B, H, T, D]`` in ``dtype``."""

    # -- bytes -------------------------------------------------------------------------------
    @abstractmethod
    def unit_bytes(self, head_dim: int) -> int:
        """Exact bytes of one unit of one (batch, head), all per-unit metadata included."""

    def units_bytes(self, head_dim: int, heads: int) -> int:
        """Exact bytes of one unit over ``heads`` KV heads of one batch row (a per-head codec's heads differ)."""
        return heads * self.unit_bytes(head_dim)

    def packed_nbytes(self, fields: dict) -> int:
        """Bytes of the packed fields a store holds (``name -> GrowBuffer``): their tensors' bytes."""
        return sum(buf.nbytes() for buf in fields.values())

    def shared_items(self, head_dim: int) -> dict[str, int]:
        """Shared objects by identity -> bytes; a cache counts each identity once across all codecs."""
        return {}

    def shared_bytes(self, head_dim: int) -> int:
        """Bytes of this codec's shared objects (before de-duplication across codecs)."""
        return sum(self.shared_items(head_dim).values())

    def bits_per_element(self, head_dim: int) -> float:
        """Packed bits per K or V element, per-unit metadata included (state/shared objects excluded)."""
        return bits_per_element(self.unit_bytes(head_dim), self.tokens_per_unit * head_dim)

    def check_input(self, x: torch.Tensor) -> None:
        if x.dim() != 4:
            raise ValueError(
                f"{self.spec}: expected KV rows shaped [batch, kv_heads, tokens, head_dim], got {tuple(x.shape)}"
            )
        if x.shape[2] % self.tokens_per_unit:
            raise ValueError(
                f"{self.spec}: {x.shape[2]} tokens is not a multiple of the codec's block of {self.tokens_per_unit}"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"


def native_encoder(codec):
    """The native CPU module for ``codec``'s quantize + pack (the decode step's append path), or None where it is
    unavailable here: then ``codec.encoder_fallback`` says why (the cache report shows it) and the torch path runs."""
    from tqbench.kernels.cpu import NativeUnavailable, native_module

    try:
        return native_module()
    except NativeUnavailable as exc:
        codec.encoder_fallback = f"quantize-and-pack ran in torch (the native CPU kernel is unavailable: {exc})"
        return None
