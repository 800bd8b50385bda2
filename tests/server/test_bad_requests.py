"""Bad requests get the OpenAI error shape, the right status and a message saying what to fix.

After the whole table the server is still healthy and still answers a good request.
"""

from __future__ import annotations

import json

import pytest
from serverkit import sse_events

pytestmark = pytest.mark.server

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
LONG = "a" * 5000  # byte-level tokenizer: 5000 tokens > the tiny model's 4096 context


def chat(**fields):
    return {"messages": MSG, **fields}


# (id, method, path, body, status, code, param, words the message must contain)
CASES = [
    ("empty-body", "POST", CHAT, "", 400, "invalid_json", None, "the request body is empty"),
    ("malformed-json", "POST", CHAT, '{"messages": [', 400, "invalid_json", None, "not valid JSON"),
    ("body-not-object", "POST", CHAT, "[1, 2]", 400, "invalid_json", None, "must be a JSON object"),
    ("missing-messages", "POST", CHAT, {"max_tokens": 4}, 422, "missing_field", "messages",
     "messages: Field required (add it to the request)"),
    ("messages-not-list", "POST", CHAT, {"messages": "hi"}, 422, "invalid_value", "messages", "send a JSON array"),
    ("message-without-role", "POST", CHAT, {"messages": [{"content": "hi"}]}, 422, "missing_field",
     "messages.0.role", "Field required"),
    ("message-without-content", "POST", CHAT, {"messages": [{"role": "user"}]}, 422, "missing_field",
     "messages.0.content", "messages.0.content: Field required (add it to the request)"),
    ("assistant-without-content", "POST", CHAT, {"messages": [*MSG, {"role": "assistant"}, *MSG]}, 422,
     "missing_field", "messages.1.content", "messages.1.content: Field required"),
    ("content-null", "POST", CHAT, {"messages": [{"role": "user", "content": None}]}, 422, "invalid_value",
     "messages.0.content", "messages.0.content: content is null: send a string or a list of content parts"),
    ("content-wrong-type", "POST", CHAT, {"messages": [{"role": "user", "content": 5}]}, 422, "invalid_value",
     "messages.0.content", "messages.0.content: send a string or a list of content parts"),
    ("temperature-string", "POST", CHAT, chat(temperature="hot"), 422, "invalid_value", "temperature",
     "send a number"),
    ("stream-not-bool", "POST", CHAT, chat(stream="yes"), 422, "invalid_value", "stream", "send true or false"),
    ("max-tokens-float", "POST", CHAT, chat(max_tokens=1.5), 422, "invalid_value", "max_tokens",
     "send an integer"),
    ("unknown-field", "POST", CHAT, chat(foo=1), 422, "invalid_value", "foo", "remove this field"),
    ("empty-messages", "POST", CHAT, {"messages": []}, 400, "invalid_value", "messages", "messages is empty"),
    ("unknown-role", "POST", CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "invalid_value",
     "messages.0.role", "'robot' is unknown: use one of system"),
    ("image-part", "POST", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "invalid_value", "messages.0.content.0.type", "only text parts"),
    ("image-part-with-url", "POST", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     400, "invalid_value", "messages.0.content.1.type", "messages.0.content.1 has type 'image_url': only text parts"),
    ("audio-part-in-system", "POST", CHAT, {"messages": [{"role": "system", "content": [
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]}, *MSG]},
     400, "invalid_value", "messages.0.content.0.type", "has type 'input_audio': only text parts"),
    ("content-list-of-strings", "POST", CHAT, {"messages": [{"role": "user", "content": ["hi"]}]}, 422,
     "invalid_value", "messages.0.content", 'part 0 must be an object with a string "type"'),
    ("text-part-without-text", "POST", CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     422, "invalid_value", "messages.0.content", 'part 0 is a text part without a string "text"'),
    ("text-part-extra-field", "POST", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}]},
     422, "invalid_value", "messages.0.content", "part 0 has 'cache_control': a text part takes only"),
    ("cache-report-unknown", "POST", CHAT, chat(cache_report="rows"), 400, "invalid_value", "cache_report",
     "cache_report='rows' is invalid: send 'summary'"),
    ("cache-report-not-string", "POST", CHAT, chat(cache_report=True), 422, "invalid_value", "cache_report",
     "send a string"),
    ("max-tokens-zero", "POST", CHAT, chat(max_tokens=0), 400, "invalid_value", "max_tokens",
     "max_tokens=0 is invalid: ask for at least 1 token"),
    ("max-tokens-negative", "POST", CHAT, chat(max_completion_tokens=-3), 400, "invalid_value",
     "max_completion_tokens", "max_completion_tokens=-3 is invalid"),
    ("max-tokens-over-cap", "POST", CHAT, chat(max_tokens=513), 400, "invalid_value", "max_tokens",
     "above this server's cap of 512 tokens (tqbench serve --max-new-tokens): ask for at most 512"),
    ("n-2", "POST", CHAT, chat(n=2), 400, "unsupported_parameter", "n", "n=2 is not supported"),
    ("penalty", "POST", CHAT, chat(frequency_penalty=0.5), 400, "unsupported_parameter", "frequency_penalty",
     "penalties are not implemented"),
    ("temperature-too-high", "POST", CHAT, chat(temperature=3.0), 400, "invalid_value", "temperature",
     "use a number from 0 (greedy) to 2"),
    ("top-p-zero", "POST", CHAT, chat(top_p=0.0), 400, "invalid_value", "top_p", "use a number in (0, 1]"),
    ("too-many-stops", "POST", CHAT, chat(stop=["a", "b", "c", "d", "e"]), 400, "invalid_value", "stop",
     "send at most 4"),
    ("stream-options-without-stream", "POST", CHAT, chat(stream_options={"include_usage": True}), 400,
     "invalid_value", "stream_options", "only allowed with stream=true"),
    ("unknown-model", "POST", CHAT, chat(model="gpt-4o"), 404, "model_not_found", "model",
     "model 'gpt-4o' is not served here: this server runs 'tiny-random'"),
    ("unknown-kv-policy", "POST", CHAT, chat(kv_policy="turbo99"), 400, "invalid_kv_policy", "kv_policy",
     "kv_policy='turbo99' is invalid"),
    ("kv-policy-file", "POST", CHAT, chat(kv_policy="/etc/passwd.json"), 400, "invalid_kv_policy", "kv_policy",
     "the server does not read files"),
    ("prompt-too-long", "POST", CHAT, {"messages": [{"role": "user", "content": LONG}]}, 400,
     "context_length_exceeded", "messages",
     "and tiny-random has a context of 4096 tokens: no room is left for new tokens; shorten the prompt"),
    ("prompt-plus-max-tokens", "POST", COMP, {"prompt": "a" * 4000, "max_tokens": 200}, 400,
     "context_length_exceeded", "max_tokens", "lower max_tokens to at most 96"),
    ("completion-empty-prompt", "POST", COMP, {"prompt": "  "}, 400, "invalid_value", "prompt", "prompt is empty"),
    ("completion-two-prompts", "POST", COMP, {"prompt": ["a", "b"]}, 400, "invalid_value", "prompt",
     "send one prompt"),
    ("completion-missing-prompt", "POST", COMP, {"max_tokens": 3}, 422, "missing_field", "prompt",
     "prompt: Field required"),
    ("unknown-route", "POST", "/v1/embeddings", {"input": "x"}, 404, None, None, "no route POST /v1/embeddings"),
    ("wrong-method", "GET", CHAT, None, 405, None, None, "GET is not allowed on /v1/chat/completions"),
    ("unknown-model-card", "GET", "/v1/models/nope", None, 404, "model_not_found", "model", "'nope' is not served"),
]


def test_form_content_type_names_the_header(live_server):
    status, _, data = live_server.request("POST", CHAT, json.dumps(chat()),
                                          headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 400
    assert data["error"]["message"] == ("the request body must be JSON sent with 'Content-Type: application/json' "
                                        "(got application/x-www-form-urlencoded)")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request(live_server, case):
    _, method, path, body, status, code, param, words = case
    got, headers, data = live_server.request(method, path, body)
    assert got == status, data
    assert set(data) == {"error"}
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert words in err["message"]
    assert err["code"] == code
    assert err["param"] == param
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_server_survives_the_table(live_server):
    for _, method, path, body, *_ in CASES:
        live_server.request(method, path, body)
    status, _, health = live_server.request("GET", "/health")
    assert status == 200 and health["status"] == "ok"
    assert health["requests"]["failed"] == 0
    status, _, good = live_server.request("POST", CHAT, chat(max_tokens=4, ignore_eos=True))
    assert status == 200
    assert (good["usage"]["completion_tokens"], good["choices"][0]["finish_reason"]) == (4, "length")
    assert good["choices"][0]["message"]["role"] == "assistant"


class _Exploding:
    """Delegates to the real engine, but a sequence's step raises after its first generated token."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def sequence(self, *args, **kwargs):
        seq = self.engine.sequence(*args, **kwargs)
        step = seq.step

        def exploding_step():
            if seq.result.output_tokens >= 1:
                raise RuntimeError("boom")
            return step()

        seq.step = exploding_step
        return seq

    def decode_step(self, seqs):
        return self.engine.decode_step(seqs)


def test_engine_failure_is_a_500_in_openai_shape_and_the_server_lives_on(live_server):
    worker = live_server.state.worker
    real = worker.engine
    worker.engine = _Exploding(real)
    try:
        status, _, data = live_server.request("POST", CHAT, chat(max_tokens=4))
        assert status == 500
        assert data["error"] == {"message": "generation failed: RuntimeError: boom", "type": "server_error",
                                 "param": None, "code": "generation_failed"}
        status, _, raw = live_server.request("POST", CHAT, json.dumps(chat(max_tokens=4, stream=True)))
        assert status == 200
        events = sse_events(raw)
        assert events[-2]["error"]["message"] == "generation failed: RuntimeError: boom"
        assert events[-1] == "[DONE]"
    finally:
        worker.engine = real
    status, _, health = live_server.request("GET", "/health")
    assert status == 200 and health["requests"]["failed"] == 2
    assert live_server.request("POST", CHAT, chat(max_tokens=2))[0] == 200
