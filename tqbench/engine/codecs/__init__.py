"""Codec registry: ``codec_from_spec("turbo4", role="k", center=True)``, the list of valid specs, and what a
spec costs: ``codec_bits_per_element(spec, head_dim)`` (packed bits, metadata included) and ``nominal_bits``.

The names (``CODEC_SPECS``, ``canonical_spec``, ``is_valid_spec``, ``nominal_bits``, head lists) come from
``names.py`` and import no torch, so a policy is checked before torch loads; the codecs themselves and
``codec_from_spec`` (``registry.py``) load on first use."""

from __future__ import annotations

import importlib

from .names import (
    ALIASES,
    CALIBRATED_SPECS,
    CODEC_SPECS,
    ENGINE_FORMAT_SPECS,
    GGML_TYPES,
    HEAD_SEP,
    ROLES,
    CodecName,
    calibrated_bits,
    canonical_spec,
    is_calibrated_spec,
    is_head_list,
    is_valid_spec,
    nominal_bits,
    parse_codec_name,
    split_head_list,
)

#: torch names, loaded on first use: name -> submodule
_LAZY = {
    "AffineChannelCodec": "affine", "AffineTokenCodec": "affine", "Codec": "base", "Encoded": "base",
    "compute_dtype": "base", "PcaKeyCodec": "calibrated", "DenseCodec": "dense", "Fp4Block16Codec": "fp4",
    "Fp8Codec": "fp8", "GgmlCodec": "ggml", "HeadSplitCodec": "heads", "group_heads": "heads",
    "TurboCodec": "turbo", "TurboProdCodec": "turbo", "TurboSplitCodec": "turbo", "ROTATIONS": "rotation",
    "CODEC_OPTS": "registry", "codec_from_spec": "registry", "head_codecs": "registry",
    "codec_bits_per_element": "registry", "VllmTqKeyCodec": "vllm_tq", "VllmUniformCodec": "vllm_tq",
}

__all__ = [
    "ALIASES", "CALIBRATED_SPECS", "CODEC_SPECS", "ENGINE_FORMAT_SPECS", "GGML_TYPES", "HEAD_SEP", "ROLES",
    "CodecName", "calibrated_bits", "canonical_spec", "is_calibrated_spec", "is_head_list", "is_valid_spec",
    "nominal_bits", "parse_codec_name", "split_head_list", *_LAZY,
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'tqbench.engine.codecs' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value
