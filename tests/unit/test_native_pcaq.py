"""Calibrated (``pcaq``) keys and per-head layers in the native CPU kernel, against attention over decoded rows.

``pcaq`` rows: a width per coordinate (0..6 bits, every head's row the same bytes), levels per coordinate, one
transform per head; scored from their codes with the query transformed once. Per-head layers: a store described
by one side per group of heads (each naming its heads), all groups in one call.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.unit.pcaq_helpers import random_pcaq_side as _pcaq
from tqbench.kernels.packing import pack_widths
from tqbench.kernels.reference import dequantize_side, packed_scores

if shutil.which("c++") is None:  # pragma: no cover - CI and this machine have g++
    pytest.skip("no C++ compiler: the native kernel cannot build here", allow_module_level=True)

from tests.unit.test_native_kernel import _exact, _packed  # noqa: E402
from tqbench.kernels.cpu import native_status  # noqa: E402
from tqbench.kernels.cpu.attention import kernel_side, native_attention, native_attention_batch  # noqa: E402

TOL = {torch.float32: 3e-5, torch.float64: 1e-12}


@pytest.fixture(scope="module", autouse=True)
def built():
    ok, why = native_status()
    assert ok, f"the native kernel must build on this machine: {why}"


@pytest.mark.parametrize("d,maxw", [(64, 6), (48, 3), (80, 4), (128, 2), (16, 1)])
@pytest.mark.parametrize("dt", [torch.float32, torch.float64])
def test_pcaq_keys_match_attention_over_their_decoded_rows(d, maxw, dt):
    gen = torch.Generator().manual_seed(d + maxw)
    b, h, g, before, n, after = 2, 3, 3, 3, 37, 5
    ks, k_dec = _pcaq(b, h, n, d, maxw, dt, gen)
    k_dense = torch.randn(b, h, before + after, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, h, before + n + after, d, generator=gen, dtype=torch.float64)
    q = torch.randn(b, h * g, 1, d, generator=gen, dtype=torch.float64)
    k_rows = torch.cat([k_dense[:, :, :before], k_dec, k_dense[:, :, before:]], 2)
    mask = torch.ones(b, 1, before + n + after, dtype=torch.bool)
    mask[1, :, :4] = False  # left padding of the second sequence
    out, call = native_attention(q.to(dt), ks, None, k_dense.to(dt), v.to(dt), before, 0, mask, d ** -0.5)
    ref = _exact(q, k_rows, v, mask, d ** -0.5)
    torch.testing.assert_close(out.double(), ref, atol=TOL[dt], rtol=TOL[dt])
    # the torch reference scores the same codes the same way
    s = packed_scores(q.double().view(b, h, g, d) * d ** -0.5, ks)
    torch.testing.assert_close(s, (q.double().view(b, h, g, d) * d ** -0.5) @ k_dec.transpose(-1, -2),
                               atol=TOL[dt], rtol=TOL[dt])
    assert call.weighted_rows > 0


def test_pcaq_reference_rows_are_the_codecs_rows():
    """The reference's decode of a pcaq side is the transformed-domain value of every code."""
    gen = torch.Generator().manual_seed(5)
    ks, k_dec = _pcaq(1, 2, 9, 32, 4, torch.float64, gen, centred=False)
    z = dequantize_side(ks, torch.float64)
    torch.testing.assert_close(torch.einsum("bhnj,hjd->bhnd", z, ks.rotation), k_dec, atol=1e-12, rtol=0)


def test_one_wrong_pcaq_code_fails_the_check():
    gen = torch.Generator().manual_seed(9)
    ks, k_dec = _pcaq(1, 2, 20, 64, 3, torch.float32, gen)
    v = torch.randn(1, 2, 20, 64, generator=gen)
    q = torch.randn(1, 4, 1, 64, generator=gen) * 4
    ref = _exact(q, k_dec, v.double(), None, 0.125)
    ks.payload["idx"][0, 1, 7, 2] ^= 0x10
    out, _ = native_attention(q, ks, None, torch.empty(1, 2, 0, 64), v, 0, 0, None, 0.125)
    assert (out.double() - ref).abs().max() > 1e-4


def _group_side(spec_or_pcaq, role, x, dt, gen):
    if spec_or_pcaq == "pcaq":
        return _pcaq(x.shape[0], x.shape[1], x.shape[2], x.shape[3], 4, dt, gen)
    return _packed(spec_or_pcaq, role, x.to(dt), dt)


GROUPINGS = {
    "turbo+pcaq": [((0, 2), "turbo4", "turbo2"), ((1,), "pcaq", "turbo3")],
    "pcaq+int+dense": [((2,), "pcaq", "int4"), ((0,), "int4", "turbo4"), ((1,), "fp16", "fp16")],
    "one group": [((0, 1, 2), "pcaq", "turbo2")],
}


@pytest.mark.parametrize("dt", [torch.float32, torch.float64])
@pytest.mark.parametrize("names", [("turbo+pcaq", "turbo+pcaq"), ("pcaq+int+dense", "pcaq+int+dense"),
                                   ("turbo+pcaq", "pcaq+int+dense"), ("one group", "turbo+pcaq")])
def test_a_per_head_store_is_one_call_with_a_side_per_group(dt, names):
    """Heads with different codecs (turbo, pcaq, affine, dense) in one store, one call: each KV head's output is
    attention over its own decoded rows, for two ragged sequences of different lengths (each its own grouping)."""
    gen = torch.Generator().manual_seed(len(names[0]))
    h, g, d, before, after = 3, 2, 64, 2, 4
    lengths = [28, 52]  # (KIVI keys pack whole blocks of 4)
    qs, refs, k_sides, v_sides = [], [], [], []
    for n, name in zip(lengths, names):
        groups = GROUPINGS[name]
        q = torch.randn(1, h * g, 1, d, generator=gen, dtype=torch.float64)
        k_rows = torch.zeros(1, h, before + n + after, d, dtype=torch.float64)
        v_rows = torch.zeros_like(k_rows)
        for heads, kspec, vspec in groups:
            nh = len(heads)
            kx = torch.randn(1, nh, before + n + after, d, generator=gen, dtype=torch.float64)
            vx = torch.randn(1, nh, before + n + after, d, generator=gen, dtype=torch.float64)
            sides = []
            for spec, role, x, rows in ((kspec, "k", kx, k_rows), (vspec, "v", vx, v_rows)):
                mid = x[:, :, before:before + n]
                dense = [x[:, :, :before].to(dt), x[:, :, before + n:].to(dt)]
                if spec == "fp16":
                    side, _ = kernel_side(None, [x.to(dt)], 0, d, dt)
                    rows[:, list(heads)] = x
                else:
                    packed, dec = _group_side(spec, role, mid, dt, gen)
                    side, _ = kernel_side(packed, dense, before, d, dt)
                    rows[:, list(heads)] = torch.cat([x[:, :, :before], dec, x[:, :, before + n:]], 2)
                side.heads = list(heads)
                side.kv_heads = h
                sides.append(side)
            k_sides.append(sides[0])
            v_sides.append(sides[1])
        qs.append(q)
        refs.append(_exact(q, k_rows, v_rows, None, 0.125))
    out, call = native_attention_batch(torch.cat(qs).to(dt), k_sides, v_sides, 0.125)
    torch.testing.assert_close(out.double(), torch.cat(refs), atol=TOL[dt], rtol=TOL[dt])
    assert call.weighted_per_sequence == tuple(h * (before + n + after) for n in lengths)


def test_groups_of_heads_are_checked_by_name():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 1, 6, 32, generator=gen)
    q = torch.randn(1, 4, 1, 32, generator=gen)

    def group(heads, kv_heads=2):
        side = kernel_side(None, [x], 0, 32, torch.float32)[0]
        side.heads, side.kv_heads = heads, kv_heads
        return side

    ok = native_attention_batch(q, [group([0]), group([1])], [group([0]), group([1])], 0.1)[0]
    assert ok.shape == (1, 4, 1, 32)
    cases = [
        (([group([0]), group([0])], [group([0]), group([0])]), r"k_sides\[1\]\.heads names kv head 0, which k_sides\[0\] of the same store already holds"),
        (([group([0])], [group([0])]), r"k_sides\[0\.\.0\] hold 1 of their store's 2 kv heads"),
        (([group([0]), group([2])], [group([0]), group([2])]), r"k_sides\[1\]\.heads names kv head 2, outside 0\.\.1"),
        (([group([0]), group([1])], [group([0]), group([0])]), r"v_sides\[1\] holds other heads than k_sides\[1\]"),
        (([group([0]), group([1], 3)], [group([0]), group([1], 3)]), r"k_sides\[1\]\.kv_heads is 3, the call's stores have 2 kv heads"),
    ]
    for (ks, vs), msg in cases:
        with pytest.raises(RuntimeError, match=msg):
            native_attention_batch(q, ks, vs, 0.1)


def test_pcaq_is_refused_for_values_and_without_its_widths():
    gen = torch.Generator().manual_seed(2)
    ks, _ = _pcaq(1, 2, 8, 32, 3, torch.float32, gen)
    q = torch.randn(1, 2, 1, 32, generator=gen)
    empty = torch.empty(1, 2, 0, 32)
    with pytest.raises(RuntimeError, match=r"v_sides\[0\]: pcaq is a key codec"):
        native_attention(q, ks, ks, empty, empty, 0, 0, None, 0.1)
    side = kernel_side(ks, [empty], 0, 32, torch.float32)[0]
    side.widths = None
    dense_v = kernel_side(None, [torch.randn(1, 2, 8, 32)], 0, 32, torch.float32)[0]
    with pytest.raises(RuntimeError, match=r"k_sides\[0\]\.widths \(bits per coordinate"):
        native_attention_batch(q, [side], [dense_v], 0.1)


KERNEL_CASES = "pcaq_keys_match or wrong_pcaq or per_head_store or checked_by_name or refused or encode_checks"


def test_forced_avx2_build_runs_the_pcaq_and_per_head_cases():
    """The AVX2 build (its own gather decode of pcaq rows) passes this file's kernel-level tests."""
    import os
    import subprocess
    import sys

    if " avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU has no AVX2")
    env = dict(os.environ, TQBENCH_NATIVE_ISA="avx2")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", KERNEL_CASES],
                         capture_output=True, text=True, timeout=1500, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    import re

    passed = re.search(r"(\d+) passed", out.stdout)
    assert passed and int(passed.group(1)) >= 22 and " skipped" not in out.stdout, out.stdout[-500:]


# -- in the model: calibrated keys and per-head layers, float64, identical tokens ----------------------------------
@pytest.fixture(scope="module")
def fit_path(tiny_engine, tmp_path_factory):
    from tqbench.engine.calibrate import fit_transforms
    from tqbench.engine.codecs.transforms_file import save_transforms

    tr = fit_transforms(tiny_engine, ["prose", "code"], max_tokens=96)
    return str(save_transforms(tr, tmp_path_factory.mktemp("fit") / "tiny.safetensors"))


@pytest.mark.parametrize("policy", [
    "k=pcaq2.5,v=turbo2,sink=2,recent=3",  # every layer calibrated
    "k=pcaq2|turbo3,v=turbo2|turbo1,sink=2,recent=3",  # per-head: calibrated head 0, turbo head 1
    "k=turbo1|pcaq3,v=turbo2,recent=2,k@1=pcaq2|int4",  # per-head with KIVI keys on one layer
])
def test_fused_native_gives_the_reference_tokens_with_no_reference_call(tiny_engine64, fit_path, monkeypatch, policy):
    policy = f"{policy},calib={fit_path}"
    ids = torch.randint(5, 200, (1, 40), generator=torch.Generator().manual_seed(2))
    monkeypatch.setenv("TQBENCH_FUSED_IMPL", "torch")
    ref = tiny_engine64.generate(ids, policy, "fused", max_new_tokens=12, stop_at_eos=False)
    compressed = tiny_engine64.generate(ids, policy, "compressed", max_new_tokens=12, stop_at_eos=False)
    monkeypatch.setenv("TQBENCH_FUSED_IMPL", "native")
    got = tiny_engine64.generate(ids, policy, "fused", max_new_tokens=12, stop_at_eos=False)
    assert got.token_ids == ref.token_ids == compressed.token_ids
    rep = got.cache_report
    # one native call per layer call (per-head layers included), not one torch-reference call
    assert rep.fused_impl == {"native-cpu": rep.fused_calls} and rep.fused_calls > 0
    assert rep.fallbacks == {}
    assert all(set(ran) == {"native-cpu"} for ran in rep.fused_groups.values())
    assert bool(rep.fused_groups) == ("|" in policy)  # a per-head policy's groups are named, each ran natively


def test_pcaq_encode_checks_its_arguments_by_name():
    from tqbench.kernels.cpu import native_module

    mod = native_module()
    x = torch.randn(1, 2, 3, 16, dtype=torch.float64)
    E = torch.eye(16, dtype=torch.float64).expand(2, 16, 16).contiguous()
    bounds = torch.full((2, 16, 3), float("inf"), dtype=torch.float64)
    bounds[..., 0] = 0.0
    widths = torch.ones(2, 16, dtype=torch.uint8)
    codes = mod.pcaq_encode(x, E, bounds, widths)  # 1 bit per coordinate: the sign
    assert codes.shape == (1, 2, 3, 2)
    want = torch.stack([pack_widths((x[:, h] > 0).long(), widths[h].long()) for h in range(2)], 1)
    assert torch.equal(codes, want)
    uneven = widths.clone()
    uneven[1, 0] = 2
    with pytest.raises(RuntimeError, match="widths: head 1 packs 17 bits per row, head 0 packs 16"):
        mod.pcaq_encode(x, E, bounds, uneven)
    with pytest.raises(RuntimeError, match=r"transform must have shape \[2, 16, 16\]"):
        mod.pcaq_encode(x, E[:, :15], bounds, widths)
    with pytest.raises(RuntimeError, match=r"widths must be a contiguous CPU uint8 \[2, 16\] tensor"):
        mod.pcaq_encode(x, E, bounds, widths.long())
