"""Issue 12 on the real default model (SmolLM2-135M, a Llama): installing the fused attention leaves the
baseline bit-identical (plain tensors go back to the SDPA the model was loaded with), and a sliding-window
policy option is inert on a model without sliding layers."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from tests.integration.default_model import require_default_model
from tqbench.engine.engine import Engine
from tqbench.engine.validate import corpus_ids

pytestmark = pytest.mark.integration


def test_default_model_baseline_is_unchanged_by_the_fused_install():
    require_default_model()
    eng = Engine.load("default", device="cpu", dtype="float32")
    assert eng.model.config._attn_implementation == "sdpa"
    ids = corpus_ids(eng.tokenizer, "rivers", 96)

    def baseline():
        with torch.inference_mode():
            logits = eng.model(ids, cache=DynamicCache(config=eng.config)).logits
        return logits, eng.generate(ids, None, max_new_tokens=12, stop_at_eos=False).token_ids

    before_logits, before_tokens = baseline()
    fused = eng.generate(ids, "turbo4", "fused", max_new_tokens=12, stop_at_eos=False)
    assert eng.model.config._attn_implementation == "tqbench_fused" and fused.cache_report.fused_calls > 0
    after_logits, after_tokens = baseline()
    assert torch.equal(before_logits, after_logits) and before_tokens == after_tokens
    plain = eng.generate(ids, "turbo4", "compressed", max_new_tokens=12, stop_at_eos=False)
    windowed = eng.generate(ids, "turbo4,sliding=compress", "compressed", max_new_tokens=12, stop_at_eos=False)
    assert windowed.token_ids == plain.token_ids
    assert windowed.cache_report.compressed_storage_bytes == plain.cache_report.compressed_storage_bytes
