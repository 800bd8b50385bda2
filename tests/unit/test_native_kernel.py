"""The native CPU kernel of the fused mode against exact attention over decoded rows, and in the model.

Every case builds a layer's store by hand (dense rows before, a packed run, dense rows after) and compares the
kernel with float64 attention over the rows the codec decodes to; a perturbation test shows the check fails
when one code differs.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys

import pytest
import torch

from tqbench.engine.codecs import codec_from_spec
from tqbench.kernels.reference import PackedSide

if shutil.which("c++") is None:  # pragma: no cover - CI and this machine have g++
    pytest.skip("no C++ compiler: the native kernel cannot build here", allow_module_level=True)

from tqbench.kernels.cpu import native_status  # noqa: E402
from tqbench.kernels.cpu.attention import native_attention, simd_order  # noqa: E402

TOL = {torch.float32: 3e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module", autouse=True)
def built():
    ok, why = native_status()
    assert ok, f"the native kernel must build on this machine: {why}"


def _packed(spec: str, role: str, x: torch.Tensor, dt):
    """(PackedSide, decoded rows in float64) for rows ``x`` under codec ``spec``."""
    turbo = spec.startswith("turbo")
    kw = {"center": role == "k"} if turbo else {}
    if spec.startswith("int") and role == "k":
        kw["kblock"] = 4
    codec = codec_from_spec(spec, role=role, **kw)
    state = codec.calibrate(x)
    enc = codec.encode(x, state)
    n, d = x.shape[2], x.shape[-1]
    if turbo:
        side = PackedSide("turbo", codec.bits, enc, n, d, levels=codec.codebook_tensor(dtype=dt, head_dim=d),
                          rotation=codec.rotation_tensor(dtype=dt, head_dim=d), mu=state.get("mu"))
    elif role == "k":
        side = PackedSide("affine-channel", codec.bits, enc, n, d, group=codec.block)
    else:
        side = PackedSide("affine-token", codec.bits, enc, n, d, group=codec.group)
    return side, codec.decode(enc, state, torch.float64)


def _exact(q, k_rows, v_rows, mask, scale, softcap=None, sinks=None):
    """float64 attention of q [B, Hq, L, D] over rows [B, Hkv, T, D] in token order."""
    b, hq, seq, _ = q.shape
    g = hq // k_rows.shape[1]
    k = k_rows.repeat_interleave(g, 1)
    v = v_rows.repeat_interleave(g, 1)
    s = (q.double() * scale) @ k.transpose(-1, -2)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    total = k.shape[2]
    if mask is None:
        mask = torch.ones(seq, total, dtype=torch.bool).tril(total - seq)[None].expand(b, seq, total)
    s = s.masked_fill(~mask[:, None], float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(1, hq, 1, 1).expand(b, hq, seq, 1)], dim=-1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    if sinks is not None:
        p = p[..., :-1]
    return p @ v


def _case(k_spec, v_spec, *, b=1, hkv=3, g=3, seq=1, d=64, before=4, packed=72, after=9, dt=torch.float32,
          pad=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = before + packed + after
    k = torch.randn(b, hkv, total, d, generator=gen, dtype=torch.float64) + 0.2
    v = torch.randn(b, hkv, total, d, generator=gen, dtype=torch.float64)
    q = torch.randn(b, hkv * g, seq, d, generator=gen, dtype=torch.float64)
    cdt = torch.float64 if dt == torch.float64 else torch.float32
    ks, k_dec = _packed(k_spec, "k", k[:, :, before:before + packed].to(cdt), cdt)
    vs, v_dec = _packed(v_spec, "v", v[:, :, before:before + packed].to(cdt), cdt)
    k_rows = torch.cat([k[:, :, :before], k_dec, k[:, :, before + packed:]], 2)
    v_rows = torch.cat([v[:, :, :before], v_dec, v[:, :, before + packed:]], 2)
    mask = None
    if pad:  # left padding of the later sequences + causal over the call's rows
        mask = torch.ones(seq, total, dtype=torch.bool).tril(total - seq)[None].repeat(b, 1, 1)
        for i in range(1, b):
            mask[i, :, : 3 * i] = False
    dense = lambda x: torch.cat([x[:, :, :before], x[:, :, before + packed:]], 2).to(cdt)  # noqa: E731
    return q.to(dt), ks, vs, dense(k), dense(v), k_rows, v_rows, mask, before


@pytest.mark.parametrize("k_spec,v_spec", [("turbo4", "turbo4"), ("turbo3", "turbo2"), ("turbo2", "turbo3"),
                                           ("turbo1", "turbo4"), ("int8", "int4"), ("int4", "int2"),
                                           ("int2", "int8"), ("turbo4", "int4")])
@pytest.mark.parametrize("dt", [torch.float32, torch.float64])
def test_every_width_matches_exact_attention_over_decoded_rows(k_spec, v_spec, dt):
    q, ks, vs, kd, vd, k_rows, v_rows, mask, nb = _case(k_spec, v_spec, dt=dt)
    out, call = native_attention(q, ks, vs, kd, vd, nb, nb, mask, 0.125)
    ref = _exact(q, k_rows, v_rows, mask, 0.125)
    torch.testing.assert_close(out.double(), ref, atol=TOL[dt], rtol=TOL[dt])
    assert call.skipped_rows == 0 and call.weighted_rows == 3 * k_rows.shape[2]


@pytest.mark.parametrize("d", [64, 128, 48, 80])
@pytest.mark.parametrize("g", [1, 3, 8])
def test_head_dims_and_gqa(d, g):
    q, ks, vs, kd, vd, k_rows, v_rows, mask, nb = _case("turbo4", "turbo3", d=d, g=g, hkv=2, seed=d + g)
    out, _ = native_attention(q, ks, vs, kd, vd, nb, nb, mask, d ** -0.5)
    torch.testing.assert_close(out.double(), _exact(q, k_rows, v_rows, mask, d ** -0.5), atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("seq", [1, 5])
@pytest.mark.parametrize("k_spec,v_spec", [("turbo4", "turbo4"), ("int4", "int4")])
def test_batch_with_left_padding_and_multi_token_calls(seq, k_spec, v_spec):
    q, ks, vs, kd, vd, k_rows, v_rows, mask, nb = _case(k_spec, v_spec, b=3, seq=seq, pad=True, seed=seq)
    out, _ = native_attention(q, ks, vs, kd, vd, nb, nb, mask, 0.125)
    torch.testing.assert_close(out.double(), _exact(q, k_rows, v_rows, mask, 0.125), atol=3e-5, rtol=3e-5)
    # no mask: causal over the last `seq` tokens
    out, _ = native_attention(q[:1], _slice(ks), _slice(vs), kd[:1], vd[:1], nb, nb, None, 0.125)
    torch.testing.assert_close(out.double(), _exact(q[:1], k_rows[:1], v_rows[:1], None, 0.125), atol=3e-5, rtol=3e-5)


def _slice(side: PackedSide) -> PackedSide:
    """The first sequence of a packed side."""
    return PackedSide(side.kind, side.bits, {n: t[:1] for n, t in side.payload.items()}, side.n_tokens,
                      side.head_dim, group=side.group, levels=side.levels, rotation=side.rotation,
                      mu=None if side.mu is None else side.mu[:1])


def test_bf16_activations():
    q, ks, vs, kd, vd, k_rows, v_rows, mask, nb = _case("turbo4", "turbo4", dt=torch.bfloat16)
    out, _ = native_attention(q, ks, vs, kd.bfloat16(), vd.bfloat16(), nb, nb, mask, 0.125)
    assert out.dtype == torch.bfloat16
    ref = _exact(q, k_rows, v_rows, mask, 0.125)  # q is already bf16-rounded: only the output rounding differs
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_softcap_and_sink_logits():
    q, ks, vs, kd, vd, k_rows, v_rows, mask, nb = _case("turbo4", "turbo3", g=2, seed=7)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5, -0.5])
    out, _ = native_attention(q * 4, ks, vs, kd, vd, nb, nb, mask, 0.125, softcap=3.0, sinks=sinks)
    ref = _exact(q * 4, k_rows, v_rows, mask, 0.125, softcap=3.0, sinks=sinks)
    torch.testing.assert_close(out.double(), ref, atol=3e-5, rtol=3e-5)
    plain = _exact(q * 4, k_rows, v_rows, mask, 0.125)
    assert (plain - ref).abs().max() > 1e-2  # both features change the result: the test can see them


def test_different_k_and_v_packed_ranges_and_head_dims():
    """KIVI keys pack whole blocks (fewer packed K rows than V rows); V may have its own head dim."""
    gen = torch.Generator().manual_seed(11)
    b, hkv, total, d, dv = 1, 2, 41, 64, 32
    k = torch.randn(b, hkv, total, d, generator=gen)
    v = torch.randn(b, hkv, total, dv, generator=gen)
    q = torch.randn(b, hkv * 2, 1, d, generator=gen)
    ks, k_dec = _packed("int4", "k", k[:, :, 2:34], torch.float32)  # 32 rows: 8 blocks of 4
    vs, v_dec = _packed("turbo4", "v", v[:, :, 2:37], torch.float32)  # 35 rows
    k_rows = torch.cat([k[:, :, :2].double(), k_dec, k[:, :, 34:].double()], 2)
    v_rows = torch.cat([v[:, :, :2].double(), v_dec, v[:, :, 37:].double()], 2)
    kd = torch.cat([k[:, :, :2], k[:, :, 34:]], 2)
    vd = torch.cat([v[:, :, :2], v[:, :, 37:]], 2)
    out, _ = native_attention(q, ks, vs, kd, vd, 2, 2, None, 0.125)
    assert out.shape == (b, hkv * 2, 1, dv)
    torch.testing.assert_close(out.double(), _exact(q, k_rows, v_rows, None, 0.125), atol=3e-5, rtol=3e-5)


def test_one_wrong_code_fails_the_check():
    """The comparison is sharp enough to see a kernel that reads one code of one row wrong (K or V side)."""
    q, ks, vs, kd, vd, k_rows, v_rows, mask, nb = _case("turbo4", "turbo4", seed=3)
    ref = _exact(q, k_rows, v_rows, mask, 0.125)
    for which in ("k", "v"):
        side = ks if which == "k" else vs
        bad = dict(side.payload)
        bad["idx"] = bad["idx"].clone()
        bad["idx"][0, 1, 10, 3] ^= 0x11  # two codes of one row of head 1
        wrong = PackedSide(side.kind, side.bits, bad, side.n_tokens, side.head_dim, levels=side.levels,
                           rotation=side.rotation, mu=side.mu)
        args = (wrong, vs) if which == "k" else (ks, wrong)
        out, _ = native_attention(q, *args, kd, vd, nb, nb, mask, 0.125)
        with pytest.raises(AssertionError):
            torch.testing.assert_close(out.double(), ref, atol=3e-5, rtol=3e-5)
        good, _ = native_attention(q, ks, vs, kd, vd, nb, nb, mask, 0.125)
        torch.testing.assert_close(good.double(), ref, atol=3e-5, rtol=3e-5)


def test_sparse_v_skips_light_rows_within_its_bound():
    q, ks, vs, kd, vd, k_rows, v_rows, mask, nb = _case("turbo4", "turbo4", packed=600, seed=5)
    q = q * 6  # peaked attention: most rows weigh little
    exact = _exact(q, k_rows, v_rows, mask, 0.125)
    thr = 1e-3
    out, call = native_attention(q, ks, vs, kd, vd, nb, nb, mask, 0.125, sparse_v=thr)
    total = k_rows.shape[2]
    assert call.weighted_rows == 3 * total and 0 < call.skipped_rows < call.weighted_rows
    # every skipped row weighs < thr for every query, so the error is below thr * rows * max|v|
    bound = thr * call.skipped_rows * v_rows.abs().max().item()
    assert (out.double() - exact).abs().max().item() <= bound
    off, call0 = native_attention(q, ks, vs, kd, vd, nb, nb, mask, 0.125)
    assert call0.skipped_rows == 0 and (off.double() - exact).abs().max() < 3e-5


def test_simd_order_is_a_permutation():
    for bits in (1, 2, 3, 4):
        for d in (64, 128):
            assert sorted(simd_order(bits, d).tolist()) == list(range(d))
    assert simd_order(1, 64).tolist() == list(range(64))
    with pytest.raises(ValueError, match="no SIMD order for 5-bit codes"):
        simd_order(5, 64)


# -- in the model -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["turbo4", "k=turbo3,v=turbo2,sink=2,recent=4",
                                    "k=int8,v=int4,sink=2,recent=4,group=8,kblock=8"])
def test_fused_mode_runs_native_with_the_same_greedy_tokens_as_compressed_in_float64(tiny_engine64, policy):
    ids = torch.randint(5, 200, (1, 40), generator=torch.Generator().manual_seed(2))
    runs = {m: tiny_engine64.generate(ids, policy, m, max_new_tokens=10, stop_at_eos=False)
            for m in ("compressed", "fused")}
    assert runs["fused"].token_ids == runs["compressed"].token_ids
    rep = runs["fused"].cache_report
    assert rep.fused_impl == {"native-cpu": rep.fused_calls} and rep.fused_calls > 0 and rep.fallbacks == {}
    assert any(n.startswith("fused: native-cpu") for n in rep.notes), rep.notes
    # resident = packed store + the kernel's transient workspace (partials + the call's full-precision rows)
    assert rep.compressed_storage_bytes < rep.resident_decode_bytes < rep.compressed_storage_bytes + 64 * 1024


def test_fused_native_logits_match_the_torch_reference(tiny_engine, monkeypatch):
    model = tiny_engine.model
    ids = torch.randint(5, 200, (2, 56), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    logits = {}
    for impl in ("torch", "native"):
        monkeypatch.setenv("TQBENCH_FUSED_IMPL", impl)
        cache = tiny_engine.make_cache("turbo4", "fused")
        with torch.inference_mode():
            model(input_ids=ids[:, :48], attention_mask=mask[:, :48], cache=cache)
            logits[impl] = model(input_ids=ids[:, 48:], attention_mask=mask, cache=cache).logits
        assert set(cache.report().fused_impl) == {"native-cpu" if impl == "native" else
                                                  "torch-reference (TQBENCH_FUSED_IMPL=torch)"}
    torch.testing.assert_close(logits["native"], logits["torch"], atol=1e-4, rtol=1e-4)


def test_sparse_v_policy_reports_its_skipped_share(tiny_engine):
    ids = torch.randint(5, 200, (1, 60), generator=torch.Generator().manual_seed(4))
    r = tiny_engine.generate(ids, "turbo4,sparsev=0.01", "fused", max_new_tokens=6, stop_at_eos=False)
    sv = r.cache_report.sparse_v
    assert sv["threshold"] == 0.01 and sv["weighted_rows"] > 0 and 0 < sv["skipped_rows"] <= sv["weighted_rows"]
    assert math.isclose(sv["skipped_share"], round(sv["skipped_rows"] / sv["weighted_rows"], 4))
    assert any(n.startswith("sparse-V (threshold 0.01): skipped") for n in r.cache_report.notes)
    assert r.cache_report.to_dict()["sparse_v"] == sv
    plain = tiny_engine.generate(ids, "turbo4", "fused", max_new_tokens=6, stop_at_eos=False)
    assert plain.cache_report.sparse_v is None


def test_sparse_v_bad_threshold_is_refused():
    from tqbench.engine.policy.files import parse_policy

    with pytest.raises(ValueError, match=r"sparsev=1.5 is invalid: use a softmax-weight threshold in \[0, 1\)"):
        parse_policy("turbo4,sparsev=1.5")
    with pytest.raises(ValueError, match="sparsev must be a number such as 0.001"):
        parse_policy("turbo4,sparsev=lots")
    assert parse_policy("turbo4,sparsev=0.001").to_string().endswith("sparsev=0.001")


def test_additive_bias_runs_the_reference_and_says_so(tiny_engine):
    """A float mask with values other than 0 / -inf (an attention bias) is not a mask the kernel takes."""
    from tqbench.engine.cache.fused.masks import bool_mask

    m = torch.zeros(1, 1, 1, 5)
    m[..., 2] = -0.5
    assert bool_mask(m, 1, 5) == "an additive attention bias (not a 0/-inf mask)"
    m[..., 2] = torch.finfo(torch.float32).min
    assert bool_mask(m, 1, 5).tolist() == [[[True, True, False, True, True]]]


@pytest.fixture(scope="module")
def disabled_native_reports():
    """One fresh process with ``TQBENCH_NATIVE=0`` (a process builds or loads the kernel once: the switch needs its
    own): a fused run's ``fused_impl`` and a compressed run's quantize-and-pack notes, as JSON."""
    import json
    import os

    code = ("import json, torch; from tqbench.engine.engine import Engine; e = Engine.tiny(); "
            "f = e.generate(torch.randint(5, 200, (1, 30)), 'turbo4', 'fused', max_new_tokens=3, stop_at_eos=False); "
            "c = e.generate(torch.randint(5, 200, (1, 40)), 'turbo4', 'compressed', max_new_tokens=3, "
            "stop_at_eos=False); print(json.dumps({'fused_impl': list(f.cache_report.fused_impl), "
            "'append_notes': [n for n in c.cache_report.notes if n.startswith('quantize-and-pack')]}))")
    env = dict(os.environ, TQBENCH_NATIVE="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_disabled_native_kernel_says_why_in_the_report(disabled_native_reports):
    assert disabled_native_reports["fused_impl"] == ["torch-reference (TQBENCH_NATIVE=0)"]


def test_disabled_native_append_path_says_so_in_the_report(disabled_native_reports):
    assert disabled_native_reports["append_notes"] == [
        "quantize-and-pack ran in torch (the native CPU kernel is unavailable: TQBENCH_NATIVE=0)"]


def test_the_build_runs_the_instruction_set_asked_for():
    """``TQBENCH_NATIVE_ISA`` picks the build (the AVX2 test below runs this file under it)."""
    import os

    from tqbench.kernels.cpu.attention import kernel_rules

    want = os.environ.get("TQBENCH_NATIVE_ISA", "")
    flags = open("/proc/cpuinfo").read()
    isa = kernel_rules()["isa"]
    if want:
        assert isa == want
    elif " avx512bw" in flags and " avx512vl" in flags:
        assert isa.startswith("avx512") and (isa == "avx512+vbmi") == (" avx512vbmi" in flags)


def test_forced_avx2_build_matches_float64_attention_like_the_default_build():
    """The AVX2 build (no AVX-512: what CPUs without it run) passes this file's kernel-vs-float64 tests."""
    import os

    if " avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU has no AVX2")
    env = dict(os.environ, TQBENCH_NATIVE_ISA="avx2")
    cases = ("every_width or head_dims or padding or bf16 or softcap or different_k or one_wrong_code or sparse_v_skips "
             "or simd_order or instruction_set")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", cases],
                         capture_output=True, text=True, timeout=1500, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    import re

    passed = re.search(r"(\d+) passed", out.stdout)
    assert passed and int(passed.group(1)) >= 39 and " skipped" not in out.stdout, out.stdout[-500:]
