"""Codec names, torch-free: what ``policy`` checks a spec with before torch is imported (``canonical_spec``,
``is_valid_spec``, ``nominal_bits``, the head-list syntax, the GGML and calibrated names). A codec name, decoded once: ``parse_codec_name("turbo3-qjl")`` -> family ``turbo-qjl``, 3 bits. The registry
builds codecs from it (``codec_from_spec``) and reads the bits a name stands for from it (``nominal_bits``)."""

from __future__ import annotations

import re
from dataclasses import dataclass

#: dense passthrough, affine int, TurboQuant (plain, outlier split, QJL), llama.cpp GGML blocks, fp8 and fp4
#: engine formats, calibrated key transforms, vLLM's TurboQuant keys (Lloyd-Max) and values (uniform)
FAMILIES = ("dense", "affine", "turbo", "turbo-split", "turbo-qjl", "ggml", "fp8", "fp4", "pcaq", "vllm-tq", "vllm-u")
DENSE_NAMES = ("fp16", "bf16", "fp32")
ROLES = ("k", "v")
#: the widest calibrated (pcaq) coordinate (``calibrated_fit.MAX_BITS``)
PCAQ_MAX_BITS = 6
#: vLLM's ``--kv-cache-dtype`` preset -> (key codec, value codec) as tqbench specs
VLLM_TQ_PRESETS: dict[str, tuple[str, str]] = {
    "turboquant_k8v4": ("fp8_e4m3", "vllm_u4"),
    "turboquant_4bit_nc": ("vllm_tq4_nc", "vllm_u4"),
    "turboquant_k3v4_nc": ("vllm_tq3_nc", "vllm_u4"),
    "turboquant_3bit_nc": ("vllm_tq3_nc", "vllm_u3"),
}
#: vLLM keeps the first and last this many attention layers at the model's dtype with any turboquant preset
#: (``TurboQuantConfig.get_boundary_skip_layers``, n=2, at most half the layers; none on hybrid Mamba models)
BOUNDARY_LAYERS = 2


class GgmlType:
    """One GGML block type: its name, bytes per block of 32 and nominal bits."""

    def __init__(self, name: str, block_bytes: int, bits: int) -> None:
        self.name, self.block_bytes, self.bits = name, block_bytes, bits


GGML_TYPES: dict[str, GgmlType] = {
    t.name: t for t in (
        GgmlType("q8_0", 2 + 32, 8),
        GgmlType("q5_1", 2 + 2 + 4 + 16, 5),
        GgmlType("q5_0", 2 + 4 + 16, 5),
        GgmlType("q4_1", 2 + 2 + 16, 4),
        GgmlType("q4_0", 2 + 16, 4),
        GgmlType("iq4_nl", 2 + 16, 4),
    )
}


CALIBRATED_SPECS: tuple[str, ...] = ("pcaq2", "pcaq2.5", "pcaq3", "pcaq3.5", "pcaq4")
_SPEC = re.compile(r"pcaq(\d+(?:\.\d+)?)")


def calibrated_bits(spec: str) -> float | None:
    """The average width of a ``pcaq{b}`` spec, or None when ``spec`` is not one (ValueError when out of range)."""
    m = _SPEC.fullmatch(spec.strip().lower()) if isinstance(spec, str) else None
    if m is None:
        return None
    bits = float(m.group(1))
    if not 0.5 <= bits <= PCAQ_MAX_BITS:
        raise ValueError(f"{spec}: the average width must be between 0.5 and {PCAQ_MAX_BITS} bits per coordinate")
    return bits


def is_calibrated_spec(spec: str) -> bool:
    try:
        return calibrated_bits(spec) is not None
    except ValueError:
        return False



HEAD_SEP = "|"


def is_head_list(spec) -> bool:
    """True when ``spec`` is a per-KV-head list (``turbo2|turbo4|...``)."""
    return isinstance(spec, str) and HEAD_SEP in spec


def split_head_list(spec: str) -> list[str]:
    """The entries of a head list, stripped; ValueError for an empty entry or a nested list."""
    entries = [e.strip() for e in spec.split(HEAD_SEP)]
    for i, e in enumerate(entries):
        if not e:
            raise ValueError(f"head list {spec!r}: entry {i} is empty: give one codec per KV head, in head order, "
                             "e.g. turbo2|turbo4|turbo2")
        if any(c in e for c in "[](){},;"):
            raise ValueError(f"head list {spec!r}: entry {e!r} is not a codec name: a head list is one flat list "
                             "of codecs, one per KV head (SPEC0|SPEC1|...); lists cannot nest")
    return entries




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


CODEC_SPECS: tuple[str, ...] = (
    "fp16",
    "bf16",
    "fp32",
    "int8",
    "int4",
    "int2",
    "turbo1",
    "turbo2",
    "turbo3",
    "turbo4",
    "turbo1.5",
    "turbo2.5",
    "turbo3.5",
    "turbo2-qjl",
    "turbo3-qjl",
    "turbo4-qjl",
    # the engines' own KV formats, bit-exact (ggml.py, fp8.py)
    "q8_0",
    "q5_1",
    "q5_0",
    "q4_1",
    "q4_0",
    "iq4_nl",
    "fp8_e4m3",
    "fp8_e5m2",
    "fp8_e4m3-prefill",
    "fp8_e5m2-prefill",
    "fp4_mx_block16",
    # vLLM's TurboQuant keys and values (vllm_tq.py)
    "vllm_tq4_nc",
    "vllm_tq3_nc",
    "vllm_u4",
    "vllm_u3",
)
#: the codecs that are an inference engine's own KV storage (llama.cpp's GGML types, fp8 with per-tensor scales,
#: vLLM's TurboQuant keys and values)
ENGINE_FORMAT_SPECS: tuple[str, ...] = (*GGML_TYPES, "fp8_e4m3", "fp8_e5m2", "fp8_e4m3-prefill", "fp8_e5m2-prefill",
                                        "fp4_mx_block16", "vllm_tq4_nc", "vllm_tq3_nc", "vllm_u4", "vllm_u3")
ALIASES: dict[str, str] = {"q8": "int8", "q4": "int4", "q2": "int2", "f16": "fp16", "f32": "fp32"}


def canonical_spec(spec: str) -> str:
    """The canonical name of ``spec`` (aliases resolved, case and spaces ignored); ValueError if unknown.

    A per-KV-head list ``SPEC0|SPEC1|...`` gives its canonical entries joined by ``|``, or the one entry when
    they are all equal."""
    if is_head_list(spec):
        entries = []
        for e in split_head_list(spec):
            try:
                entries.append(canonical_spec(e))
            except ValueError as exc:
                raise ValueError(f"head list {spec!r}: {exc}") from None
        return entries[0] if len(set(entries)) == 1 else HEAD_SEP.join(entries)
    name = spec.strip().lower() if isinstance(spec, str) else spec
    name = ALIASES.get(name, name)
    if isinstance(name, str) and name.startswith("pcaq"):  # calibrated: any pcaq{b}, b in 0.5..6
        try:
            bits = calibrated_bits(name)
        except ValueError as exc:
            raise ValueError(f"unknown codec {spec!r}: {exc}") from None
        if bits is not None:
            return f"pcaq{bits:g}"
    if name not in CODEC_SPECS:
        valid = ", ".join(CODEC_SPECS + tuple(ALIASES) + CALIBRATED_SPECS)
        raise ValueError(f"unknown codec {spec!r}: valid codecs are {valid}")
    return name


def is_valid_spec(spec: str) -> bool:
    """True if ``spec`` names a codec (aliases included)."""
    try:
        canonical_spec(spec)
    except ValueError:
        return False
    return True


def nominal_bits(spec: str) -> float:
    """The bits a spec is named by: ``turbo2.5`` -> 2.5, ``turbo3-qjl`` -> 3, ``int8`` -> 8, ``fp16`` -> 16,
    ``q4_0`` -> 4 (its scales are in ``codec_bits_per_element``: 4.5), ``fp8_e4m3`` -> 8; a head list: the mean
    over its heads."""
    name = canonical_spec(spec)
    if is_head_list(name):
        entries = split_head_list(name)
        return sum(nominal_bits(e) for e in entries) / len(entries)
    return parse_codec_name(name).bits
