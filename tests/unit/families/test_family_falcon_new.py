"""Falcon with the new decoder layout (``new_decoder_architecture``, as Falcon-40B/180B): its attention computes
``num_kv_heads`` K/V groups. Before transformers 5.25 it hands the cache one row per query head (broadcast before
the cache) and has no AttentionInterface (fused refused); from 5.25 it caches the groups and repeats them after
the cache, through the AttentionInterface (fused runs). The geometry counts what the installed version hands over.
A random-weight one (4 query heads, 2 KV groups, float64) runs every mode with exact tokens where the mode
promises them, and bytes equal to the config-only estimate; a cache handed other rows than the geometry's is
still refused."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import DynamicCache

from tqbench.engine.cache import KVGeometry, TQCache, UnsupportedModelError
from tqbench.engine.cache.estimate import estimate_kv
from tqbench.engine.cache.fused import FusedUnsupportedError
from tqbench.engine.cache.geometry import falcon_attention_interface
from tqbench.engine.engine import Engine
from tqbench.engine.models.families import family_config, family_model
from tqbench.engine.validate.quality import corpus_ids

NEW_LAYOUT = {"new_decoder_architecture": True, "num_kv_heads": 2}
NEW = 8
#: the rows per token the cache holds: the 2 groups (5.25+) or one per query head (before)
ROWS = 2 if falcon_attention_interface() else 4


@functools.cache
def engine() -> Engine:
    return Engine(family_model("falcon", dtype=torch.float64, **NEW_LAYOUT))


@functools.cache
def prompt() -> torch.Tensor:
    return corpus_ids(engine().tokenizer, "rivers", 40)


@functools.cache
def plain_generate() -> list[int]:
    ids = prompt()
    with torch.inference_mode():
        out = engine().model.generate(input_ids=ids, cache=DynamicCache(config=engine().config), max_new_tokens=NEW,
                                      min_new_tokens=NEW, do_sample=False,
                                      pad_token_id=engine().tokenizer.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


def test_the_geometry_is_the_rows_the_attention_hands_the_cache():
    cfg = family_config("falcon", **NEW_LAYOUT)
    assert (cfg.new_decoder_architecture, cfg.num_kv_heads, cfg.num_attention_heads) == (True, 2, 4)
    assert KVGeometry.from_config(cfg) == KVGeometry(num_layers=4, kv_heads=ROWS, head_dim=32)
    seen = []

    class Recording(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            seen.append(tuple(key_states.shape))
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    with torch.inference_mode():
        engine().model(prompt()[:, :5], cache=Recording(config=engine().config))
    assert set(seen) == {(1, ROWS, 5, 32)}


@pytest.mark.parametrize("policy,mode", [("fp16", "dense-shadow"), ("fp16", "compressed"), ("turbo4", "dense-shadow"),
                                         ("turbo4", "simulate"), ("turbo4", "compressed"),
                                         ("q8k-int4v", "compressed")])
def test_new_layout_falcon_runs_with_exact_tokens_and_counted_bytes(policy, mode):
    r = engine().generate(prompt(), policy, mode, max_new_tokens=NEW, stop_at_eos=False)
    assert len(r.token_ids) == NEW
    if policy == "fp16" or mode == "dense-shadow":  # lossless storage, or attention over exact K/V
        assert r.token_ids == plain_generate()
    else:  # float64: simulate and compressed read the same dequantized rows
        ref = engine().generate(prompt(), policy, "compressed", max_new_tokens=NEW, stop_at_eos=False)
        assert r.token_ids == ref.token_ids
    rep = r.cache_report
    est = estimate_kv(policy, engine().geometry, rep.tokens)
    assert rep.compressed_storage_bytes == est.total_bytes
    assert rep.dense_fp16_bytes == est.dense_fp16_bytes == 4 * ROWS * rep.tokens * (32 + 32) * 2


def test_new_layout_falcon_fused_runs_from_5_25_and_is_refused_before():
    if falcon_attention_interface():
        r = engine().generate(prompt(), "turbo4", "fused", max_new_tokens=NEW, stop_at_eos=False)
        ref = engine().generate(prompt(), "turbo4", "compressed", max_new_tokens=NEW, stop_at_eos=False)
        assert r.token_ids == ref.token_ids  # float64: the same dequantized rows
        assert r.cache_report.compressed_storage_bytes == ref.cache_report.compressed_storage_bytes
    else:
        with pytest.raises(FusedUnsupportedError, match="^FalconForCausalLM cannot run the fused cache mode"):
            engine().generate(prompt(), "turbo4", "fused", max_new_tokens=2, stop_at_eos=False)


def test_a_cache_handed_other_rows_than_the_geometry_is_refused():
    cache = TQCache("turbo4", family_config("falcon", **NEW_LAYOUT), "compressed")
    other = 6 - ROWS  # 4 when the geometry counts the 2 groups, 2 when it counts one row per query head
    k = torch.zeros(1, other, 3, 32)
    with pytest.raises(UnsupportedModelError, match=f"hands the cache K/V with {other} heads, K head dim 32 and V "
                                                    f"head dim 32, but its config reads as {ROWS} KV heads"):
        cache.update(k, k, 0)
