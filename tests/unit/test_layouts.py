"""The layouts table (kernels/layouts.py): every codec states its packed layout in one place, and the table's row
names exactly the payload fields the codec stores."""

import pytest
import torch

from tqbench.engine.codecs import codec_from_spec
from tqbench.kernels.layouts import KINDS, LAYOUTS, TRANSFORMED, layout_of
from tqbench.kernels.reference import PackedSide

# (spec, role): every codec with a fused form, and some without
FUSED = [("turbo4", "k"), ("turbo2", "v"), ("turbo3", "v"), ("int4", "k"), ("int8", "k"), ("int4", "v"),
         ("int2", "v")]
NOT_FUSED = [("fp16", "v"), ("q8_0", "v"), ("fp8_e4m3", "v"), ("turbo3.5", "v"), ("turbo4-qjl", "k"), ("vllm_tq4_nc", "k")]


@pytest.mark.parametrize("spec,role", FUSED)
def test_a_codec_states_its_layout_and_its_fields_are_the_tables(spec, role):
    codec = codec_from_spec(spec, role=role)
    assert codec.layout in LAYOUTS and role in LAYOUTS[codec.layout].roles
    x = torch.randn(1, 2, 32, 64)
    state = codec.calibrate(x)
    enc = codec.encode(x, state)
    lay = layout_of(codec.layout)
    assert set(lay.payload_fields) == set(enc)  # the row names exactly what the codec stores
    side = codec.packed_side(enc, 32, 64, torch.float32, state)
    assert isinstance(side, PackedSide) and side.kind == codec.layout


@pytest.mark.parametrize("spec,role", NOT_FUSED)
def test_a_codec_without_a_fused_form_says_none(spec, role):
    codec = codec_from_spec(spec, role=role)
    assert codec.layout is None
    assert codec.packed_side({}, 0, 64, torch.float32, {}) is None


def test_the_table():
    assert KINDS == ("turbo", "affine-channel", "affine-token", "pcaq")  # the Triton kernel's kind ids
    assert TRANSFORMED == ("turbo", "pcaq")
    assert LAYOUTS["pcaq"].roles == ("k",) and not LAYOUTS["pcaq"].table_decoded
    assert LAYOUTS["affine-channel"].grouped_rows and not LAYOUTS["affine-token"].grouped_rows
    assert [k for k, row in LAYOUTS.items() if row.int_scoring] == ["turbo", "pcaq"]
    with pytest.raises(ValueError, match="unknown packed kind 'nf4': valid kinds are turbo, affine-channel"):
        layout_of("nf4")
    with pytest.raises(ValueError, match="unknown packed kind"):
        PackedSide("nf4", 4, {}, 0, 64)
