"""The compressed cache on the tiny model: exactness, modes, byte accounting."""

import pytest
import torch
from transformers import DynamicCache

from tests.unit.cache_helpers import assert_report_matches_estimate
from tqbench.engine.cache import CACHE_MODES, TQCache
from tqbench.engine.cache.estimate import KVGeometry, estimate_kv
from tqbench.engine.policy import PRESETS, parse_policy

PROMPT = "the quick brown fox jumps over the lazy dog and keeps running far away " * 2


def _ids(engine, text=PROMPT):
    return engine.encode_prompt(text, chat=False)


@pytest.mark.parametrize("mode", CACHE_MODES)
def test_dense_policy_matches_dynamic_cache_in_generate(tiny_engine, mode):
    model, ids = tiny_engine.model, _ids(tiny_engine)
    kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=tiny_engine.tokenizer.pad_token_id)
    ref = model.generate(ids, cache=DynamicCache(config=model.config), **kw)
    out = model.generate(ids, cache=tiny_engine.make_cache("fp16", mode), **kw)
    assert out.tolist() == ref.tolist()


@pytest.mark.parametrize("mode", CACHE_MODES)
def test_dense_policy_matches_dynamic_cache_in_manual_loop(tiny_engine, mode):
    ref = tiny_engine.generate(_ids(tiny_engine), None, max_new_tokens=16, stop_at_eos=False)
    got = tiny_engine.generate(_ids(tiny_engine), "fp16", mode, max_new_tokens=16, stop_at_eos=False)
    assert got.token_ids == ref.token_ids


@pytest.mark.parametrize("mode", CACHE_MODES)
def test_dense_policy_matches_dynamic_cache_in_left_padded_batch(tiny_engine, mode):
    tok, model = tiny_engine.tokenizer, tiny_engine.model
    tok.padding_side = "left"
    batch = tok([PROMPT, "a short one", "mid length prompt here ok"], return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    ref = model.generate(**batch, cache=DynamicCache(config=model.config), **kw)
    out = model.generate(**batch, cache=tiny_engine.make_cache("fp16", mode), **kw)
    assert out.tolist() == ref.tolist()


@pytest.mark.parametrize("policy", ["turbo4", "q8k-int4v", "k=turbo3.5,v=turbo2-qjl,sink=2,recent=4"])
def test_fused_and_compressed_and_simulate_agree_exactly_in_float64(tiny_engine64, policy):
    runs = {
        m: tiny_engine64.generate(_ids(tiny_engine64), policy, m, max_new_tokens=20, stop_at_eos=False).token_ids
        for m in ("simulate", "compressed", "fused")
    }
    assert runs["fused"] == runs["compressed"] == runs["simulate"]


def test_left_padded_batch_compressed_matches_fused_float64(tiny_engine64):
    tok, model = tiny_engine64.tokenizer, tiny_engine64.model
    tok.padding_side = "left"
    batch = tok([PROMPT, "a short one"], return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id)
    a = model.generate(**batch, cache=tiny_engine64.make_cache("turbo4", "compressed"), **kw)
    b = model.generate(**batch, cache=tiny_engine64.make_cache("turbo4", "fused"), **kw)
    assert a.tolist() == b.tolist()


def test_lossy_policy_changes_what_attention_reads(tiny_engine):
    """turbo1 K/V with no window must perturb the logits (the cache is not silently dense)."""
    ids = _ids(tiny_engine)
    model = tiny_engine.model
    with torch.inference_mode():
        ref_cache = DynamicCache(config=model.config)
        model(ids, cache=ref_cache)
        ref = model(torch.tensor([[5]]), cache=ref_cache).logits
        for mode, should_differ in (("dense-shadow", False), ("simulate", True), ("compressed", True), ("fused", True)):
            cache = tiny_engine.make_cache("k=turbo1,v=turbo1", mode)
            model(ids, cache=cache)
            got = model(torch.tensor([[5]]), cache=cache).logits
            assert (not torch.allclose(got, ref, atol=1e-4)) == should_differ, mode


@pytest.mark.parametrize("policy", [p for p in PRESETS] + ["k=turbo4,v=int2,sink=3,recent=5,kblock=16,group=8"])
@pytest.mark.parametrize("tokens", [1, 7, 40, 77])
def test_report_bytes_match_config_only_estimate_to_the_byte(tiny_engine, policy, tokens):
    model = tiny_engine.model
    assert_report_matches_estimate(model, TQCache(policy, model.config, mode="compressed"), policy, tokens)


def test_hand_computed_bytes_for_turbo4_window_policy(tiny_engine):
    """4 layers, 2 KV heads, head_dim 16, 100 tokens, turbo4 K (centered) and V, sink 4, recent 32."""
    model = tiny_engine.model
    cache = TQCache("k=turbo4,v=turbo4,sink=4,recent=32", model.config, mode="compressed")
    with torch.inference_mode():
        model(torch.randint(3, 200, (1, 100)), cache=cache)
    rep = cache.report()
    heads, d = 2, 16
    fp_rows = 4 + 32  # sinks + recent window, fp16
    packed_rows = 100 - fp_rows
    per_row = d * 4 // 8 + 2  # 4-bit indices + fp16 norm
    k = fp_rows * heads * d * 2 + packed_rows * heads * per_row + heads * d * 2  # + fp16 centering mean
    v = fp_rows * heads * d * 2 + packed_rows * heads * per_row
    assert [r.k_bytes for r in rep.layers] == [k] * 4
    assert [r.v_bytes for r in rep.layers] == [v] * 4
    assert rep.dense_fp16_bytes == 4 * 2 * heads * 100 * d * 2
    # counted once for the whole cache: a float32 16x16 rotation per side (K and V draw different seeds) and the
    # 16-level float32 Lloyd-Max codebook both sides share
    assert rep.shared_objects == {"rotation:qr:seed0:d16": d * d * 4, "rotation:qr:seed1:d16": d * d * 4,
                                  "codebook:lloyd-max:d16:b4": 16 * 4}
    assert rep.shared_bytes == 2112
    assert rep.compressed_storage_bytes == 4 * (k + v) + 2112


def test_modes_report_resident_bytes_honestly(tiny_engine):
    model = tiny_engine.model
    tiny_engine.enable_fused()
    reps, caches = {}, {}
    for mode in CACHE_MODES:
        cache = caches[mode] = TQCache("turbo4", model.config, mode=mode)
        with torch.inference_mode():
            model(torch.randint(3, 200, (1, 64)), cache=cache)
        reps[mode] = cache.report()
    storage = reps["fused"].compressed_storage_bytes
    assert all(r.compressed_storage_bytes == storage for r in reps.values())
    assert reps["compressed"].resident_decode_bytes > storage
    # the torch reference of the fused path decodes one side of one layer transiently (fp32 rows + the int32
    # code index + the full-precision rows): counted exactly, and it says so
    from tqbench.engine.cache.layer_report import fused_reference_peak_bytes

    cache = caches["fused"]
    layer = cache.layers[0]
    kv_heads, d = cache.num_kv_heads, cache.head_dim
    packed = layer.v_store.n_packed
    want = kv_heads * packed * d * 4 + 4 * kv_heads * packed * d // 2 + kv_heads * (4 + 16 + 1) * d * 4
    assert packed == 64 - 4 - 16 and fused_reference_peak_bytes(layer, kv_heads, d) == want
    assert reps["fused"].resident_decode_bytes == storage + want
    assert any("torch reference" in n for n in reps["fused"].notes)
    assert reps["simulate"].resident_decode_bytes == storage + reps["simulate"].dense_fp16_bytes
    assert reps["dense-shadow"].quality_claims is False
    assert any("storage-only" in n for n in reps["dense-shadow"].notes)


def test_fused_mode_reports_calls_and_dequantize_path(tiny_engine):
    r = tiny_engine.generate(_ids(tiny_engine), "q8k-int4v", "fused", max_new_tokens=4, stop_at_eos=False)
    assert r.cache_report.fused_calls > 0
    assert any(k.startswith("dequantize-in-attention:int") for k in r.cache_report.fallbacks)
    r = tiny_engine.generate(_ids(tiny_engine), "turbo4", "fused", max_new_tokens=4, stop_at_eos=False)
    assert r.cache_report.fallbacks == {}


def test_bad_mode_is_an_error(tiny_engine):
    with pytest.raises(ValueError, match="unknown cache mode 'fast': valid modes are"):
        TQCache("turbo4", tiny_engine.model.config, mode="fast")


def test_policy_string_is_parsed_once(tiny_engine):
    cache = TQCache(parse_policy("turbo3"), tiny_engine.model.config)
    assert cache.policy.label == "turbo3"


def test_mixed_sliding_model_keeps_windows_and_reports_why():
    from tqbench.engine.engine import Engine

    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    eng = Engine.tiny(layer_types=types, sliding_window=8)
    ids = eng.encode_prompt(PROMPT, chat=False)
    ref = eng.generate(ids, None, max_new_tokens=10, stop_at_eos=False)
    same = eng.generate(ids, "fp16", "compressed", max_new_tokens=10, stop_at_eos=False)
    assert same.token_ids == ref.token_ids
    r = eng.generate(ids, "kv=turbo4,bypass=global,sliding=bypass", "compressed", max_new_tokens=10,
                     stop_at_eos=False)
    notes = {b["layer"]: b["reason"] for b in r.cache_report.bypassed_layers}
    assert "sliding-window" in notes[0] and "global" in notes[1]
    rows = {row.layer: row for row in r.cache_report.layers}
    assert rows[0].tokens == 7  # the sliding layer holds its window only (transformers keeps window - 1)
    r = eng.generate(ids, "kv=turbo4", "compressed", max_new_tokens=10, stop_at_eos=False)
    rows = {row.layer: row for row in r.cache_report.layers}
    assert rows[1].k_packed_tokens > 0 and rows[1].reason is None


def test_mixed_model_estimate_matches_report():
    from tqbench.engine.engine import Engine

    types = ["sliding_attention", "full_attention"] * 2
    eng = Engine.tiny(layer_types=types, sliding_window=8)
    cache = TQCache("kv=turbo4,sink=2,recent=4", eng.model.config)
    with torch.inference_mode():
        eng.model(torch.randint(3, 200, (1, 30)), cache=cache)
        eng.model(torch.randint(3, 200, (1, 1)), cache=cache)
    est = estimate_kv("kv=turbo4,sink=2,recent=4", KVGeometry.from_config(eng.model.config), 31)
    assert cache.report().compressed_storage_bytes == est.total_bytes
