"""The codec registry: every spec builds, errors name the bad part, byte accounting is exact for all."""

from __future__ import annotations

import math

import pytest
import torch

from tqbench.engine.codecs import (
    ALIASES,
    CODEC_SPECS,
    AffineChannelCodec,
    AffineTokenCodec,
    DenseCodec,
    TurboCodec,
    TurboProdCodec,
    TurboSplitCodec,
    codec_from_spec,
    is_valid_spec,
)
from tqbench.engine.codecs.base import Codec
from tqbench.engine.codecs.ggml import GGML_TYPES

# relative error E||x - x_hat||^2 / E||x||^2 a working codec stays under (loose: catches broken codecs)
MAX_REL_ERR = {"int8": 1e-4, "int4": 0.02, "int2": 0.25, "1": 0.4, "1.5": 0.3, "2": 0.13, "2.5": 0.08}
MAX_REL_ERR |= {"3": 0.04, "3.5": 0.02, "4": 0.011, "2-qjl": 0.7, "3-qjl": 0.25, "4-qjl": 0.08}
#: the engines' formats (GGML blocks of 32 with fp16 scales, fp8 per tensor)
MAX_REL_ERR |= {"q8_0": 1e-4, "q5_1": 0.003, "q5_0": 0.004, "q4_1": 0.012, "q4_0": 0.016, "iq4_nl": 0.012,
                "fp8_e4m3": 0.002, "fp8_e5m2": 0.006, "fp8_e4m3-prefill": 0.002, "fp8_e5m2-prefill": 0.006,
                "fp4_mx_block16": 0.03}
#: vLLM's TurboQuant keys (Lloyd-Max, norm-corrected) and per-row uniform values
MAX_REL_ERR |= {"vllm_tq4_nc": 0.013, "vllm_tq3_nc": 0.045, "vllm_u4": 0.015, "vllm_u3": 0.06}


def _rel_bound(spec: str) -> float:
    return MAX_REL_ERR[spec] if spec in MAX_REL_ERR else MAX_REL_ERR[spec.removeprefix("turbo")]


def test_specs_and_aliases() -> None:
    assert len(set(CODEC_SPECS)) == len(CODEC_SPECS) == 31
    for spec in (*CODEC_SPECS, *ALIASES, " Turbo4 ", "Q8"):
        assert is_valid_spec(spec)
    for bad in ("turbo5", "int3", "fp8", "", "turbo1-qjl", "turbo2.25"):
        assert not is_valid_spec(bad)
    assert codec_from_spec("q4").spec == "int4" and codec_from_spec("q2", role="k").spec == "int2"


@pytest.mark.parametrize("bad", ["xyz", "turbo5", "int3", "turbo1-qjl"])
def test_unknown_spec_message(bad: str) -> None:
    with pytest.raises(ValueError) as err:
        codec_from_spec(bad)
    msg = str(err.value)
    assert msg.startswith(f"unknown codec '{bad}': valid codecs are fp16, bf16, fp32, int8")
    for spec in (*CODEC_SPECS, *ALIASES):
        assert spec in msg


def test_bad_options() -> None:
    with pytest.raises(ValueError, match="unknown rotation 'dct': valid rotations are qr, hadamard"):
        codec_from_spec("turbo4", rotation="dct")
    with pytest.raises(ValueError, match="center must be True or False"):
        codec_from_spec("turbo4", center="yes")
    with pytest.raises(ValueError, match="norm_correction must be True or False"):
        codec_from_spec("turbo4", norm_correction=1)
    with pytest.raises(ValueError, match="group must be a positive integer"):
        codec_from_spec("int4", group=0)
    with pytest.raises(ValueError, match="kblock must be a positive integer"):
        codec_from_spec("int4", role="k", kblock=2.5)
    with pytest.raises(ValueError, match="seed must be an integer"):
        codec_from_spec("turbo2", seed="0")
    with pytest.raises(ValueError, match="unknown codec option.*blocks.*valid options are rotation, center"):
        codec_from_spec("int8", blocks=4)
    with pytest.raises(ValueError, match="unknown role 'q': valid roles are k, v"):
        codec_from_spec("int8", role="q")


def test_spec_to_class_and_options() -> None:
    expected = {
        "fp16": DenseCodec,
        "turbo3": TurboCodec,
        "turbo3-qjl": TurboProdCodec,
        "turbo2.5": TurboSplitCodec,
    }
    for spec, cls in expected.items():
        assert type(codec_from_spec(spec)) is cls
    assert isinstance(codec_from_spec("int4", role="v", group=16), AffineTokenCodec)
    k = codec_from_spec("int4", role="k", kblock=16)
    assert isinstance(k, AffineChannelCodec) and k.tokens_per_unit == 16
    t = codec_from_spec("turbo4", rotation="hadamard", center=True, norm_correction=False, seed=7)
    assert (t.rotation, t.center, t.norm_correction, t.seed) == ("hadamard", True, False, 7)
    assert codec_from_spec("fp32").lossless and not codec_from_spec("int8").lossless


def _rows(spec: str, b: int, h: int, t: int, d: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(CODEC_SPECS.index(spec) * 1000 + d)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(spec, torch.float32)
    return (torch.randn(b, h, t, d, generator=g) + 0.5 * torch.randn(1, h, 1, d, generator=g)).to(dtype)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("role", ["k", "v"])
@pytest.mark.parametrize("spec", CODEC_SPECS)
def test_unit_bytes_match_encoded_fields(spec: str, role: str, d: int) -> None:
    codec: Codec = codec_from_spec(spec, role=role, center=role == "k", kblock=16, group=32)
    b, h, t = 2, 3, 32
    x = _rows(spec, b, h, t, d)
    state = codec.calibrate(x)
    enc = codec.encode(x, state)
    units = t // codec.tokens_per_unit
    for name, v in enc.items():
        assert v.shape[:3] == (b, h, units), name
    nbytes = sum(v.numel() * v.element_size() for v in enc.values())
    assert nbytes == b * h * units * codec.unit_bytes(d)
    assert codec.bits_per_element(d) == codec.unit_bytes(d) * 8 / (codec.tokens_per_unit * d)
    y = codec.decode(enc, state, x.dtype)
    assert y.shape == x.shape and y.dtype == x.dtype
    if codec.lossless:
        assert torch.equal(y, x)
        assert codec.unit_bytes(d) == d * (4 if spec == "fp32" else 2)
    else:
        rel = ((y.double() - x.double()) ** 2).sum() / (x.double() ** 2).sum()
        assert rel < _rel_bound(spec), rel.item()


@pytest.mark.parametrize("spec", [s for s in CODEC_SPECS if s.startswith("turbo")])
def test_turbo_shared_objects(spec: str) -> None:
    d = 128
    codec = codec_from_spec(spec)
    other = codec_from_spec(spec, seed=1)
    assert set(codec.shared_items(d)) != set(other.shared_items(d))  # another seed: another rotation
    assert codec.shared_items(d) == codec_from_spec(spec).shared_items(d)
    bits = float(spec.removeprefix("turbo").removesuffix("-qjl"))
    if spec.endswith("-qjl"):
        expected = d * d * 4 + (1 << (int(bits) - 1)) * 4 + d * d * 4
    elif bits != int(bits):
        expected = 2 * (d // 2) ** 2 * 4 + ((1 << math.ceil(bits)) + (1 << math.floor(bits))) * 4
    else:
        expected = d * d * 4 + (1 << int(bits)) * 4
    assert codec.shared_bytes(d) == expected
    assert codec_from_spec("fp16").shared_items(d) == {} and codec_from_spec("int4").shared_bytes(d) == 0


def test_bits_per_element_of_a_spec_from_the_registry() -> None:
    """One answer to "bits per element of this spec": packed bits (metadata included) and the nominal bits."""
    from tqbench.engine.codecs import codec_bits_per_element, nominal_bits

    assert codec_bits_per_element("turbo4", 64) == 4.25  # 32 code bytes + a 2-byte norm per 64 elements
    assert codec_bits_per_element("int8", 64) == 9.0 and codec_bits_per_element("fp16", 128) == 16.0
    for spec in CODEC_SPECS:
        d = 96 if spec in GGML_TYPES or spec == "fp4_mx_block16" else 80  # blocks of 32 / 16 values
        d = 128 if spec.startswith("vllm_") else d  # vLLM's Hadamard rotation: a power of two
        both = [codec_from_spec(spec, role).bits_per_element(d) for role in ("k", "v")]
        assert codec_bits_per_element(spec, d) == sum(both) / 2
    assert [nominal_bits(s) for s in ("turbo2.5", "turbo3-qjl", "int8", "fp16", "fp32", "q4")] == [
        2.5, 3.0, 8.0, 16.0, 32.0, 4.0]
    with pytest.raises(ValueError, match="unknown codec"):
        nominal_bits("turbo5")
