"""The cache report in responses: a summary by default (its size does not grow with the layer count), the
per-layer rows on request (``"cache_report": "layers"``), the same ``tqbench`` object streamed or not, and
``GET /v1/last_cache_report``."""

from __future__ import annotations

import json

import openai
import pytest
from serverkit import CEILING, LiveServer

pytestmark = pytest.mark.server

MESSAGES = [{"role": "user", "content": "Name three colours."}]
N = 12
PER_LAYER = ("layers", "bypassed_layers")
TIMINGS = ("queue_seconds", "prefill_seconds", "decode_seconds", "decode_tokens_per_second")
DEFAULT_MODEL_LAYERS = 30  # SmolLM2-135M-Instruct, the default model


def _client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url + "/v1", api_key="unused", max_retries=0, timeout=CEILING)


def _chat(client, **extra) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=N,
                                          extra_body=extra or None)


def _assert_summary(report: dict, layers: int) -> None:
    """No per-layer list: every value is a scalar, a short list of notes or a dict not keyed by layer."""
    assert not set(PER_LAYER) & set(report)
    assert report["layer_count"] == layers
    for key, value in report.items():
        if isinstance(value, list):
            assert key == "notes" and all(isinstance(v, str) for v in value), key
        if isinstance(value, dict):
            assert all(not isinstance(v, (list, dict)) for v in value.values()), key


@pytest.fixture(scope="module")
def client(live_server):
    return _client(live_server)


def test_default_report_is_a_summary_under_2kb(client, tiny_engine):
    solo = tiny_engine.generate(MESSAGES, "turbo4", max_new_tokens=N)
    ext = _chat(client).model_extra["tqbench"]
    assert len(json.dumps(ext)) < 2048, len(json.dumps(ext))
    report = ext["cache_report"]
    _assert_summary(report, 4)
    full = solo.cache_report.to_dict()
    assert report == {k: v for k, v in full.items() if k not in PER_LAYER} | {"layer_count": 4,
                                                                             "bypassed_layer_count": 0}
    for key in ("compressed_storage_bytes", "dense_fp16_bytes", "resident_decode_bytes", "bits_per_element",
                "memory_saved_pct", "cache_mode", "fallbacks", "fused_calls", "policy_string"):
        assert key in report


def test_layers_on_request_are_the_full_report(client, tiny_engine):
    solo = tiny_engine.generate(MESSAGES, "turbo4", max_new_tokens=N)
    report = _chat(client, cache_report="layers").model_extra["tqbench"]["cache_report"]
    assert report == solo.cache_report.to_dict() | {"layer_count": 4, "bypassed_layer_count": 0}
    assert [row["layer"] for row in report["layers"]] == [0, 1, 2, 3]
    summary = _chat(client, cache_report="summary").model_extra["tqbench"]["cache_report"]
    assert summary == {k: v for k, v in report.items() if k not in PER_LAYER}


@pytest.mark.parametrize("bad", ["rows", "full", ""])
def test_unknown_report_value_is_a_400(client, bad):
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, cache_report=bad)
    assert err.value.status_code == 400
    assert err.value.body["param"] == "cache_report" and err.value.body["code"] == "invalid_value"
    assert err.value.body["message"].startswith(f"cache_report={bad!r} is invalid: send 'summary'")


@pytest.mark.parametrize("detail", [None, "layers"])
def test_stream_final_chunk_carries_the_same_tqbench_object(client, detail):
    extra = {"cache_report": detail} if detail else {}
    plain = _chat(client, **extra).model_extra["tqbench"]
    for include_usage in (False, True):
        chunks = list(client.chat.completions.create(
            model="tiny-random", messages=MESSAGES, max_tokens=N, stream=True, extra_body=extra or None,
            stream_options={"include_usage": True} if include_usage else None))
        carrying = [c.model_extra["tqbench"] for c in chunks if c.model_extra.get("tqbench")]
        assert len(carrying) == (2 if include_usage else 1)
        for streamed in carrying:
            assert set(streamed) == set(plain)
            assert {k: v for k, v in streamed.items() if k not in TIMINGS} == \
                {k: v for k, v in plain.items() if k not in TIMINGS}


def test_summary_does_not_grow_with_the_default_models_30_layers():
    """A random tiny model with the default model's layer count: the summary stays the same size (< 2 KB)
    and the per-layer rows, on request, number 30. Protected layers are counted, not listed."""
    from tqbench.engine.engine import Engine
    from tqbench.server import create_app

    engine = Engine.tiny(num_layers=DEFAULT_MODEL_LAYERS)
    app = create_app(engine, kv_policy="turbo4", max_new_tokens=N, max_queue=2)
    with LiveServer(app) as live:
        client = _client(live)
        status, _, body = live.request("GET", "/v1/last_cache_report")
        assert status == 404 and body["error"]["code"] == "no_report"
        assert "no request has finished yet" in body["error"]["message"]

        ext = _chat(client).model_extra["tqbench"]
        assert len(json.dumps(ext)) < 2048, len(json.dumps(ext))
        _assert_summary(ext["cache_report"], DEFAULT_MODEL_LAYERS)
        protected = _chat(client, kv_policy="turbo4,protect=first2+last2").model_extra["tqbench"]["cache_report"]
        _assert_summary(protected, DEFAULT_MODEL_LAYERS)
        assert protected["bypassed_layer_count"] == 4
        assert len(json.dumps(protected)) < 2048

        resp = _chat(client, cache_report="layers")
        full = resp.model_extra["tqbench"]["cache_report"]
        assert len(full["layers"]) == full["layer_count"] == DEFAULT_MODEL_LAYERS
        assert len(json.dumps(full)) > 2048  # the rows are what a summary leaves out

        status, _, last = live.request("GET", "/v1/last_cache_report")
        assert status == 200 and last["id"] == resp.id and last["object"] == "tqbench.cache_report"
        assert last["cache_report"] == full

        stream = list(client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=N,
                                                     stream=True))
        status, _, last = live.request("GET", "/v1/last_cache_report")
        assert status == 200 and last["id"] == stream[-1].id
        assert len(last["cache_report"]["layers"]) == DEFAULT_MODEL_LAYERS  # always the full report
