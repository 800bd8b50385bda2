"""The real default model: converted once into the cache, then loaded from it quickly; it answers."""

from __future__ import annotations

import pytest
import torch

from tests.integration.default_model import require_default_model
from tqbench.engine.models import (
    DEFAULT_MODEL_ID,
    converted_dir,
    load_model,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def default():
    require_default_model()
    messages: list[str] = []
    loaded = load_model("default", device="cpu", dtype="float32", on_progress=messages.append)
    loaded.messages = messages  # for the test that reads them
    return loaded


def test_geometry_and_fields(default):
    s = default.config_summary
    assert (s["num_layers"], s["num_heads"], s["num_kv_heads"], s["head_dim"]) == (30, 9, 3, 64)
    assert s["max_position_embeddings"] == 8192 and s["layer_types"] is None
    assert default.name == DEFAULT_MODEL_ID and default.source.kind == "default"
    assert 130e6 < default.num_params < 140e6
    assert default.device == torch.device("cpu") and default.dtype == torch.float32
    assert not default.model.training and len(default.fingerprint) == 16
    assert (converted_dir(default.source) / "model.safetensors").is_file()
    assert any(m.startswith("Loading") for m in default.messages)


def test_greedy_answer_mentions_paris(default):
    tok = default.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = default.model.generate(ids, max_new_tokens=16, do_sample=False)
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in text, text


def test_second_load_reuses_the_converted_folder_and_is_identical(default):
    messages: list[str] = []
    again = load_model("default", device="cpu", dtype="float32", on_progress=messages.append)
    assert not any("Converting" in m or "GGUF" in m for m in messages), messages  # no second conversion
    assert again.fingerprint == default.fingerprint
    name, param = next(iter(default.model.named_parameters()))
    assert torch.equal(dict(again.model.named_parameters())[name], param)
