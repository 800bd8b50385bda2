"""scan (capture + per-head metrics), needle in a haystack, and kv-estimate with exact bytes."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache

from tqbench.engine.cache import (
    explicit_geometry,
    kv_estimate,
    longest_context,
    model_geometry,
    parse_bytes,
    shipped_models,
)
from tqbench.engine.cache.estimate import KVGeometry
from tqbench.engine.events import ScanLayerDone
from tqbench.engine.policy import parse_policy
from tqbench.engine.scan import (
    ScanResult,
    capture_qkv,
    parse_thresholds,
    resolve_codecs,
    resolve_layers,
    scan,
)
from tqbench.engine.validate import build_haystack, needle_in_haystack, score_answer

TEXT = "The river rose in the night and the ferry stayed on the far bank until the water fell again. " * 3


# ---- capture ---------------------------------------------------------------------------------------------
def test_capture_matches_the_cache_keys_and_restores_attention(tiny_engine):
    before = tiny_engine.model.config._attn_implementation
    cap = capture_qkv(tiny_engine, TEXT, layers="0,-1", max_prompt_tokens=40)
    assert tiny_engine.model.config._attn_implementation == before
    assert sorted(cap.layers) == [0, 3] and cap.truncated and cap.prompt_tokens == 40
    q, k, v = cap.layers[3].q, cap.layers[3].k, cap.layers[3].v
    assert q.shape == (4, 40, 16) and k.shape == (2, 40, 16) and v.shape == (2, 40, 16)
    # post-RoPE keys and values exactly as a DynamicCache stores them
    ids = tiny_engine.encode_prompt(TEXT)[:, :40]
    cache = DynamicCache(config=tiny_engine.config)
    with torch.inference_mode():
        tiny_engine.model(input_ids=ids, cache=cache, use_cache=True)
    assert torch.equal(cache.layers[3].keys[0].float(), k)
    assert torch.equal(cache.layers[3].values[0].float(), v)
    gen = capture_qkv(tiny_engine, TEXT, layers=[1], max_prompt_tokens=20, generated_tokens=5)
    assert gen.generated_tokens == 5 and len(gen.token_ids) == 25
    assert gen.metadata()["layers"] == [1]


def test_capture_through_an_eager_model():
    from tqbench.engine.engine import Engine

    eng = Engine.tiny(attn_implementation="eager")
    cap = capture_qkv(eng, TEXT, layers=[2], max_prompt_tokens=24)
    assert eng.model.config._attn_implementation == "eager"
    ids = eng.encode_prompt(TEXT)[:, :24]
    cache = DynamicCache(config=eng.config)
    with torch.inference_mode():
        eng.model(input_ids=ids, cache=cache, use_cache=True)
    assert torch.equal(cache.layers[2].keys[0].float(), cap.layers[2].k)
    assert cap.layers[2].scaling == pytest.approx(16**-0.5)


def test_layer_and_codec_errors():
    assert resolve_layers("0,-1", 4) == [0, 3] and resolve_layers(None, 3) == [0, 1, 2]
    assert resolve_layers("first1+last1", 4) == [0, 3]
    with pytest.raises(ValueError, match="layer index 7 is out of range for a model with 4 layers"):
        resolve_layers("0,7", 4)
    with pytest.raises(ValueError, match="unknown codec 'turbo9'"):
        resolve_codecs("int8,turbo9")
    with pytest.raises(ValueError, match="unknown codec preset 'wild'"):
        resolve_codecs(preset="wild")
    with pytest.raises(ValueError, match="either codecs or a codec preset"):
        resolve_codecs("int8", "safe")
    assert parse_thresholds("kl=0.01,cos=0.99") == {"softmax_kl": 0.01, "score_cosine": 0.99}
    with pytest.raises(ValueError, match="unknown threshold metric 'foo'"):
        parse_thresholds("foo=1")


def test_scan_matrices_verdicts_and_policy(tiny_engine):
    events = []
    res = scan(tiny_engine, TEXT, layers="0,1,3", codecs=["fp16", "int8", "turbo2"], max_prompt_tokens=64,
               on_event=events.append)
    d = json.loads(json.dumps(res.to_dict()))
    assert d["layers"] == [0, 1, 3] and d["kv_heads"] == 2
    for metric in ("k_rel_mse", "v_rel_mse", "score_cosine", "score_rel_err", "softmax_kl", "attn_out_rel_err"):
        for codec in ("fp16", "int8", "turbo2"):
            m = d["metrics"][metric][codec]
            assert len(m) == 3 and all(len(row) == 2 for row in m), (metric, codec)
    for stat in ("k_norm", "v_norm", "kv_norm_ratio", "k_outlier_channels", "k_channel_mean"):
        assert len(d["norms"][stat]) == 3 and len(d["norms"][stat][0]) == 2
    assert len(d["norms"]["k_channel_mean"][0][0]) == 16
    # fp16 is lossless; int8 is far closer than 2-bit turbo on every head
    assert all(x == 0 for row in d["metrics"]["softmax_kl"]["fp16"] for x in row)
    assert all(x == pytest.approx(1.0) for row in d["metrics"]["score_cosine"]["fp16"] for x in row)
    for i8, t2 in zip(d["metrics"]["v_rel_mse"]["int8"], d["metrics"]["v_rel_mse"]["turbo2"]):
        assert all(a < b for a, b in zip(i8, t2))
    assert [e.layer for e in events if isinstance(e, ScanLayerDone)] == [0, 1, 3]
    for v in d["verdicts"]:
        assert v["cheapest"] in v["passing"] or v["cheapest"] is None
        assert v["cheapest"] != "fp16" or v["passing"] == ["fp16"]
    policy = parse_policy(res.suggest_policy())  # the parser accepts the suggestion
    plans = policy.plan(4)
    for v in d["verdicts"]:
        assert plans[v["layer"]].k == (v["cheapest"] or "fp16")
    # layer 2 was never measured: the suggestion gives it no codec (issue 42: a scan of 0,-1 suggested 1-28's)
    assert res.unmeasured == 1 and plans[2].k == plans[2].v == "fp16" and plans[2].reason is None
    # from_dict inverts to_dict exactly, in memory and through JSON (a saved session's scan)
    assert ScanResult.from_dict(res.to_dict()).to_dict() == res.to_dict()
    assert json.dumps(ScanResult.from_dict(d).to_dict()) == json.dumps(res.to_dict())


def test_scan_thresholds_change_the_cheapest(tiny_engine):
    cap = capture_qkv(tiny_engine, TEXT, layers=[0], max_prompt_tokens=48)
    loose = scan(tiny_engine, None, capture=cap, codecs=["int8", "turbo2"], thresholds="kl=10,out=10")
    strict = scan(tiny_engine, None, capture=cap, codecs=["int8", "turbo2"], thresholds="kl=1e-12")
    assert loose.verdicts[0]["cheapest"] == "turbo2"
    assert strict.verdicts[0]["cheapest"] is None and strict.verdicts[0]["verdict"] == "sensitive"
    assert strict.suggest_policy() == "k=fp16,v=fp16"


# ---- needle in a haystack ----------------------------------------------------------------------------------
def test_haystack_and_scoring(tiny_engine):
    text, at = build_haystack(tiny_engine.tokenizer, 200, 0.5, "amber-falcon-1234")
    sentences = text.split(". ")
    assert "The secret passphrase is amber-falcon-1234" in text
    assert abs(at - len(sentences) / 2) <= 2
    assert score_answer("It is Amber-Falcon-1234.", "amber-falcon-1234") == (True, 1.0)
    assert score_answer("amber falcon", "amber-falcon-1234") == (False, pytest.approx(2 / 3))
    with pytest.raises(ValueError, match="depth 1.5 is invalid"):
        build_haystack(tiny_engine.tokenizer, 200, 1.5, "x-y-1")


def test_niah_cells_and_context_limit(tiny_engine):
    res = needle_in_haystack(tiny_engine, ["turbo4"], [48], [0.0, 1.0], max_new_tokens=3)
    d = json.loads(json.dumps(res.to_dict()))
    assert len(d["cells"]) == 4 and d["recall"]["fp16"] == [[False, False]]  # a random model recalls nothing
    assert [r["policy"] for r in d["summary"]] == ["fp16", "turbo4"]
    with pytest.raises(ValueError, match="over the 100-token limit"):
        needle_in_haystack(tiny_engine, ["turbo4"], [400], [0.5], max_context=100)


# ---- kv-estimate ---------------------------------------------------------------------------------------
def test_kv_estimate_32_layers_8_heads_128_at_32k_by_hand():
    layers, heads, d, seq = 32, 8, 128, 32768
    rep = kv_estimate(explicit_geometry(layers, heads, d), ["fp16", "turbo4"], seq)
    fp16, turbo4 = rep.rows
    # fp16: K and V, every token, 2 bytes per element
    assert fp16.total_bytes == 2 * layers * heads * seq * d * 2 == 4_294_967_296
    # turbo4 (sink=4, recent=16): 20 rows per head stay fp16; the other 32748 rows pack 128 x 4-bit indices
    # (64 bytes) + a 2-byte fp16 norm = 66 bytes; K also stores its fp16 centering mean per head (128 x 2 bytes).
    fp_rows = 20 * heads * d * 2
    packed = (seq - 20) * heads * (128 * 4 // 8 + 2)
    k_mean = heads * d * 2
    per_layer = 2 * (fp_rows + packed) + k_mean
    # shared once: one 128x128 fp32 rotation for K and one for V (different seeds) + the 16-entry fp32 codebook
    shared = 2 * 128 * 128 * 4 + 16 * 4
    assert turbo4.shared_bytes == shared
    assert turbo4.total_bytes == layers * per_layer + shared == 1_109_438_528
    assert turbo4.dense_fp16_bytes == fp16.total_bytes
    assert turbo4.bits_per_element == round(1_109_438_528 * 8 / (4_294_967_296 / 2), 4)


def test_longest_context_and_budget():
    geo = explicit_geometry(32, 8, 128)
    per_token = 2 * 32 * 8 * 128 * 2  # fp16 bytes per token
    assert longest_context("fp16", geo.geometry, 24 * 2**30) == 24 * 2**30 // per_token == 196608
    assert longest_context("fp16", geo.geometry, per_token - 1) == 0
    rep = kv_estimate(geo, ["turbo4"], 1024, memory_budget_bytes=parse_bytes("1GiB"))
    n = rep.rows[0].max_seq_len_in_budget
    from tqbench.engine.cache.estimate import estimate_kv

    assert estimate_kv("turbo4", geo.geometry, n).total_bytes <= 2**30 < estimate_kv("turbo4", geo.geometry, n + 1).total_bytes
    assert parse_bytes("80GB") == 80 * 10**9 and parse_bytes("512MiB") == 512 * 2**20
    with pytest.raises(ValueError, match="memory budget '12 parsecs' is invalid"):
        parse_bytes("12 parsecs")


def test_shipped_model_configs():
    assert {"Llama-3.1-8B", "Llama-3.1-70B", "Mistral-7B-v0.3", "Qwen2.5-7B", "Gemma-2-9B", "Phi-3-mini-4k",
            "SmolLM2-135M", "SmolLM2-1.7B"} <= set(shipped_models())
    g = model_geometry("llama-3.1-8b").geometry
    assert (g.num_layers, g.kv_heads, g.head_dim, g.layer_types) == (32, 8, 128, None)
    gemma = model_geometry("Gemma-2-9B")
    g = gemma.geometry
    assert (g.num_layers, g.kv_heads, g.head_dim, g.sliding_window) == (42, 8, 256, 4096)
    assert g.layer_types[:2] == ("sliding_attention", "full_attention") and g.layer_types.count("sliding_attention") == 21
    # sliding layers keep transformers' bounded window (4095 tokens), so at 8K the fp16 bytes are:
    rep = kv_estimate(gemma, ["fp16"], 8192)
    per_tok = 2 * 8 * 256 * 2
    assert rep.rows[0].total_bytes == 21 * 8192 * per_tok + 21 * 4095 * per_tok
    assert model_geometry("default").geometry == KVGeometry(30, 3, 64)
    assert model_geometry("meta-llama/Llama-3.1-8B-Instruct").name == "Llama-3.1-8B"
    assert model_geometry("google/gemma-2-9b-it").name == "Gemma-2-9B"
    q = model_geometry("Qwen2.5-7B")
    assert (q.geometry.num_layers, q.geometry.kv_heads, q.geometry.head_dim, q.max_context) == (28, 4, 128, 131072)
    with pytest.raises(ValueError, match="unknown model 'gpt-9' for kv-estimate: shipped configs are"):
        model_geometry("gpt-9")
