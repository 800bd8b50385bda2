"""Calibrated (``pcaq``) keys scored in 16 bits by the native kernel (``Side.score_int16`` on a pcaq side: the bit
map as an extraction plan, int16 levels in byte-permute windows, exact int32 sums; AVX-512 VBMI + VNNI): the kernel
equals a float64 emulation of that arithmetic, every emulated score is within the stated bound
(``pcaq_int_score_bound``) of the float score, and the attention output within what that bound allows.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch

if shutil.which("c++") is None:  # pragma: no cover - CI and this machine have g++
    pytest.skip("no C++ compiler: the native kernel cannot build here", allow_module_level=True)

from tests.unit.pcaq_helpers import random_pcaq_side  # noqa: E402
from tqbench.kernels.cpu.attention import (  # noqa: E402
    INT_SCORE_STEPS,
    kernel_rules,
    kernel_side,
    key_scoring,
    native_attention_batch,
    pcaq_int_score_bound,
)
from tqbench.kernels.packing import unpack_widths  # noqa: E402

GROUP = 8  # the calibrated codec's coordinates per level table (calibrated_fit.GROUP)
#: a power of two: the scaled query is exact in float32, so with an identity transform the kernel's float32
#: query is the emulation's, rounded to int16 by the same float operations (no coordinate can round differently)
SCALE = 0.125


@pytest.fixture
def vbmi_vnni():
    if not kernel_rules()["score_int16_pcaq"]:
        pytest.skip("this CPU's build has no AVX-512 VBMI + VNNI: 16-bit pcaq scoring is refused (tested below)")


needs_int16 = pytest.mark.usefixtures("vbmi_vnni")


def _case(d, maxw, shared, seed, n=45, b=1, h=2, g=3, identity=True):
    """(q, pcaq PackedSide, dense V [b, h, n, d]); ``shared``: coordinates of one group of 8 and one width share
    their levels (as the codec's tables do: few windows); else every coordinate its own (many windows).
    ``identity``: the transform is the identity (the emulation is then exact to the kernel's float query)."""
    gen = torch.Generator().manual_seed(seed)
    ks, _ = random_pcaq_side(b, h, n, d, maxw, torch.float32, gen)
    if identity:
        ks.rotation = torch.eye(d).expand(h, d, d).contiguous()
    if shared:
        lev = ks.levels.clone()
        for hh in range(h):
            for j in range(d):
                first = next(i for i in range(j - j % GROUP, j + 1) if int(ks.widths[hh, i]) == int(ks.widths[hh, j]))
                lev[hh, j] = lev[hh, first]
        ks.levels = lev
    v = torch.randn(b, h, n, d, generator=gen)
    q = torch.randn(b, h * g, 1, d, generator=gen) * 2
    return q, ks, v, (b, h, g, d)


def _scores(q, ks, dims):
    """(float64 scores, emulated 16-bit scores, their bound), [b, h, g, n]."""
    steps = INT_SCORE_STEPS["score_int16"]
    b, h, g, d = dims
    idx = torch.stack([unpack_widths(ks.payload["idx"][:, i], ks.widths[i].long()) for i in range(h)], 1)
    lev = ks.levels.double()
    heads, coords = torch.arange(h)[None, :, None, None], torch.arange(d)[None, None, None, :]
    per_row = lev[heads, coords, idx]  # [b, h, n, d]: level of each code
    qs = q.double().view(b, h, g, d) * SCALE
    qr = torch.einsum("bhgd,hjd->bhgj", qs, ks.rotation.double())
    qmu = qs @ ks.mu.double().transpose(-1, -2)
    exact = torch.einsum("bhgj,bhnj->bhgn", qr, per_row) + qmu
    used = torch.arange(lev.shape[-1]) < (1 << ks.widths.long())[..., None]
    lsteps, split = kernel_rules()["pcaq_level_steps"], kernel_rules()["pcaq_lo_split"]
    beta = (torch.where(used, lev.abs(), torch.zeros_like(lev)).amax((-1, -2)).float() / lsteps).double()  # [h]
    step = qr.abs().amax(-1, keepdim=True).float() / steps
    hi = torch.round(qr.float() / step)
    lo = torch.round((qr.float() - hi * step) / (step / split))  # the remainder, split times finer
    q_int, step = hi.double() + lo.double() / split, step.double()
    l_int = torch.round(ks.levels.float() / beta.float()[:, None, None]).double()
    rows_int = l_int[heads, coords, idx]
    emulated = step * beta[:, None, None] * torch.einsum("bhgj,bhnj->bhgn", q_int, rows_int) + qmu
    return exact, emulated, pcaq_int_score_bound(qr, ks.levels, ks.widths)


def _attend(q, ks, v, d, int16, k_dense=(), n_before=0):
    a, _ = kernel_side(ks, list(k_dense), n_before, d, torch.float32)
    c, _ = kernel_side(None, [v], 0, d, torch.float32)
    a.score_int16 = int16
    return native_attention_batch(q, [a], [c], SCALE)[0].double()


@needs_int16
@pytest.mark.parametrize("d,maxw,shared", [(64, 6, False), (64, 1, True), (128, 4, True), (128, 6, True),
                                           (256, 7, False), (192, 3, False)])
def test_pcaq_int16_scores_are_the_emulated_arithmetic_and_within_their_bound(d, maxw, shared):
    q, ks, v, dims = _case(d, maxw, shared, seed=d + maxw)
    b, h, g, _ = dims
    exact, emulated, bound = _scores(q, ks, dims)
    err = (emulated - exact).abs()
    assert (err <= bound).all(), f"worst error / bound {float((err / bound).max()):.3f}"
    assert err.max() > 0  # not exact: the bound is what it promises
    out = _attend(q, ks, v, d, True)
    ref = (torch.softmax(emulated, -1) @ v.double()).reshape(b, h * g, 1, d)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    float_out = _attend(q, ks, v, d, False)
    eps = float(bound.max())
    assert float((out - float_out).abs().max()) <= (math.exp(2 * eps) - 1) * float(v.abs().max())


@needs_int16
def test_one_wrong_pcaq_code_fails_the_int16_check():
    q, ks, v, dims = _case(64, 4, True, seed=3)
    b, h, g, d = dims
    _, emulated, _ = _scores(q, ks, dims)
    ks.payload["idx"][0, 1, 5, 3] ^= 0x11
    out = _attend(q, ks, v, d, True)
    ref = (torch.softmax(emulated, -1) @ v.double()).reshape(b, h * g, 1, d)
    assert float((out - ref).abs().max()) > 1e-4


@needs_int16
def test_codes_in_a_larger_buffer_read_only_their_rows():
    """The engine's codes are a view of a buffer with room for more rows: what lies past the view (here 0xFF) is
    never scored, and rows near the end of a buffer are read whole (a zero-padded copy), bit for bit the same."""
    q, ks, v, dims = _case(128, 5, True, seed=9, n=37)
    d = dims[3]
    out = _attend(q, ks, v, d, True)
    codes = ks.payload["idx"]
    room = torch.full((codes.shape[0], codes.shape[1], codes.shape[2] + 20, codes.shape[3]), 0xFF, dtype=torch.uint8)
    room[:, :, : codes.shape[2]] = codes
    ks.payload["idx"] = room[:, :, : codes.shape[2]]
    assert torch.equal(_attend(q, ks, v, d, True), out)


@needs_int16
def test_dense_rows_beside_int16_pcaq_rows_are_scored_in_float():
    q, ks, v, dims = _case(64, 6, True, seed=11, n=40, identity=False)  # a transform per head
    b, h, g, d = dims
    gen = torch.Generator().manual_seed(1)
    k_tail, v_tail = torch.randn(b, h, 7, d, generator=gen), torch.randn(b, h, 7, d, generator=gen)
    v_all = torch.cat([v, v_tail], 2)
    out = _attend(q, ks, v_all, d, True, k_dense=[k_tail])
    ref = _attend(q, ks, v_all, d, False, k_dense=[k_tail])
    _, _, bound = _scores(q, ks, dims)
    assert 0 < float((out - ref).abs().max()) <= (math.exp(2 * float(bound.max())) - 1) * float(v_all.abs().max())


@pytest.mark.parametrize("d,maxw,dt,what", [
    (48, 4, torch.float32, "head_dim a multiple of 64"),
    (64, 8, torch.float32, "widths <= 7"),
    (64, 4, torch.float64, "float32 queries"),
])
def test_pcaq_int16_is_refused_where_it_cannot_run_with_the_reason(d, maxw, dt, what, monkeypatch):
    from tqbench.kernels.cpu import attention

    gen = torch.Generator().manual_seed(0)
    ks, _ = random_pcaq_side(1, 2, 8, d, maxw, dt, gen)
    a, _ = kernel_side(ks, [], 0, d, dt)
    c, _ = kernel_side(None, [torch.randn(1, 2, 8, d, dtype=dt)], 0, d, dt)
    monkeypatch.setattr(attention, "PCAQ_KEY_INT_SCORING", True)
    assert key_scoring(a, dt) is False and a.score_int16 is False  # the engine never asks for it here
    a.score_int16 = True
    msg = what if kernel_rules()["score_int16_pcaq"] else "VBMI"
    with pytest.raises(RuntimeError, match=msg):
        native_attention_batch(torch.randn(1, 4, 1, d, dtype=dt), [a], [c], 0.1)


def test_pcaq_keys_are_never_scored_in_8_bits():
    gen = torch.Generator().manual_seed(0)
    ks, _ = random_pcaq_side(1, 2, 8, 64, 4, torch.float32, gen)
    a, _ = kernel_side(ks, [], 0, 64, torch.float32)
    c, _ = kernel_side(None, [torch.randn(1, 2, 8, 64)], 0, 64, torch.float32)
    a.score_int8 = True
    with pytest.raises(RuntimeError, match="16 bits"):
        native_attention_batch(torch.randn(1, 4, 1, 64), [a], [c], 0.1)


def test_the_engine_scores_pcaq_keys_in_16_bits_only_if_switched_on(monkeypatch):
    """Off by default (``PCAQ_KEY_INT_SCORING``: its measured KL change is outside 1%); on, exactly where the kernel
    can."""
    from tqbench.kernels.cpu import attention

    gen = torch.Generator().manual_seed(0)
    ks, _ = random_pcaq_side(1, 2, 8, 128, 6, torch.float32, gen)
    a, _ = kernel_side(ks, [], 0, 128, torch.float32)
    assert attention.PCAQ_KEY_INT_SCORING is False
    assert key_scoring(a, torch.float32) is False and a.score_int16 is False
    monkeypatch.setattr(attention, "PCAQ_KEY_INT_SCORING", True)
    assert key_scoring(a, torch.float32) is bool(kernel_rules()["score_int16_pcaq"])
    assert a.score_int16 is bool(kernel_rules()["score_int16_pcaq"]) and a.score_int8 is False


@needs_int16
def test_the_call_counts_the_plan_and_the_integer_query_in_its_workspace():
    q, ks, v, dims = _case(128, 6, True, seed=4)
    b, h, g, d = dims
    ws = {}
    for on in (False, True):
        a, _ = kernel_side(ks, [], 0, d, torch.float32)
        c, _ = kernel_side(None, [v], 0, d, torch.float32)
        a.score_int16 = on
        ws[on] = native_attention_batch(q, [a], [c], SCALE)[1].workspace_bytes
    query = 2 * (b * h * g * d) * 2 + b * h * g * 4  # hi and lo int16 parts, one float step per query row
    chunks = h * (d // 64)
    plan = chunks * (4 * 64 + 256 + 8)  # per chunk: its four 64-byte vectors, at least one window and its lanes
    assert ws[True] - ws[False] >= query + plan
