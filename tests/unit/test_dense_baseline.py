"""The 16-bit dense baselines (``cache.dense_baseline``): rows stored in 16 bits, attention on the upcast rows."""

import pytest
import torch
from transformers import DynamicCache

from tqbench.engine.cache.dense_baseline import Dense16Cache, baseline_kv_dtype, dense_cache


@pytest.mark.parametrize("name,dtype", [("dense-fp16", torch.float16), ("dense-bf16", torch.bfloat16)])
def test_rows_are_stored_in_16_bits_and_returned_upcast(tiny_engine, name, dtype):
    cache = tiny_engine.make_cache(name)
    assert isinstance(cache, Dense16Cache)
    k = torch.randn(1, 2, 5, 16)
    v = torch.randn(1, 2, 5, 16)
    keys, values = cache.update(k, v, 0)
    assert keys.dtype == values.dtype == torch.float32
    assert torch.equal(keys, k.to(dtype).float()) and torch.equal(values, v.to(dtype).float())
    assert not torch.equal(keys, k)  # rounded: 16 bits really held
    layer = cache.layers[0]
    assert layer.keys.dtype == layer.values.dtype == dtype
    assert layer.keys.nbytes == k.nbytes // 2
    k2 = torch.randn(1, 2, 1, 16)
    keys, _ = cache.update(k2, k2, 0)
    assert keys.shape[2] == 6 and torch.equal(keys[:, :, 5:], k2.to(dtype).float())
    assert cache.get_seq_length(0) == 6


def test_plain_dense_is_a_dynamic_cache_and_names_its_dtype(tiny_engine):
    assert type(tiny_engine.make_cache(None)) is DynamicCache
    assert type(tiny_engine.make_cache("dense")) is DynamicCache
    assert tiny_engine.baseline_kv_dtype(None) == "float32"
    assert tiny_engine.baseline_kv_dtype("dense-fp16") == "float16"
    assert baseline_kv_dtype("dense-bf16", torch.float32) == "bfloat16"
    with pytest.raises(ValueError, match="unknown dense baseline 'dense-fp8': valid dense baselines are dense, "):
        dense_cache(tiny_engine.config, "dense-fp8")


def test_generation_with_a_16_bit_baseline_reads_the_rounded_rows(tiny_engine64):
    """float64 model: the fp16 baseline's tokens are exactly those of a DynamicCache fed fp16-rounded K/V."""
    ids = torch.randint(4, 200, (1, 24), generator=torch.Generator().manual_seed(1))
    res = tiny_engine64.generate(ids, "dense-fp16", max_new_tokens=8, stop_at_eos=False)
    assert res.kv_policy == "dense-fp16" and res.cache_mode == "dynamic"

    class Rounded(DynamicCache):
        def update(self, k, v, layer_idx, *a, **kw):
            return super().update(k.half().double(), v.half().double(), layer_idx, *a, **kw)

    from tqbench.engine.generate import _forward

    cache, tok, ref = Rounded(config=tiny_engine64.config), ids, []
    with torch.inference_mode():
        for _ in range(8):
            tok = _forward(tiny_engine64.model, tok, cache).logits[:, -1:].argmax(-1)
            ref.append(int(tok))
    assert res.token_ids == ref
    dense = tiny_engine64.generate(ids, None, max_new_tokens=8, stop_at_eos=False)
    assert dense.kv_policy == "dynamic-cache"


def test_sliding_window_layers_keep_their_window():
    from tqbench.engine.engine import Engine

    eng = Engine.tiny(layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8)
    cache = eng.make_cache("dense-fp16")
    assert [type(la).__name__ for la in cache.layers] == ["Dense16SlidingLayer", "Dense16Layer"] * 2
    ids = torch.randint(4, 200, (1, 20), generator=torch.Generator().manual_seed(2))
    ref = eng.generate(ids, None, max_new_tokens=4, stop_at_eos=False)
    res = eng.generate(ids, "dense-fp16", max_new_tokens=4, stop_at_eos=False)
    assert len(res.token_ids) == len(ref.token_ids) == 4
    k = torch.randn(1, 2, 20, 16)
    cache.update(k, k, 0)
    cache.update(k, k, 1)
    assert cache.layers[0].keys.shape[2] == 7 and cache.layers[1].keys.shape[2] == 20  # window - 1 rows kept


def test_savings_against_a_dense_baseline_count_its_bytes(tiny_engine):
    fp16 = tiny_engine.savings("turbo4", "fp16", 256)
    assert tiny_engine.savings("turbo4", "dense-fp16", 256).baseline_bytes == fp16.baseline_bytes
    assert tiny_engine.savings("turbo4", "dense", 256).baseline_bytes == 2 * fp16.baseline_bytes  # float32 rows
    assert tiny_engine.policy_warning("dense-bf16") is None
