import pytest
import torch
from transformers import DynamicCache

from tqbench import CompressedDynamicCache


def test_wrapper_compresses_and_restores(tiny_engine):
    model = tiny_engine.model
    ids = tiny_engine.encode_prompt("some words to cache here", chat=False)
    d = model.config.head_dim
    cache = DynamicCache(config=model.config)
    with CompressedDynamicCache(cache, head_dim=d, k_bits=4, v_bits=3, model_config=model.config) as cdc:
        with torch.inference_mode():
            model(ids, cache=cache)
        kidx, knorm, vidx, vnorm = cdc.get_compressed(0)
        assert kidx.dtype == torch.uint8 and kidx.shape[-1] == d * 4 // 8
        assert vidx.shape[-1] == d * 3 // 8 and knorm.shape[2] == ids.shape[1]
        stats = cdc.compression_stats()
        assert stats["baseline_fp16_bytes"] == cdc.baseline_vram_bytes()
        assert cdc.vram_bytes() < cdc.baseline_vram_bytes()
        assert stats["compressed_layers"] == list(range(model.config.num_hidden_layers))
    assert "update" not in vars(cache)  # restored


def test_wrapper_argument_and_shape_errors(tiny_engine):
    cache = DynamicCache()
    with pytest.raises(ValueError, match="give either bits"):
        CompressedDynamicCache(cache, head_dim=16, bits=4, k_bits=4)
    with pytest.raises(ValueError, match="TurboQuant bits must be"):
        CompressedDynamicCache(cache, head_dim=16, bits=5)
    cdc = CompressedDynamicCache(cache, head_dim=16, bits=4).enable()
    with pytest.raises(ValueError, match=r"\[batch, heads, tokens, head_dim=16\]"):
        cache.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), 0)
    cdc.restore()


def test_wrapper_bypasses_full_attention_in_mixed_models():
    from types import SimpleNamespace

    cfg = SimpleNamespace(layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    cache = DynamicCache()
    cdc = CompressedDynamicCache(cache, head_dim=16, bits=4, model_config=cfg).enable()
    x = torch.randn(1, 2, 5, 16)
    for i in range(3):
        cache.update(x, x, i)
    with pytest.raises(ValueError, match="layer 1 is bypassed"):
        cdc.get_compressed(1)
    assert cdc.get_compressed(0)[0].shape[2] == 5
    assert torch.equal(cache.layers[1].keys, x)  # bypassed: exact
    assert not torch.equal(cache.layers[0].keys, x)  # compressed: dequantized
