"""``tqbench serve`` on the real default model answers the official OpenAI client, stream and not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.integration.default_model import require_default_model
from tqbench.engine.engine import Engine

pytestmark = pytest.mark.integration
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))


def test_default_model_served_to_openai_client():
    openai = pytest.importorskip("openai")
    from serverkit import LiveServer

    from tqbench.server import create_app

    require_default_model()
    engine = Engine.load("default", device="cpu", threads=1)
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    solo = engine.generate(messages, "turbo4", max_new_tokens=16)
    with LiveServer(create_app(engine, kv_policy="turbo4", max_new_tokens=64, model_aliases=("default",))) as live:
        client = openai.OpenAI(base_url=live.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        resp = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=16)
        chunks = list(client.chat.completions.create(model="default", messages=messages, max_tokens=16,
                                                     stream=True, stream_options={"include_usage": True}))
    text = resp.choices[0].message.content
    assert "Paris" in text
    assert text == solo.text
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    report = resp.model_extra["tqbench"]["cache_report"]
    assert report["kv_policy"] == "turbo4" and report["cache_mode"] == "compressed"
    assert 0 < report["compressed_storage_bytes"] < report["dense_fp16_bytes"]
    assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens
    assert chunks[-1].model_extra["tqbench"]["cache_report"] == report
