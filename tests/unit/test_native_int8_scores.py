"""Turbo keys scored in integers by the native kernel (``Side.score_int8``: int8 query x uint8 codebook;
``Side.score_int16``: int16 x int16; exact int32 sums, AVX-512 VNNI): the kernel equals a float64 emulation of that
arithmetic, every emulated score is within the stated bound (``int_score_bound``) of the float score, and the
attention output within what that bound allows.
"""

from __future__ import annotations

import dataclasses
import math
import shutil

import pytest
import torch

if shutil.which("c++") is None:  # pragma: no cover - CI and this machine have g++
    pytest.skip("no C++ compiler: the native kernel cannot build here", allow_module_level=True)

from tests.unit.test_native_kernel import _packed  # noqa: E402
from tqbench.kernels.cpu.attention import (  # noqa: E402
    INT_SCORE_STEPS,
    int_score_bound,
    kernel_rules,
    kernel_side,
    native_attention_batch,
)
from tqbench.kernels.reference import dequantize_side  # noqa: E402


@pytest.fixture
def vnni():
    """Skip where this CPU's build has no AVX-512 VNNI (integer scoring is then refused: tested below)."""
    if not kernel_rules()["score_int8_bits"]:
        pytest.skip("this CPU's build has no AVX-512 VNNI: score_int8 / score_int16 are refused (tested below)")


needs_vnni = pytest.mark.usefixtures("vnni")


def _case(spec, d, seed, n=70, before=0, after=0):
    gen = torch.Generator().manual_seed(seed)
    b, h, g = 1, 2, 3
    k = torch.randn(b, h, before + n + after, d, generator=gen)
    v = torch.randn(b, h, before + n + after, d, generator=gen)
    q = torch.randn(b, h * g, 1, d, generator=gen) * 2
    ks, _ = _packed(spec, "k", k[:, :, before:before + n], torch.float32)
    vs, v_dec = _packed(spec, "v", v, torch.float32)
    return q, k, ks, vs, v_dec, (b, h, g, d)


def _scores(q, ks, dims, option="score_int8"):
    """(float64 scores, emulated integer scores, their bound), [b, h, g, n], from the side's codes."""
    steps = INT_SCORE_STEPS[option]
    b, h, g, d = dims
    nlev = 1 << ks.bits
    as_index = dataclasses.replace(ks, levels=torch.arange(nlev, dtype=torch.float64), mu=None, _tables={},
                                   payload={"idx": ks.payload["idx"], "norm": torch.ones_like(ks.payload["norm"])})
    codes = dequantize_side(as_index, torch.float64).round().long()
    lev, rot = ks.levels.double(), ks.rotation.double()
    norm = ks.payload["norm"].double().squeeze(-1)[:, :, None, :]
    qs = q.double().view(b, h, g, d) * d ** -0.5
    qr = qs @ rot.T
    qmu = qs @ ks.mu.double().transpose(-1, -2)
    exact = norm * torch.einsum("bhgd,bhnd->bhgn", qr, lev[codes]) + qmu
    step = (qr.abs().amax(-1, keepdim=True).float() / steps).double()
    beta = (lev.abs().max().float() / steps).double()
    q_int = torch.round(qr.float() / step.float()).double()
    cb_int = torch.round(lev.float() / beta.float()).double()
    emulated = norm * (step * beta) * torch.einsum("bhgd,bhnd->bhgn", q_int, cb_int[codes]) + qmu
    return exact, emulated, int_score_bound(qr, lev, ks.payload["norm"].squeeze(-1)[:, :, None, :], steps)


def _attend(q, ks, vs, d, option=None):
    a, _ = kernel_side(ks, [], 0, d, torch.float32)
    c, _ = kernel_side(vs, [], 0, d, torch.float32)
    if option:
        setattr(a, option, True)
    return native_attention_batch(q, [a], [c], d ** -0.5)[0].double()


@needs_vnni
@pytest.mark.parametrize("option", ["score_int8", "score_int16"])
@pytest.mark.parametrize("spec,d", [("turbo4", 64), ("turbo4", 128), ("turbo2", 64), ("turbo2", 256), ("turbo3", 64),
                                    ("turbo3", 192)])
def test_int_scores_are_the_emulated_arithmetic_and_within_their_bound(spec, d, option):
    if int(spec[5]) not in kernel_rules()["score_int8_bits"]:
        pytest.skip(f"this build scores {spec} keys in float only (3-bit integer scoring needs AVX-512 VBMI)")
    q, _, ks, vs, v_dec, dims = _case(spec, d, seed=d)
    b, h, g, _ = dims
    exact, emulated, bound = _scores(q, ks, dims, option)
    err = (emulated - exact).abs()
    assert (err <= bound).all(), f"worst error / bound {float((err / bound).max()):.3f}"
    assert err.max() > 0  # the path is not exact: the bound is what it promises
    out = _attend(q, ks, vs, d, option)
    ref = (torch.softmax(emulated, -1) @ v_dec).reshape(b, h * g, 1, d)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    # the whole output against the float path: weights move by a factor within exp(+-2 e)
    float_out = _attend(q, ks, vs, d)
    eps = float(bound.max())
    assert float((out - float_out).abs().max()) <= (math.exp(2 * eps) - 1) * float(v_dec.abs().max())


@needs_vnni
@pytest.mark.parametrize("option", ["score_int8", "score_int16"])
def test_one_wrong_code_fails_the_int_check(option):
    q, _, ks, vs, v_dec, dims = _case("turbo4", 64, seed=3)
    b, h, g, d = dims
    _, emulated, _ = _scores(q, ks, dims, option)
    ks.payload["idx"][0, 1, 5, 3] ^= 0x11
    out = _attend(q, ks, vs, d, option)
    ref = (torch.softmax(emulated, -1) @ v_dec).reshape(b, h * g, 1, d)
    assert float((out - ref).abs().max()) > 1e-4


@needs_vnni
def test_dense_rows_beside_int8_rows_are_scored_in_float():
    """Rows outside the packed run (a dense tail) take the float path; the packed rows stay 8-bit."""
    q, k, ks, vs, v_dec, dims = _case("turbo4", 64, seed=11, n=64)
    b, h, g, d = dims
    tail = torch.randn(b, h, 5, d, generator=torch.Generator().manual_seed(1))
    v_tail = torch.randn(b, h, 5, d, generator=torch.Generator().manual_seed(2))
    a, _ = kernel_side(ks, [tail], 0, d, torch.float32)
    c, _ = kernel_side(vs, [v_tail], 0, d, torch.float32)
    a.score_int8 = True
    out = native_attention_batch(q, [a], [c], d ** -0.5)[0]
    a.score_int8 = False
    ref = native_attention_batch(q, [a], [c], d ** -0.5)[0]
    _, _, bound = _scores(q, ks, dims)
    vmax = max(float(v_dec.abs().max()), float(v_tail.abs().max()))
    assert 0 < float((out - ref).abs().max()) <= (math.exp(2 * float(bound.max())) - 1) * vmax


@pytest.mark.parametrize("spec,role,d,dt,what", [
    ("turbo1", "k", 64, torch.float32, "4- or 2-bit turbo codes"),
    ("turbo4", "k", 48, torch.float32, "head_dim a multiple of 64"),
    ("turbo4", "k", 64, torch.float64, "float32 queries"),
    ("turbo4", "v", 64, torch.float32, "only keys are scored"),
])
@pytest.mark.parametrize("option", ["score_int8", "score_int16"])
def test_int_scoring_is_refused_where_it_cannot_run_with_the_reason(spec, role, d, dt, what, option):
    x = torch.randn(1, 2, 8, d, generator=torch.Generator().manual_seed(0))
    side, _ = _packed(spec, role, x, dt)
    other, _ = _packed("turbo4", "v" if role == "k" else "k", x, dt)
    s, _ = kernel_side(side, [], 0, d, dt)
    o, _ = kernel_side(other, [], 0, d, dt)
    setattr(s, option, True)
    ks, vs = (s, o) if role == "k" else (o, s)
    q = torch.randn(1, 4, 1, d, dtype=dt)
    with pytest.raises(RuntimeError, match=what if kernel_rules()["score_int8_bits"] or role == "v" else "VNNI"):
        native_attention_batch(q, [ks], [vs], 0.1)


@needs_vnni
def test_int16_scores_are_far_closer_than_int8():
    q, _, ks, _, _, dims = _case("turbo4", 128, seed=5)
    exact, e8, _ = _scores(q, ks, dims, "score_int8")
    _, e16, _ = _scores(q, ks, dims, "score_int16")
    assert float((e16 - exact).abs().max()) < float((e8 - exact).abs().max()) / 10


def test_int8_and_int16_are_exclusive():
    x = torch.randn(1, 2, 8, 64, generator=torch.Generator().manual_seed(0))
    k, _ = _packed("turbo4", "k", x, torch.float32)
    v, _ = _packed("turbo4", "v", x, torch.float32)
    a, _ = kernel_side(k, [], 0, 64, torch.float32)
    c, _ = kernel_side(v, [], 0, 64, torch.float32)
    a.score_int8 = a.score_int16 = True
    with pytest.raises(RuntimeError, match="exclusive" if kernel_rules()["score_int8_bits"] else "VNNI"):
        native_attention_batch(torch.randn(1, 4, 1, 64), [a], [c], 0.1)


@pytest.mark.parametrize("spec,role,d,dt,expect", [
    ("turbo4", "k", 64, torch.float32, True), ("turbo2", "k", 128, torch.float32, True),
    ("turbo3", "k", 64, torch.float32, True), ("turbo1", "k", 64, torch.float32, False),
    ("turbo4", "k", 48, torch.float32, False),
    ("turbo4", "k", 64, torch.float64, False), ("int4", "k", 64, torch.float32, False),
])
def test_the_engine_scores_in_16_bits_exactly_the_keys_the_kernel_can(spec, role, d, dt, expect):
    from tqbench.kernels.cpu.attention import KEY_INT_SCORING, key_scoring

    x = torch.randn(1, 2, 8, d, generator=torch.Generator().manual_seed(0))
    side, _ = kernel_side(_packed(spec, role, x, dt)[0], [], 0, d, dt)
    assert KEY_INT_SCORING == "score_int16"
    can = expect and int(spec[-1]) in kernel_rules()["score_int8_bits"]  # (3-bit: where the build has VBMI)
    assert key_scoring(side, dt) is can
    assert side.score_int16 is can and side.score_int8 is False
