"""The engines' KV formats as codecs: GGML blocks byte for byte against the ``gguf`` package's reference
quantizers, iq4_nl against hand-computed blocks and a scalar transcription of ggml's cache quantizer, fp8 with
static and prefill scales, their bytes in estimates and reports, and the engine names in the policy language."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from tests.unit.cache_helpers import assert_report_matches_estimate
from tqbench.engine.cache import KVGeometry, TQCache
from tqbench.engine.cache.estimate import estimate_kv
from tqbench.engine.codecs import codec_bits_per_element, codec_from_spec, nominal_bits
from tqbench.engine.codecs.ggml import IQ4NL_LEVELS
from tqbench.engine.engine import Engine
from tqbench.engine.policy import parse_policy

GGUF_TYPES = ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0")


def realish_keys(d: int = 64, tokens: int = 37, seed: int = 0) -> torch.Tensor:
    """K-like rows [1, 3, tokens, d]: per-channel offsets and scales (RoPE pairs), a few outlier channels."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(d, generator=g))
    offset = torch.randn(d, generator=g) * 2
    x = torch.randn(1, 3, tokens, d, generator=g) * scale + offset
    x[..., 5] *= 12  # an outlier channel
    x[0, 1, 3, :32] = 0  # an all-zero block
    x[0, 2, 4, :32] = 1e-20  # below GROUP_MAX_EPS
    return x


@pytest.mark.parametrize("kind", GGUF_TYPES)
@pytest.mark.parametrize("d", [32, 64, 128])
def test_ggml_bytes_equal_gguf_reference_quantizer(kind, d):
    x = realish_keys(d, seed=d)
    qtype = getattr(GGMLQuantizationType, kind.upper())
    codec = codec_from_spec(kind, "k")
    enc = codec.encode(x, {})
    ref = quantize(x.numpy(), qtype)
    assert enc["blocks"].dtype == torch.uint8 and enc["blocks"].shape == (1, 3, 37, ref.shape[-1])
    assert np.array_equal(enc["blocks"].numpy(), ref)
    dec = codec.decode(enc, {}, torch.float32)
    assert np.array_equal(dec.numpy(), dequantize(ref, qtype))  # ggml's dequantize, value for value
    assert enc["blocks"][0, 0].numel() == 37 * codec.unit_bytes(d)


def test_ggml_bits_per_element_count_the_scales():
    assert {k: codec_bits_per_element(k, 64) for k in (*GGUF_TYPES, "iq4_nl")} == {
        "q8_0": 8.5, "q5_1": 6.0, "q5_0": 5.5, "q4_1": 5.0, "q4_0": 4.5, "iq4_nl": 4.5}
    assert codec_from_spec("q4_0").unit_bytes(128) == 4 * 18
    assert [nominal_bits(k) for k in ("q8_0", "q5_1", "q4_0", "iq4_nl", "fp8_e5m2")] == [8, 5, 4, 4, 8]


def test_ggml_head_dim_not_a_multiple_of_32_is_refused():
    with pytest.raises(ValueError, match="head_dim 48 is not a multiple of GGML's block of 32"):
        codec_from_spec("q4_0").encode(torch.randn(1, 1, 2, 48), {})


def _f16(x: float) -> bytes:
    return np.float16(x).tobytes()


def _nibbles(idx: list[int]) -> bytes:
    return bytes(idx[j] | (idx[j + 16] << 4) for j in range(16))


def test_iq4_nl_hand_computed_block():
    """x = [1.0, 0.5, 0 x 30]: max 1 -> d0 = 1/-127; 1.0 -> level -127 (index 0), 0.5 -> -63.5, nearest -65
    (index 3), 0 -> nearest level 1 (index 8). Weights x^2: sumqx = -127 - 0.25*65*0.5 = -135.125, sumq2 =
    16129 + 0.25*4225 = 17185.25, d = sumqx / sumq2."""
    x = torch.zeros(1, 1, 1, 32)
    x[..., 0], x[..., 1] = 1.0, 0.5
    enc = codec_from_spec("iq4_nl").encode(x, {})
    d = np.float32(-135.125) / np.float32(17185.25)
    idx = [0, 3] + [8] * 30
    assert enc["blocks"][0, 0, 0].numpy().tobytes() == _f16(d) + _nibbles(idx)
    dec = codec_from_spec("iq4_nl").decode(enc, {}, torch.float32)[0, 0, 0]
    levels = np.array(IQ4NL_LEVELS, dtype=np.float32)
    assert np.array_equal(dec.numpy(), np.float32(np.float16(d)) * levels[idx])
    # gguf's dequantizer (it has no iq4_nl quantizer) reads the same bytes to the same values
    assert np.array_equal(dequantize(enc["blocks"][0, 0].numpy(), GGMLQuantizationType.IQ4_NL)[0], dec.numpy())


def test_iq4_nl_on_grid_block_and_zero_block():
    """Values on the grid (-0.02 x level): every index exact and the least-squares scale -0.02."""
    idx = [(5 * j + 3) % 16 for j in range(32)]
    idx[7] = 0  # the largest magnitude: level -127
    x = torch.tensor([-0.02 * IQ4NL_LEVELS[i] for i in idx], dtype=torch.float32).reshape(1, 1, 1, 32)
    x = torch.cat([x, torch.zeros_like(x)], dim=2)
    b = codec_from_spec("iq4_nl").encode(x, {})["blocks"][0, 0].numpy()
    assert b[0].tobytes() == _f16(-0.02) + _nibbles(idx)
    assert b[1].tobytes() == _f16(0.0) + bytes(16)  # d = 0: decodes to zeros


def _iq4_nl_scalar(xb: np.ndarray) -> bytes:
    """ggml's quantize_row_iq4_nl_ref for one block, line by line in float32 (the cache copy's quantizer)."""
    vals = [np.float32(v) for v in IQ4NL_LEVELS]
    f = np.float32

    def best(a):
        if a <= vals[0]:
            return 0
        if a >= vals[15]:
            return 15
        ml, mu = 0, 15
        while mu - ml > 1:
            mav = (ml + mu) // 2
            if a < vals[mav]:
                mu = mav
            else:
                ml = mav
        return mu - 1 if a - vals[mu - 1] < vals[mu] - a else mu

    amax, mx = f(0), f(0)
    for v in xb:
        if abs(v) > amax:
            amax, mx = abs(v), v
    if amax < f(1e-15):
        return _f16(0.0) + bytes(16)
    d = f(mx / vals[0])
    inv = f(f(1) / d)
    sumqx, sumq2, idx = f(0), f(0), []
    for v in xb:
        i = best(f(inv * v))
        idx.append(i)
        w = f(v * v)
        sumqx = f(sumqx + f(f(w * vals[i]) * v))
        sumq2 = f(sumq2 + f(f(w * vals[i]) * vals[i]))
    d = f(sumqx / sumq2) if sumq2 > 0 else f(0)
    return _f16(d) + _nibbles(idx)


def test_iq4_nl_matches_scalar_transcription_of_ggml_on_real_ish_keys():
    x = realish_keys(64, tokens=20, seed=3)
    got = codec_from_spec("iq4_nl").encode(x, {})["blocks"].reshape(-1, 18).numpy()
    blocks = x.reshape(-1, 32).numpy()
    want = [_iq4_nl_scalar(b) for b in blocks]
    assert [g.tobytes() for g in got] == want


def test_iq4_nl_error_sits_between_q4_0_and_q5_0():
    x = realish_keys(128, tokens=64, seed=1)

    def rel(kind):
        c = codec_from_spec(kind)
        return float(((c.decode(c.encode(x, {}), {}, torch.float32) - x) ** 2).mean() / (x**2).mean())

    assert rel("q5_0") < rel("iq4_nl") < rel("q4_0")


def test_fp8_static_is_the_engines_saturating_cast():
    x = torch.tensor([0.1, -3.3, 500.0, -1e5, 1e-9, 240.0, 0.0, 17.0]).reshape(1, 1, 1, 8)
    for spec, dt in (("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        c = codec_from_spec(spec)
        assert c.calibrate(x) == {}
        enc = c.encode(x, {})
        fmax = torch.finfo(dt).max
        want = x.clamp(-fmax, fmax).to(dt)
        assert torch.equal(enc["q"], want.view(torch.uint8))
        assert torch.equal(c.decode(enc, {}, torch.float32), want.float())
    assert codec_from_spec("fp8_e4m3").decode(codec_from_spec("fp8_e4m3").encode(x, {}), {}, torch.float32)[
        0, 0, 0, 2].item() == 448.0  # saturated, not NaN
    assert codec_bits_per_element("fp8_e4m3", 64) == 8.0


def test_fp8_prefill_scale_is_amax_over_max_finite_and_counted():
    x = realish_keys(64, tokens=12)
    c = codec_from_spec("fp8_e4m3-prefill")
    st = c.calibrate(x)
    assert st["scale"].dtype == torch.float32 and st["scale"].item() == pytest.approx(x.abs().max().item() / 448)
    assert c.state_bytes(st) == 4
    enc = c.encode(x, st)
    want = (x / st["scale"]).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(enc["q"], want.view(torch.uint8))
    assert torch.equal(c.decode(enc, st, torch.float32), want.float() * st["scale"])
    big = c.decode(c.encode(x * 10, st), st, torch.float32)  # later rows beyond the prefill's range saturate
    assert big.abs().max().item() == pytest.approx(448 * st["scale"].item())


@pytest.fixture(scope="module")
def engine32() -> Engine:
    return Engine.tiny(head_dim=32)


@pytest.mark.parametrize("policy", ["llamacpp:q8_0/q4_0", "llamacpp:iq4_nl", "k=q5_1,v=q4_1,sink=2,recent=3",
                                    "vllm:fp8", "trtllm:fp8", "k=fp8_e5m2-prefill,v=q5_0", "sglang:fp4_mx_block16"])
@pytest.mark.parametrize("tokens", [1, 9, 40])
def test_report_bytes_match_estimate_to_the_byte(engine32, policy, tokens):
    model = engine32.model
    assert_report_matches_estimate(model, TQCache(policy, model.config, mode="compressed"), policy, tokens)


def test_q4_0_cache_bytes_by_hand(engine32):
    """4 layers x 2 KV heads x 10 tokens x (one block of 32 values: 18 bytes) x (K and V) = 2880 bytes, 4.5 bits."""
    model = engine32.model
    cache = TQCache("llamacpp:q4_0", model.config, mode="compressed")
    with torch.inference_mode():
        model(torch.randint(3, 200, (1, 10)), cache=cache)
    rep = cache.report()
    assert rep.compressed_storage_bytes == 4 * 2 * 10 * 18 * 2 == 2880
    assert rep.bits_per_element == 4.5


def test_fused_mode_reports_the_ggml_fallback(engine32):
    ids = engine32.tokenizer("hello there, general", return_tensors="pt")["input_ids"]
    out = {}
    for mode in ("compressed", "fused"):
        res = engine32.generate(ids, "llamacpp:q8_0/q4_0", mode, max_new_tokens=6, stop_at_eos=False)
        out[mode] = (res.token_ids, res.cache_report)
    rep = out["fused"][1]
    assert any("q4_0" in case for case in rep.fallbacks) and any("q8_0" in case for case in rep.fallbacks)
    assert any("fused fallbacks" in n and "q4_0" in n for n in rep.notes)
    assert out["fused"][0] == out["compressed"][0]


def test_engine_settings_in_the_policy_language():
    p = parse_policy("llamacpp:q8_0/q4_0")
    assert (p.k, p.v, p.sink, p.recent, p.label) == ("q8_0", "q4_0", 0, 0, "llamacpp:q8_0/q4_0")
    assert (parse_policy("llamacpp:q4_0").k, parse_policy("llamacpp:q4_0").v) == ("q4_0", "q4_0")
    assert parse_policy("vllm:fp8").k == "fp8_e4m3" and parse_policy("vllm:fp8_e5m2").v == "fp8_e5m2"
    assert parse_policy("sglang:fp8_e4m3").k == "fp8_e4m3" and parse_policy("trtllm:fp8").k == "fp8_e4m3-prefill"
    assert parse_policy("llama.cpp:f16/q8_0").k == "fp16"
    changed = parse_policy("llamacpp:q4_0,recent=32")
    assert (changed.k, changed.recent, changed.name) == ("q4_0", 32, None)
    assert parse_policy("k=q8_0,v=iq4_nl").v == "iq4_nl"


@pytest.mark.parametrize("text, message", [
    ("llamacpp:q3_k", "'q3_k' is not a llamacpp KV type: valid llamacpp types are f32, f16, bf16, q8_0, q5_1, "
                      "q5_0, q4_1, q4_0, iq4_nl"),
    ("vllm:nvfp4", "vllm's nvfp4 is not reproduced here"),
    ("vllm:turboquant_4bit_nc/fp8", "vllm's turboquant_k8v4, .* set K and V together: write vllm:TYPE"),
    ("ollama:q4_0", "unknown engine 'ollama': valid engines are llamacpp, vllm, sglang, trtllm"),
    ("llamacpp:q4_0/q8_0/f16", "write llamacpp:TYPE"),
    ("k=q4_2", "unknown K codec 'q4_2': valid codecs are .*q8_0, q5_1, q5_0, q4_1, q4_0, iq4_nl, fp8_e4m3"),
])
def test_bad_engine_names_say_what_is_valid(text, message):
    with pytest.raises(ValueError, match=message):
        parse_policy(text)


def test_engine_codecs_in_scan_and_allocate(engine32):
    """The engine formats take part in scan (per-layer error) and allocate (per-layer choice under a budget,
    bytes from the same estimate) like any codec."""
    from tqbench.engine.allocate import allocate_policy
    from tqbench.engine.scan import scan

    d = scan(engine32, "hello there general kenobi", codecs=["q8_0", "q4_0", "fp8_e4m3"]).to_dict()
    assert d["codec_bits"] == {"q8_0": 8.5, "q4_0": 4.5, "fp8_e4m3": 8.0}
    k_err = {c: max(max(row) for row in d["metrics"]["k_rel_mse"][c]) for c in d["codecs"]}
    assert k_err["q8_0"] < 1e-4 < k_err["fp8_e4m3"] < k_err["q4_0"] < 0.02  # gguf's q4_0 rel. MSE is ~1e-2
    rep = allocate_policy(engine32, 6.0, base="sink=0", codecs=["q4_0", "q8_0"], calibration="bread", calib_prefill=48,
                          calib_steps=8, context=96, verify_text=None)
    a = rep.allocation
    assert set(a.k) | set(a.v) <= {"q4_0", "q8_0"} and a.bits_per_element <= 6.0
    assert a.estimate.total_bytes == estimate_kv(a.policy, KVGeometry.from_config(engine32.config), 96).total_bytes


def test_sglang_fp4_mx_block16_hand_computed_block():
    """[12, -1, 0.5, 0.3, 0 x 12]: amax/6 = 2 -> e = 1, scale byte 128; x/2 = [6, -0.5, 0.25, 0.15]: codes 7,
    8|1, 1 (0.25 is on a bound: up), 0; bytes (odd << 4) + even = 0x97, 0x01; decoded [12, -1, 1, 0, ...].
    (Byte-identical to SGLang 0.5.23's own FP4MXBlock16KVQuantizeUtil in fp32, bf16 and fp16: checked against the
    wheel's source while writing this codec.)"""
    x = torch.zeros(1, 1, 1, 32)
    x[..., :4] = torch.tensor([12.0, -1.0, 0.5, 0.3])
    x[..., 16:] = 5.0  # second block: amax/6 = 0.833 -> e = 0; 5 -> bucket 7 (>= 5.0) -> 6.0
    c = codec_from_spec("fp4_mx_block16")
    enc = c.encode(x, {})
    assert enc["scale"][0, 0, 0].tolist() == [128, 127]
    assert enc["q"][0, 0, 0].tolist() == [0x97, 0x01] + [0] * 6 + [0x77] * 8
    dec = c.decode(enc, {}, torch.float32)[0, 0, 0]
    assert dec.tolist() == [12.0, -1.0, 1.0, 0.0] + [0.0] * 12 + [6.0] * 16
    assert c.unit_bytes(64) == 36 and codec_bits_per_element("fp4_mx_block16", 64) == 4.5
    assert parse_policy("sglang:fp4_mx_block16").k == "fp4_mx_block16"


def test_engine_settings_in_compare_policies(engine32):
    from tqbench.engine.validate import compare_policies

    d = compare_policies(engine32, ["llamacpp:q8_0", "vllm:fp8", "llamacpp:q4_0"], ["hello there"],
                         max_new_tokens=4).to_dict()
    rows = {r["policy"]: r for r in d["rows"]}
    assert [(rows[p]["policy_string"], rows[p]["bits_per_element"]) for p in rows] == [
        ("k=q8_0,v=q8_0", 8.5), ("k=fp8_e4m3,v=fp8_e4m3", 8.0), ("k=q4_0,v=q4_0", 4.5)]
    assert rows["llamacpp:q8_0"]["kl_mean"] < rows["llamacpp:q4_0"]["kl_mean"]
