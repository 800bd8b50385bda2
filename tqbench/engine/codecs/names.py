"""A codec name, decoded once: ``parse_codec_name("turbo3-qjl")`` -> family ``turbo-qjl``, 3 bits. The registry
builds codecs from it (``codec_from_spec``) and reads the bits a name stands for from it (``nominal_bits``)."""

from __future__ import annotations

from dataclasses import dataclass

from .calibrated import calibrated_bits
from .ggml import GGML_TYPES

#: dense passthrough, affine int, TurboQuant (plain, outlier split, QJL), llama.cpp GGML blocks, fp8 and fp4
#: engine formats, calibrated key transforms, vLLM's TurboQuant keys (Lloyd-Max) and values (uniform)
FAMILIES = ("dense", "affine", "turbo", "turbo-split", "turbo-qjl", "ggml", "fp8", "fp4", "pcaq", "vllm-tq", "vllm-u")
DENSE_NAMES = ("fp16", "bf16", "fp32")


@dataclass(frozen=True)
class CodecName:
    """One canonical codec name (not a head list): its family, the bits it is named by and, for fp8, the format
    (``e4m3`` / ``e5m2``) and scale (``static`` / ``prefill``)."""

    spec: str
    family: str
    bits: float
    fmt: str = ""
    scale: str = ""


def parse_codec_name(name: str) -> CodecName:
    """Decode a canonical codec name (``canonical_spec`` first; one entry, not a head list); ValueError otherwise."""
    pcaq = calibrated_bits(name)
    if pcaq is not None:
        return CodecName(name, "pcaq", pcaq)
    if name in DENSE_NAMES:
        return CodecName(name, "dense", float(name[2:]))
    if name in GGML_TYPES:
        return CodecName(name, "ggml", float(GGML_TYPES[name].bits))
    if name in ("vllm_tq3_nc", "vllm_tq4_nc"):
        return CodecName(name, "vllm-tq", float(name[7]))
    if name in ("vllm_u3", "vllm_u4"):
        return CodecName(name, "vllm-u", float(name[6]))
    if name == "fp4_mx_block16":
        return CodecName(name, "fp4", 4.0)
    if name.startswith("fp8_"):
        fmt, _, scale = name.removeprefix("fp8_").partition("-")
        return CodecName(name, "fp8", 8.0, fmt, scale or "static")
    try:
        if name.startswith("int"):
            return CodecName(name, "affine", float(int(name.removeprefix("int"))))
        if name.startswith("turbo"):
            digits = name.removeprefix("turbo")
            if digits.endswith("-qjl"):
                return CodecName(name, "turbo-qjl", float(int(digits.removesuffix("-qjl"))))
            return CodecName(name, "turbo-split" if "." in digits else "turbo", float(digits))
    except ValueError:
        pass
    raise ValueError(f"{name!r} is not a codec name (see CODEC_SPECS)")
