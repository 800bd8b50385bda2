"""The engine on the real default model (SmolLM2-135M-Instruct): exactness of the dense policy in every cache
mode, the turbo4 report and text on a long prompt, fused == compressed in float64, and the CLI's JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from tests.integration.default_model import require_default_model
from tqbench.constants import CACHE_MODES
from tqbench.engine.engine import Engine

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
LONG_CONTEXT = ROOT / "tqbench" / "data" / "prompts" / "long_context.txt"
CHAT_PROMPT = "Explain in a few sentences why the sky is blue."
BATCH_PROMPTS = ["What is the capital of France?", "Write a short poem about the sea and the wind at night."]
# ~100 tokens once wrapped in the chat template
FP64_PROMPT = (
    "A lighthouse keeper on a remote island kept a logbook for forty years. Every evening he wrote down the "
    "direction of the wind, the state of the sea, the ships that passed, and the birds that rested on the "
    "gallery rail. When he retired, the logbook went to the county archive, where historians now use it to "
    "study storms and shipping routes. In two sentences, say why such a logbook is useful to historians."
)
NEW = 24


def _load(**kwargs) -> Engine:
    require_default_model()
    return Engine.load("default", device="cpu", **kwargs)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return _load(dtype="float32")


@pytest.fixture(scope="module")
def engine64() -> Engine:
    return _load(dtype="float64")


def _gen(engine: Engine, cache, **inputs) -> list[list[int]]:
    kw = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=engine.tokenizer.pad_token_id)
    with torch.inference_mode():
        return engine.model.generate(**inputs, cache=cache, **kw).tolist()


def _chat_ids(engine: Engine) -> torch.Tensor:
    return engine.encode_prompt(CHAT_PROMPT)


def _padded_batch(engine: Engine) -> dict:
    tok = engine.tokenizer
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in BATCH_PROMPTS]
    side = tok.padding_side
    tok.padding_side = "left"
    try:
        batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tok.padding_side = side
    assert batch["attention_mask"][:, 0].tolist().count(0) == 1, "the prompts should differ in length"
    return dict(batch)


@pytest.fixture(scope="module")
def dynamic(engine) -> dict:
    """The plain ``DynamicCache`` references, computed once."""
    ids = _chat_ids(engine)
    return {
        "generate": _gen(engine, DynamicCache(config=engine.config), input_ids=ids),
        "loop": engine.generate(ids, None, max_new_tokens=NEW, stop_at_eos=False).token_ids,
        "batch": _gen(engine, DynamicCache(config=engine.config), **_padded_batch(engine)),
    }


@pytest.mark.parametrize("mode", CACHE_MODES)
def test_dense_policy_matches_dynamic_cache(engine, dynamic, mode):
    ids = _chat_ids(engine)
    assert _gen(engine, engine.make_cache("fp16", mode), input_ids=ids) == dynamic["generate"]
    loop = engine.generate(ids, "fp16", mode, max_new_tokens=NEW, stop_at_eos=False)
    assert loop.token_ids == dynamic["loop"] and len(loop.token_ids) == NEW
    assert _gen(engine, engine.make_cache("fp16", mode), **_padded_batch(engine)) == dynamic["batch"]


@pytest.fixture(scope="module")
def long_turbo4(engine):
    return engine.generate(LONG_CONTEXT.read_text(encoding="utf-8"), "turbo4", "simulate", max_new_tokens=32)


def test_turbo4_long_context_report(long_turbo4):
    rep = long_turbo4.cache_report
    assert rep.cache_mode == "simulate" and rep.quality_claims
    assert rep.tokens > 1000 and rep.memory_saved_pct >= 65, rep.memory_saved_pct
    assert sum(r.total_bytes for r in rep.layers) + rep.shared_bytes == rep.compressed_storage_bytes
    assert rep.shared_bytes == sum(rep.shared_objects.values()) > 0
    assert sum(r.dense_fp16_bytes for r in rep.layers) == rep.dense_fp16_bytes
    assert len(rep.layers) == 30 and rep.bits_per_element < 6


def test_turbo4_long_context_text_is_coherent(long_turbo4):
    text = long_turbo4.text
    words = [w.strip(".,;:!?\"'()") for w in text.split()]
    assert len(words) >= 10, text
    alpha = [w for w in words if w.isalpha() and w.isascii()]
    assert len(alpha) >= 0.6 * len(words), text
    # seen (fp32, 2 threads): "The station recorded a record of 10.4 degrees Celsius in 1953, which is the ..."
    topical = {"station", "harrowick", "harbor", "weather", "temperature", "pressure", "wind", "rain", "ruane",
               "readings", "recorded", "tide", "climate", "observer"}
    assert topical & {w.lower() for w in alpha}, text


@pytest.mark.parametrize("policy", ["turbo4", "q8k-int4v"])
def test_fused_equals_compressed_in_float64(engine64, policy):
    ids = engine64.encode_prompt(FP64_PROMPT)
    assert 80 <= ids.shape[1] <= 130, ids.shape
    runs = {m: engine64.generate(ids, policy, m, max_new_tokens=NEW, stop_at_eos=False) for m in ("compressed", "fused")}
    assert runs["fused"].token_ids == runs["compressed"].token_ids
    assert len(runs["fused"].token_ids) == NEW and runs["fused"].cache_report.fused_calls > 0


def test_cli_bench_json():
    cmd = [sys.executable, "-m", "tqbench.cli", "--headless", "bench", "--kv-policy", "turbo4", "--cache-mode",
           "simulate", "--prompt-file", str(LONG_CONTEXT), "--max-new-tokens", "8", "--json"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    for key in ("input_tokens", "output_tokens", "kv_policy", "elapsed_seconds", "tokens_per_second"):
        assert key in data, key
    assert data["kv_policy"] == "turbo4" and data["input_tokens"] > 1000 and data["output_tokens"] >= 1
    assert data["elapsed_seconds"] > 0 and data["tokens_per_second"] > 0
    rep = data["cache_report"]
    for key in ("compressed_storage_bytes", "dense_fp16_bytes", "memory_saved_pct", "compressed_at_rest_saved_pct",
                "active_decode_memory_saved_pct", "cache_mode", "bits_per_element"):
        assert key in rep, key
    assert rep["cache_mode"] == "simulate" and rep["memory_saved_pct"] >= 65
    assert 0 < rep["compressed_storage_bytes"] < rep["dense_fp16_bytes"] and 0 < rep["bits_per_element"] < 16
    assert isinstance(rep["active_decode_memory_saved_pct"], (int, float))
