"""The fused cache mode's torch implementation (the CPU path): packed reads, plain generate(), reporting."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tqbench.engine.cache.fused import choose_impl
from tqbench.engine.codecs import codec_from_spec
from tqbench.kernels.reference import (
    PackedSide,
    decode_codes,
    dense_partials,
    merge_partials,
    packed_attention_partials,
    packed_scores,
    packed_values,
    turbo_quantize_pack,
)

PROMPT = "the quick brown fox jumps over the lazy dog and keeps running far away " * 2


def _side(spec, role, x, dt):
    codec = codec_from_spec(spec, role=role, center=spec.startswith("turbo") and role == "k")
    state = codec.calibrate(x)
    enc = codec.encode(x, state)
    d = x.shape[-1]
    if spec.startswith("turbo"):
        side = PackedSide("turbo", codec.bits, enc, x.shape[2], d, levels=codec.codebook_tensor(dtype=dt, head_dim=d),
                          rotation=codec.rotation_tensor(dtype=dt, head_dim=d), mu=state.get("mu"))
    elif role == "k":
        side = PackedSide("affine-channel", codec.bits, enc, x.shape[2], d, group=codec.block)
    else:
        side = PackedSide("affine-token", codec.bits, enc, x.shape[2], d, group=codec.group)
    return side, codec.decode(enc, state, dt)


@pytest.mark.parametrize("dt", [torch.float32, torch.float64])
@pytest.mark.parametrize("spec,role", [("turbo1", "k"), ("turbo2", "v"), ("turbo3", "k"), ("turbo4", "k"),
                                       ("turbo4", "v"), ("int8", "k"), ("int4", "k"), ("int2", "k"),
                                       ("int8", "v"), ("int4", "v"), ("int2", "v")])
def test_packed_scores_and_values_equal_attention_over_decoded_rows(spec, role, dt):
    """Every byte-table layout (1/2/4-bit rows of 8, 16, 32 bytes; 3-bit unpack) against codec.decode."""
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(3), dtype=dt) + 0.3
    side, dense = _side(spec, role, x, dt)
    q = torch.randn(2, 3, 4, 64, dtype=dt)
    p = torch.softmax(torch.randn(2, 3, 4, 64, dtype=dt), -1)
    tol = 1e-12 if dt == torch.float64 else 2e-5
    torch.testing.assert_close(packed_scores(q, side), q @ dense.transpose(-1, -2), atol=tol, rtol=tol)
    torch.testing.assert_close(packed_values(p, side), p @ dense, atol=tol, rtol=tol)


def test_decode_codes_matches_levels_of_unpacked_indices():
    from tqbench.kernels.packing import pack_bits

    for bits in (1, 2, 3, 4, 8):
        idx = torch.randint(0, 1 << bits, (2, 5, 24), dtype=torch.uint8)
        levels = torch.randn(1 << bits, dtype=torch.float64)
        got = decode_codes(pack_bits(idx, bits), bits, 24, levels)
        assert torch.equal(got, levels[idx.long()]), bits


def test_partials_merge_to_full_attention():
    """Split the keys into a packed run and dense rows: merged partials equal one softmax over both."""
    x = torch.randn(1, 2, 40, 64, dtype=torch.float64)
    k_side, k_dense = _side("turbo4", "k", x, torch.float64)
    v_side, v_dense = _side("int4", "v", x * 0.5, torch.float64)
    fk, fv = torch.randn(1, 2, 6, 64, dtype=torch.float64), torch.randn(1, 2, 6, 64, dtype=torch.float64)
    q = torch.randn(1, 6, 1, 64, dtype=torch.float64)
    out, _ = merge_partials([packed_attention_partials(q, k_side, v_side, None, 0.125),
                             dense_partials(q, fk, fv, None, 0.125)])
    want = torch.nn.functional.scaled_dot_product_attention(
        q, torch.cat([k_dense, fk], 2), torch.cat([v_dense, fv], 2), scale=0.125, enable_gqa=True)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)


def test_turbo_quantize_reference_equals_codec_encode():
    codec = codec_from_spec("turbo3", role="k", center=True)
    x = torch.randn(1, 2, 9, 64)
    state = codec.calibrate(x)
    want = codec.encode(x, state)
    got = turbo_quantize_pack(x, state["mu"], codec.rotation_tensor(head_dim=64), codec.codebook_tensor(head_dim=64), 3)
    assert torch.equal(got["idx"], want["idx"]) and torch.equal(got["norm"], want["norm"])


def test_plain_model_generate_uses_the_fused_path(tiny_engine64):
    """model.generate() with a fused cache reads the packed store (calls counted) and gives the tokens of
    the compressed mode (float64), in a batch with left padding too."""
    tok, model = tiny_engine64.tokenizer, tiny_engine64.model
    tok.padding_side = "left"
    batch = tok([PROMPT, "a short one", "another prompt"], return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    outs, reps = {}, {}
    for mode in ("compressed", "fused"):
        cache = tiny_engine64.make_cache("turbo4", mode)
        outs[mode] = model.generate(**batch, cache=cache, **kw).tolist()
        reps[mode] = cache.report()
    assert outs["fused"] == outs["compressed"]
    rep = reps["fused"]
    assert rep.fused_calls > 0 and rep.fallbacks == {}
    assert rep.fused_impl == {"native-cpu": rep.fused_calls}  # the native kernel computes in float64 too
    assert any(n.startswith("fused: native-cpu") for n in rep.notes)


def test_fused_report_says_which_implementation_ran(tiny_engine):
    r = tiny_engine.generate(tiny_engine.encode_prompt(PROMPT, chat=False), "turbo4", "fused", max_new_tokens=4,
                             stop_at_eos=False)
    rep = r.cache_report
    assert rep.fused_impl == {"native-cpu": rep.fused_calls}
    assert rep.to_dict()["fused_impl"] == rep.fused_impl


def test_choose_impl_env(monkeypatch):
    q = torch.zeros(1, 1, 1, 8)
    monkeypatch.setenv("TQBENCH_FUSED_IMPL", "torch")
    assert choose_impl(q) == ("torch-reference", "TQBENCH_FUSED_IMPL=torch")
    monkeypatch.setenv("TQBENCH_FUSED_IMPL", "fast")
    with pytest.raises(ValueError, match="TQBENCH_FUSED_IMPL='fast' is invalid: use auto, torch, native, triton"):
        choose_impl(q)
    monkeypatch.setenv("TQBENCH_FUSED_IMPL", "triton")
    assert choose_impl(q.double())[0] == "torch-reference"
    monkeypatch.setenv("TQBENCH_FUSED_IMPL", "native")
    from tqbench.kernels.cpu.attention import kernel_rules

    isa = kernel_rules()["isa"]  # the build says which instruction set it runs (avx512+vbmi, avx512, avx2, generic)
    assert choose_impl(q) == ("native-cpu", f"native CPU kernel (C++, -march=native, {isa})")


def test_engine_runs_fused_without_triton():
    """With triton unimportable, the engine imports and runs the fused mode on CPU (the native kernel); no
    Triton kernel module is ever imported there (transformers itself may import triton when installed)."""
    code = ("import sys; sys.modules['triton'] = None; import torch; from tqbench.engine.engine import Engine; "
            "from tqbench.kernels import triton_status; print(triton_status()); e = Engine.tiny(); "
            "r = e.generate(torch.randint(5, 200, (1, 30)), 'turbo4', 'fused', max_new_tokens=3, stop_at_eos=False); "
            "print(list(r.cache_report.fused_impl)); "
            "print(sorted(m for m in sys.modules if m.startswith('tqbench.kernels')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:3] == [
        "(False, 'triton is not installed (pip install triton)')",
        "['native-cpu']",
        "['tqbench.kernels', 'tqbench.kernels.cpu', 'tqbench.kernels.cpu.attention', 'tqbench.kernels.layouts', 'tqbench.kernels.packing', "
        "'tqbench.kernels.pidlock', 'tqbench.kernels.reference']",
    ]


def test_attention_benchmark_quick_on_cpu(tmp_path):
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "attention.json"
    cmd = [sys.executable, str(root / "benchmarks" / "attention.py"), "--quick", "--threads", "1", "--device", "cpu",
           "--json", str(out)]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    data = json.loads(out.read_text())
    assert data["impls"] == ["native-cpu", "torch-reference"] and data["copy_bandwidth_gbs"] > 0
    assert {(r["codec"], r["impl"]) for r in data["rows"]} == {
        (c, i) for c in ("turbo4:turbo4", "turbo2:turbo2", "int8:int4") for i in data["impls"]}
    for r in data["rows"]:
        assert r["fused_ms"] > 0 and r["dense_ms"] > 0 and r["packed_bytes"] < r["dense_bytes"]
    turbo4 = next(r for r in data["rows"] if r["codec"] == "turbo4:turbo4")
    # 2 kv heads x 256 rows x (32 code bytes + 2 norm bytes), K and V; dense fp32 K+V
    assert (turbo4["packed_bytes"], turbo4["dense_bytes"]) == (2 * 2 * 256 * 34, 2 * 2 * 256 * 64 * 4)
    assert "fused % copy bw" in proc.stdout


@pytest.mark.parametrize("policy", ["turbo4", "q8k-int4v"])
def test_multi_token_chunk_over_packed_history_matches_compressed(tiny_engine64, policy):
    """A second turn: several new tokens at once over packed history (causal among the new rows)."""
    model = tiny_engine64.model
    ids = torch.randint(5, 200, (1, 60), generator=torch.Generator().manual_seed(4))
    logits = {}
    for mode in ("compressed", "fused"):
        cache = tiny_engine64.make_cache(policy, mode)
        with torch.inference_mode():
            model(input_ids=ids[:, :48], cache=cache)
            logits[mode] = model(input_ids=ids[:, 48:], cache=cache).logits
        if mode == "fused":
            assert cache.report().fused_calls == len(cache.layers)
    torch.testing.assert_close(logits["fused"], logits["compressed"], atol=1e-10, rtol=1e-10)


def test_codecs_and_kernels_share_one_packer():
    """The codecs pack with ``tqbench.kernels.packing`` (the kernels never import the engine): one packer."""
    from tqbench.engine.codecs import affine, turbo
    from tqbench.kernels import packing, reference

    assert turbo.pack_bits is packing.pack_bits and affine.pack_bits is packing.pack_bits
    assert turbo.unpack_bits is packing.unpack_bits and reference.lookup_packed is packing.lookup_packed
