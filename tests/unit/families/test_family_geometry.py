"""kv-estimate knows every family's geometry from a local config.json (no weights), and the shipped configs
are checked against the families' transformers defaults."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig

from tqbench.engine.cache import TQCache, model_geometry, shipped_models
from tqbench.engine.cache.estimate import estimate_kv
from tqbench.engine.cache.geometry import MODELS_DIR
from tqbench.engine.models.families import FAMILIES, family_config, family_model


def _write(tmp_path, family: str):
    folder = tmp_path / family
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(family_config(family).to_dict()))
    return folder


@pytest.mark.parametrize("family", list(FAMILIES))
def test_geometry_from_a_local_config_json_is_the_models(tmp_path, family):
    """The config file alone gives the geometry the loaded model's cache uses, and its estimate equals the
    report of a real run over the same tokens (sliding layers at their window)."""
    folder = _write(tmp_path, family)
    loaded = family_model(family)
    from_file = model_geometry(str(folder)).geometry
    assert from_file == model_geometry(str(folder / "config.json")).geometry
    from tqbench.engine.cache import KVGeometry

    assert from_file == KVGeometry.from_config(loaded.model.config)
    cache = TQCache("turbo4", loaded.model.config, "compressed")
    with torch.inference_mode():
        loaded.model(torch.randint(4, 260, (1, 50)), cache=cache)
    assert estimate_kv("turbo4", from_file, 50).total_bytes == cache.report().compressed_storage_bytes


def test_kv_estimate_cli_reads_a_family_config_json(tmp_path):
    folder = _write(tmp_path, "gemma2")
    proc = subprocess.run(
        [sys.executable, "-m", "tqbench", "--headless", "kv-estimate", "--model", str(folder / "config.json"),
         "--kv-policy", "fp16,turbo4", "--seq-len", "100", "--json"],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    geo = model_geometry(str(folder)).geometry
    assert out["model"]["sliding_layers"] == 2 and out["model"]["sliding_window"] == 8
    assert [r["total_bytes"] for r in out["rows"]] == [estimate_kv(p, geo, 100).total_bytes for p in ("fp16", "turbo4")]
    # fp16 at 100 tokens: 2 global layers hold 100 rows, 2 sliding layers their window of 7 (K and V, fp16)
    assert out["rows"][0]["total_bytes"] == (2 * 100 + 2 * 7) * 2 * 2 * 32 * 2


#: attention fields where a shipped config (the model's public config.json) differs from its family's
#: transformers defaults, and why. Any other difference (a typo, a changed value) fails the test below.
GEOMETRY_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                   "sliding_window", "max_position_embeddings")
EXPECTED_DIFFS = {
    # transformers' Phi3Config documents microsoft/Phi-3-mini-4k-instruct and matches it except the window,
    # which the public config sets (2047) and the class leaves unset
    "Phi-3-mini-4k": {"sliding_window"},
    # MistralConfig is Mistral-7B-v0.1 (4096 window, 128K positions); v0.3 has no window and 32K positions
    "Mistral-7B-v0.3": {"sliding_window", "max_position_embeddings"},
    # LlamaConfig is Llama-2-7B (MHA, 2K context); Llama-3.1 uses GQA and 128K positions
    "Llama-3.1-8B": {"num_key_value_heads", "max_position_embeddings"},
    "Llama-3.1-70B": {"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                      "max_position_embeddings"},
    "SmolLM2-1.7B": {"hidden_size", "num_hidden_layers", "max_position_embeddings"},
    "SmolLM2-135M": {"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"},
    # Gemma2Config's defaults are the 2B shape (26 layers, 8 heads); the 9B is larger
    "Gemma-2-9B": {"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"},
    # Qwen2Config's defaults are Qwen2-7B-like (32 layers, MHA, no window); Qwen2.5-7B is GQA with a 131072
    # window field that use_sliding_window=false switches off
    "Qwen2.5-7B": {"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                   "max_position_embeddings", "sliding_window"},
    # Gemma3TextConfig's defaults are the 4B shape (26 layers, 8 heads, 4 KV heads, 4096 window, 128K positions);
    # the 270M is 18 layers of 4 heads over 1 KV head, a 512 window, 32K positions
    "Gemma-3-270M": {"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "sliding_window", "max_position_embeddings"},
    # Qwen3Config's defaults are MHA (32 KV heads) with 32 layers; Qwen3-8B has 36 layers, 8 KV heads, 40K positions
    "Qwen3-8B": {"num_hidden_layers", "num_key_value_heads", "max_position_embeddings"},
}


@pytest.mark.parametrize("name", shipped_models())
def test_shipped_configs_against_transformers_defaults(name):
    data = json.loads((MODELS_DIR / f"{name}.json").read_text())
    defaults = AutoConfig.for_model(data["model_type"])
    unknown = [k for k in data if not k.startswith("_") and k != "model_type" and not hasattr(defaults, k)]
    assert not unknown, f"{name}: fields unknown to {type(defaults).__name__}: {unknown}"
    differs = {k for k in GEOMETRY_FIELDS if k in data and data[k] != getattr(defaults, k)}
    assert differs == EXPECTED_DIFFS[name]
    geo = model_geometry(name).geometry
    cfg = AutoConfig.for_model(data["model_type"], **{k: v for k, v in data.items() if not k.startswith("_")
                                                      and k != "model_type"})
    assert (geo.num_layers, geo.kv_heads) == (cfg.num_hidden_layers, cfg.num_key_value_heads)
