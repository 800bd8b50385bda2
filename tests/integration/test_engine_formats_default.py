"""The engines' KV formats on the default model: its real K rows quantize to the bytes of the ``gguf`` package's
reference quantizers, ``validate --candidate llamacpp:q4_0/q4_0`` runs, and the saved allocation exports to
llama.cpp with its flags, what it could not map and both measured."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from transformers import DynamicCache

from tqbench.cli import main
from tqbench.engine.codecs import codec_from_spec
from tqbench.engine.engine import Engine

pytestmark = pytest.mark.integration
ALLOC = "tqbench/data/policies/smollm2-alloc-2.5bit.toml"


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.load("default", device="cpu", threads=1)


@pytest.fixture(scope="module")
def real_kv(engine):
    """K and V of layers 0, 14 and 29 as the model caches them (post-RoPE keys), 48 tokens of a real prompt."""
    ids = engine.encode_prompt("Explain in a few sentences why the sky is blue, and what Rayleigh found.", True, 8)
    cache = DynamicCache(config=engine.config)
    with torch.inference_mode():
        engine.model(ids, cache=cache)
    return {i: (cache.layers[i].keys.float().clone(), cache.layers[i].values.float().clone()) for i in (0, 14, 29)}


@pytest.mark.parametrize("kind", ["q4_0", "q8_0", "q4_1", "q5_0", "q5_1"])
def test_real_keys_and_values_round_trip_to_gguf_bytes(real_kv, kind):
    qtype = getattr(GGMLQuantizationType, kind.upper())
    codec = codec_from_spec(kind, "k")
    for k, v in real_kv.values():
        assert k.shape[-1] == 64 and k.shape[1] == 3
        for x in (k, v):
            enc = codec.encode(x, {})
            assert np.array_equal(enc["blocks"].numpy(), quantize(x.numpy(), qtype))


def test_validate_llamacpp_q4_0_runs_on_the_default_model(tmp_path):
    js = tmp_path / "v.json"
    r = CliRunner().invoke(main, ["--headless", "validate", "--candidate", "llamacpp:q4_0/q4_0", "--threads", "1",
                                  "--max-new-tokens", "12", "--report-json", str(js)])
    assert r.exit_code in (0, 1), r.output  # 1: the quality gate; the run itself completed
    d = json.loads(js.read_text())
    assert d["candidate"] == "llamacpp:q4_0/q4_0"
    assert d["candidate_policy"] == "k=q4_0,v=q4_0"
    assert d["candidate_cache_report"]["policy_string"] == "k=q4_0,v=q4_0"
    assert d["candidate_cache_report"]["bits_per_element"] == 4.5


def test_export_of_the_saved_allocation_to_llamacpp_measured(engine):
    from tqbench.engine.deploy import export_policy

    rep = export_policy(ALLOC, "llamacpp", engine=engine, corpus="rivers", context_tokens=128, eval_tokens=16,
                        llamacpp_kld="off")  # the llama.cpp KLD prediction: tests/integration/test_llamacpp_default.py
    s = rep.setting
    assert s.lines[0] == "llama-server -m MODEL.gguf -ctk q4_0 -ctv q4_0 -fa on"
    assert any(u.startswith("per-layer K widths") for u in s.unmapped)
    assert rep.warning is None  # fitted on this model
    assert rep.original.kv_policy == "smollm2-alloc-2.5bit" and rep.mapped.kv_policy == "llamacpp:q4_0"
    assert rep.mapped.bits_per_element == 4.5 and rep.original.bits_per_element < 4.5
    assert 0 < rep.mapped.kl_mean < 1 and 0 < rep.original.kl_mean < 1
