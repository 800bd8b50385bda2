"""The cache room's shape: one geometry reader, public names from the room, the seed wrapper on the simulate
mode, the fused package's one-way imports."""

from __future__ import annotations

import subprocess
import sys

import torch
from transformers import DynamicCache

from tqbench.engine.cache import (
    CACHE_MODES,
    CompressedDynamicCache,
    KVGeometry,
    TQCache,
    TQLayer,
    default_geometry,
    estimate_kv,
    model_geometry,
)
from tqbench.engine.policy import LayerPlan, Policy


def test_default_geometry_comes_from_the_shipped_config_once():
    g = default_geometry()
    assert g == KVGeometry(30, 3, 64) == model_geometry("default").geometry
    assert default_geometry() is g  # cached


def test_cache_reads_its_geometry_through_kvgeometry(tiny_engine):
    cfg = tiny_engine.model.config
    geo = KVGeometry.from_config(cfg)
    cache = TQCache("turbo4", cfg, "simulate")
    assert (cache.num_layers, cache.num_kv_heads, cache.head_dim) == (geo.num_layers, geo.kv_heads, geo.head_dim)
    assert estimate_kv("turbo4", geo, 10).dense_fp16_bytes == 2 * geo.num_layers * geo.kv_heads * 10 * geo.head_dim * 2


def test_cache_modes_are_the_torch_free_constants():
    from tqbench import constants

    assert CACHE_MODES is constants.CACHE_MODES


def test_seed_wrapper_reads_what_a_seed_style_simulate_layer_reads():
    """CompressedDynamicCache keeps, in the DynamicCache, the rows a TQLayer (simulate mode, no sinks, no window,
    uncentered turbo) returns when the current call reads quantized values; the packed bytes are the layer's."""
    x = torch.randn(1, 2, 7, 16, generator=torch.Generator().manual_seed(1))
    y = torch.randn(1, 2, 3, 16, generator=torch.Generator().manual_seed(2))
    cache = DynamicCache()
    with CompressedDynamicCache(cache, head_dim=16, k_bits=4, v_bits=2, seed=3) as cdc:
        cache.update(x, x, 0)
        cache.update(y, y, 0)
    pol = Policy(k="turbo4", v="turbo2", center=False, vcenter=False, seed=3)
    layer = TQLayer(LayerPlan(0, "turbo4", "turbo2", 0, 0), "simulate", pol)
    k1, v1 = layer.append_read_quantized(x, x)
    k2, v2 = layer.append_read_quantized(y, y)
    assert torch.equal(cache.layers[0].keys, torch.cat([k1, k2], 2))
    assert torch.equal(cache.layers[0].values, torch.cat([v1, v2], 2))
    assert not torch.equal(k1, x) and torch.equal(x, x.clone())  # dequantized copies: inputs untouched
    assert cdc.compression_stats()["tokens"] == 10 == layer.cumulative_length
    packed = sum(b.nbytes() for s in (layer.k_store, layer.v_store) for b in s.packed.values())
    assert cdc.vram_bytes() == packed + sum({**cdc.k_codec.shared_items(16), **cdc.v_codec.shared_items(16)}.values())


def test_simulate_mode_still_reads_the_current_call_exact(tiny_engine):
    """TQCache's simulate: the rows of a call are read exact by that call, dequantized from the next one."""
    cache = TQCache("k=turbo4,v=turbo4", tiny_engine.model.config, "simulate")
    x = torch.randn(1, tiny_engine.model.config.num_key_value_heads, 5, tiny_engine.model.config.head_dim)
    k, _ = cache.layers[0].update(x.clone(), x.clone())  # fresh tensors per call, as a model's forward passes
    assert torch.equal(k, x)
    k2, _ = cache.layers[0].update(x[:, :, :1].clone(), x[:, :, :1].clone())
    assert not torch.equal(k2[:, :, :5], x) and torch.equal(k2[:, :, 5:], x[:, :, :1])


def test_fused_package_imports_one_way_and_loads_no_triton_glue():
    code = ("import sys; import tqbench.engine.cache.fused as f; "
            "print(sorted(m for m in sys.modules if m.startswith('tqbench.engine.cache.fused')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(sorted(f"tqbench.engine.cache.fused{m}" for m in
                                            ("", ".batch_kv", ".choose", ".groups", ".install", ".layout", ".masks", ".support",
                                             ".torch_ref")))
