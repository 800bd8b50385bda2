"""Family attention features in fused mode (soft-cap, sinks, V head dim, sliding masks) and the clear
refusals (Falcon's fused mode, MLA, hybrid state-space models, a config that does not match the model)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from tests.unit.families.refused_falcon import WHY, refused_falcon
from tests.unit.families.short_windows import short_window_model
from tqbench.engine.cache import TQCache, UnsupportedModelError, model_geometry
from tqbench.engine.cache.fused import FusedUnsupportedError, reference_fused_attention
from tqbench.engine.cache.tqcache import TQLayer
from tqbench.engine.engine import Engine
from tqbench.engine.models.families import family_config, family_model
from tqbench.engine.policy import parse_policy

PROMPT = torch.randint(4, 260, (1, 30), generator=torch.Generator().manual_seed(5))


def _gen(eng, policy, mode, n=12):
    return eng.generate(PROMPT, policy, mode, max_new_tokens=n, stop_at_eos=False)


# ---- the reference's per-call features, against the formula over the same stored rows ------------------
@pytest.mark.parametrize("spec,dk,dv", [("k=turbo4,v=turbo4", 32, 32), ("k=int8,v=int4,group=16", 32, 16),
                                        ("k=turbo3,v=int8", 32, 16)])
def test_reference_softcap_sinks_and_v_head_dim_match_the_formula(spec, dk, dv):
    g = torch.Generator().manual_seed(0)
    pol = parse_policy(spec + ",recent=2")
    layer = TQLayer(pol.plan(1)[0], "fused", pol)
    k1, v1 = torch.randn(2, 2, 37, dk, generator=g, dtype=torch.float64), torch.randn(2, 2, 37, dv, generator=g,
                                                                                       dtype=torch.float64)
    layer.update(k1, v1)
    hist_k, hist_v = layer.k_store.dense(torch.float64), layer.v_store.dense(torch.float64)
    k2, v2 = torch.randn(2, 2, 3, dk, generator=g, dtype=torch.float64), torch.randn(2, 2, 3, dv, generator=g,
                                                                                     dtype=torch.float64)
    kv, _ = layer.update(k2, v2)
    q = torch.randn(2, 4, 3, dk, generator=g, dtype=torch.float64)
    sinks = torch.randn(4, generator=g, dtype=torch.float64)
    scale, cap = dk ** -0.5, 3.0
    got = reference_fused_attention(q, kv, None, scale, softcap=cap, sinks=sinks)

    keys = torch.cat([hist_k, k2], 2).repeat_interleave(2, dim=1)
    vals = torch.cat([hist_v, v2], 2).repeat_interleave(2, dim=1)
    s = torch.tanh((q * scale) @ keys.transpose(-1, -2) / cap) * cap
    s = s.masked_fill(~torch.ones(3, 40, dtype=torch.bool).tril(37), float("-inf"))
    logits = torch.cat([s, sinks.view(1, 4, 1, 1).expand(2, 4, 3, 1)], -1)
    want = torch.softmax(logits, -1)[..., :-1] @ vals
    assert got.shape == (2, 4, 3, dv)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("impl", ["auto", "torch"])
@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
@pytest.mark.parametrize("policy", ["turbo4", "q8k-int4v", "turbo4,sliding=compress,recent=2"])
def test_softcap_and_sink_families_fused_equal_compressed_in_float64(family, policy, impl, monkeypatch):
    """Gemma-2 (soft-capping 50, eager) and gpt-oss (sink logits): fused reads the packed store with the
    family's feature and gives compressed's greedy tokens, on the default CPU implementation (the native
    kernel) and on the torch reference."""
    from tqbench.engine.cache.fused import IMPL_ENV

    monkeypatch.setenv(IMPL_ENV, impl)
    eng = Engine(family_model(family, dtype=torch.float64))
    comp, fused = _gen(eng, policy, "compressed", 20), _gen(eng, policy, "fused", 20)
    assert fused.token_ids == comp.token_ids
    rep = fused.cache_report
    assert rep.fused_calls > 0 and rep.fallbacks == {}
    assert all(k.startswith("torch-reference") for k in rep.fused_impl) == (impl == "torch")


def test_gemma2_loads_on_its_own_eager_attention():
    """``--model`` loads leave the attention to the family (Gemma-2: eager); forcing sdpa would fail on
    soft-capping in every mode."""
    from tqbench.engine.models.load import load_model

    eng = Engine(load_model("tiny-gemma2"))
    assert eng.model.config._attn_implementation == "eager"
    assert len(_gen(eng, "turbo4", "fused", 4).token_ids) == 4


# ---- sliding windows -----------------------------------------------------------------------------
def test_fused_mask_builder_builds_the_previous_implementations_masks():
    """After install, transformers' mask helpers give exactly the masks of the previous implementation:
    sliding-window masks on sliding layers (eager: additive floats for Gemma-2; bool for sdpa)."""
    def masks(cfg):
        emb, cache, pos = torch.zeros(1, 20, cfg.hidden_size), DynamicCache(config=cfg), torch.arange(20)[None]
        pad = torch.ones(1, 20, dtype=torch.long)
        pad[0, :3] = 0
        return (create_sliding_window_causal_mask(cfg, emb, pad, cache, pos),
                create_causal_mask(cfg, emb, pad, cache, pos))

    for family, dtype in (("gemma2", torch.float32), ("mistral", torch.bool)):
        eng = Engine(short_window_model(family))
        cfg = eng.config
        before = masks(cfg)
        eng.enable_fused()
        after = masks(cfg)
        assert cfg._attn_implementation == "tqbench_fused"
        for a, b in zip(before, after):
            assert a.dtype == dtype and torch.equal(a, b)
        sliding, full = after
        visible = sliding[0, 0] == (True if dtype == torch.bool else 0)
        assert visible[19].sum() == 8 and visible[19, 12] and not visible[19, 11]  # window 8
        assert (full[0, 0] == (True if dtype == torch.bool else 0))[19].sum() == 17  # 3 pads


@pytest.mark.parametrize("spec", ["turbo4,sliding=compress,recent=3", "q8k-int4v,sliding=compress,kblock=4",
                                  "turbo4,sliding=dense", "turbo4,sliding=bypass,bypass=global"])
@pytest.mark.parametrize("tokens", [1, 7, 8, 9, 23, 64])
def test_window_bounded_layers_hold_their_window_and_match_the_estimate(spec, tokens):
    from tqbench.engine.cache.estimate import estimate_kv

    eng = Engine(family_model("gemma3_text"))  # sliding, full, sliding, full; window 8
    cache = TQCache(spec, eng.config, "compressed")
    ids = torch.randint(4, 260, (1, tokens))
    first = max(tokens - 4, 1)
    with torch.inference_mode():
        eng.model(ids[:, :first], cache=cache)
        for t in range(first, tokens):
            eng.model(ids[:, t : t + 1], cache=cache)
    rep = cache.report()
    est = estimate_kv(spec, eng.geometry, tokens)
    assert [r.total_bytes for r in rep.layers] == est.layer_bytes
    assert rep.compressed_storage_bytes == est.total_bytes and rep.dense_fp16_bytes == est.dense_fp16_bytes
    align = 4 if "kblock=4" in spec else 1
    assert rep.layers[0].tokens <= 7 + align - 1 and rep.layers[1].tokens == tokens
    assert rep.layers[0].tokens >= min(tokens, 7)
    bounded = [n for n in rep.notes if "sliding-window layers hold only their window" in n]
    assert bounded == ([] if "bypass," in spec else ["2 sliding-window layers hold only their window (7 tokens, plus "
                                                     "up to one codec unit): their bytes and tokens stay bounded at "
                                                     "any context"])


def test_sliding_option_in_plans_and_strings():
    types = ["sliding_attention", "full_attention"]
    auto_mixed = parse_policy("turbo4").plan(2, types)  # auto compresses sliding layers in mixed models too
    assert auto_mixed[0].sliding and not auto_mixed[0].dense_window and auto_mixed[0].k == "turbo4"
    auto_all = parse_policy("turbo4").plan(2, ["sliding_attention"] * 2)
    assert all(p.sliding and p.k == "turbo4" and p.sink == 0 for p in auto_all)
    dense = parse_policy("turbo4,sliding=dense").plan(2, types)
    assert dense[0].sliding and dense[0].k == "fp16" and "sliding=dense" in dense[0].reason
    assert dense[1].k == "turbo4" and dense[1].sink == 4
    assert parse_policy("turbo4,sliding=compress").to_string().endswith("sliding=compress")
    with pytest.raises(ValueError, match="sliding='sometimes' is invalid: valid choices are auto, compress"):
        parse_policy("turbo4,sliding=sometimes")


# ---- refusals -------------------------------------------------------------------------------------
def test_falcon_fused_is_refused_before_generation_and_the_engine_stays_usable():
    eng = Engine(refused_falcon())
    before = _gen(eng, None, "compressed").token_ids
    with pytest.raises(FusedUnsupportedError) as err:
        _gen(eng, "turbo4", "fused")
    msg = str(err.value)
    assert msg.startswith(f"FalconForCausalLM cannot run the fused cache mode: {WHY}")
    assert "use cache mode compressed / simulate / dense-shadow" in msg
    assert eng.model.config._attn_implementation == "sdpa"
    assert _gen(eng, None, "compressed").token_ids == before
    assert len(_gen(eng, "turbo4", "compressed").token_ids) == 12


def test_flex_attention_models_are_refused_for_fused():
    eng = Engine(family_model("llama"))
    eng.model.config._attn_implementation_internal = "flex_attention"
    with pytest.raises(FusedUnsupportedError, match="loaded with attn_implementation='flex_attention', whose masks"):
        eng.enable_fused()


def test_mla_caches_its_latent_and_refuses_only_fused(tmp_path):
    """DeepSeek-V3 hands the cache its kv_lora_rank-wide latent (K) and the shared RoPE key (V): one "head",
    K and V of different widths, counted to the byte from the config alone; the fused mode is refused (K/V
    are expanded from the latent after the cache)."""
    from tqbench.engine.cache.estimate import estimate_kv

    eng = Engine(family_model("deepseek_v3"))
    geo = eng.geometry
    assert (geo.kv_heads, geo.head_dim, geo.v_dim) == (1, 32, 8)
    r = _gen(eng, "q8k-int4v", "compressed")
    assert r.cache_report.compressed_storage_bytes == estimate_kv("q8k-int4v", geo, 41).total_bytes
    assert r.cache_report.dense_fp16_bytes == 4 * 41 * (32 + 8) * 2
    with pytest.raises(FusedUnsupportedError, match="^DeepseekV3ForCausalLM cannot run the fused cache mode: it "
                                                    "caches its multi-head latent attention latent"):
        _gen(eng, "turbo4", "fused")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(eng.config.to_dict()))
    assert model_geometry(str(path)).geometry == geo


@pytest.mark.parametrize("model_type", ["jamba", "bamba", "qwen3_next"])
def test_hybrid_state_space_models_are_refused_clearly(model_type):
    cfg = AutoConfig.for_model(model_type)
    with pytest.raises(UnsupportedModelError, match="linear_attention layers \\(state-space / linear attention\\)"):
        TQCache("turbo4", cfg)


def test_a_config_that_does_not_match_the_models_kv_is_refused():
    """GPT-NeoX ignores num_key_value_heads (every head has K/V): bytes counted from such a config would be
    wrong, so the cache says so at the first update instead."""
    from transformers import AutoModelForCausalLM

    cfg = family_config("gpt_neox")
    cfg.num_key_value_heads = 2
    model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(UnsupportedModelError, match="hands the cache K/V with 4 heads, K head dim 32"):
        model(torch.tensor([[5, 6, 7]]), cache=TQCache("turbo4", cfg))


def test_the_previous_implementation_is_kept_beside_the_config_not_in_it():
    """save_pretrained / to_dict of a model with fused installed write nothing of tqbench's."""
    eng = Engine(family_model("gemma2"))
    eng.enable_fused()
    from tqbench.engine.cache.fused.support import recorded_previous

    assert recorded_previous(eng.config) == "eager"
    assert not [k for k in eng.config.to_dict() if "tqbench" in k]


def test_serving_falcon_fused_is_refused_at_startup():
    pytest.importorskip("fastapi")
    from tqbench.server import create_app

    with pytest.raises(FusedUnsupportedError, match="^FalconForCausalLM cannot run the fused cache mode"):
        create_app(Engine(refused_falcon()), cache_mode="fused")


def test_a_changed_preset_is_labelled_by_its_string():
    """``turbo4,sliding=compress`` is not ``turbo4``: reports and tables must not label it so."""
    assert parse_policy("turbo4").label == "turbo4"
    assert parse_policy("turbo4,sliding=compress").label == "k=turbo4,v=turbo4,sink=4,recent=16,sliding=compress"
    assert parse_policy("turbo4,sliding=compress,name=t4w").label == "t4w"


def test_scan_capture_on_gemma2_uses_its_eager_attention_after_fused_install():
    """Q/K/V capture (the Scan tab) attends through the model's own eager function (soft-capping) even when
    the fused switch is installed: the baseline logits do not move either."""
    from tqbench.engine.scan.capture import capture_qkv

    eng = Engine(family_model("gemma2"))
    before = capture_qkv(eng, "the river runs to the sea", chat=False)
    eng.enable_fused()
    after = capture_qkv(eng, "the river runs to the sea", chat=False)
    assert eng.model.config._attn_implementation == "tqbench_fused"
    for layer in before.layers:
        assert torch.equal(before.layers[layer].k, after.layers[layer].k)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_fused_cache_without_the_fused_attention_says_what_to_do(attn):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(family_config("llama"), attn_implementation=attn)
    cache = TQCache("turbo4", model.config, "fused")
    with pytest.raises(TypeError, match="the model's attention is not the fused one; call "
                                        "tqbench.engine.cache.fused.install_fused_attention\\(model\\)"):
        model(torch.randint(4, 260, (1, 30)), cache=cache)
