"""The official ``openai`` client against a real uvicorn server serving the tiny model."""

from __future__ import annotations

import openai
import pytest
from serverkit import CEILING

from tqbench.engine.generate import Sampling
from tqbench.engine.policy import parse_policy

pytestmark = pytest.mark.server

MESSAGES = [{"role": "user", "content": "Name three colours."}]
N = 12


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=CEILING)


@pytest.fixture(scope="module")
def solo_chat(tiny_engine, live_server):
    """What the engine itself says, greedy, under the server's default policy (the server is idle)."""
    return tiny_engine.generate(MESSAGES, "turbo4", max_new_tokens=N, stop_at_eos=True)


def test_models_and_health(client, live_server):
    assert [m.id for m in client.models.list().data] == ["tiny-random"]
    status, _, body = live_server.request("GET", "/health")
    assert status == 200 and body["status"] == "ok" and body["kv_policy"] == "turbo4"
    status, _, body = live_server.request("GET", "/v1/kv_policies")
    assert status == 200 and body["default"] == "turbo4" and {"fp16", "turbo4", "q8k-q8v"} <= set(body["presets"])


def test_chat_matches_engine_with_usage_and_cache_report(client, solo_chat):
    resp = client.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=N, temperature=0)
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == solo_chat.text
    assert choice.finish_reason == ("length" if solo_chat.stopped_by == "max_new_tokens" else "stop")
    assert resp.usage.prompt_tokens == solo_chat.input_tokens
    assert resp.usage.completion_tokens == solo_chat.output_tokens
    assert resp.usage.total_tokens == solo_chat.input_tokens + solo_chat.output_tokens
    ext = resp.model_extra["tqbench"]
    assert ext["token_ids"] == solo_chat.token_ids
    report = ext["cache_report"]
    assert report["kv_policy"] == "turbo4" and report["cache_mode"] == "compressed"
    assert report["tokens"] == solo_chat.input_tokens + solo_chat.output_tokens - 1
    full = solo_chat.cache_report.to_dict()  # by default: the engine's report without its per-layer lists
    summary = {k: v for k, v in full.items() if k not in ("layers", "bypassed_layers")}
    assert report == summary | {"layer_count": 4, "bypassed_layer_count": 0}


def test_chat_stream_with_usage(client, solo_chat):
    chunks = list(client.chat.completions.create(
        model="tiny-random", messages=MESSAGES, max_tokens=N, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == solo_chat.text
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1
    assert finish[0].model_extra["tqbench"]["cache_report"]["kv_policy"] == "turbo4"
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.completion_tokens == solo_chat.output_tokens
    assert last.usage.prompt_tokens == solo_chat.input_tokens
    assert last.model_extra["tqbench"]["token_ids"] == solo_chat.token_ids


def test_completion_stream_and_not(client, tiny_engine):
    solo = tiny_engine.generate("The quick brown fox", "turbo4", max_new_tokens=N, chat=False)
    resp = client.completions.create(model="tiny-random", prompt="The quick brown fox", max_tokens=N)
    assert resp.choices[0].text == solo.text
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (solo.input_tokens, solo.output_tokens)
    chunks = list(client.completions.create(model="tiny-random", prompt="The quick brown fox", max_tokens=N,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == solo.text
    assert chunks[-1].choices[0].finish_reason == {"max_new_tokens": "length", "eos": "stop"}[solo.stopped_by]
    assert chunks[-1].usage.completion_tokens == solo.output_tokens  # usage even without include_usage
    assert all(c.usage is None for c in chunks[:-1])
    # the cache holds the prompt and every generated token but the last (never fed back)
    assert chunks[-1].model_extra["tqbench"]["cache_report"]["tokens"] == solo.cache_report.tokens \
        == solo.input_tokens + solo.output_tokens - 1


def _answer(client, messages):
    resp = client.chat.completions.create(model="tiny-random", messages=messages, max_tokens=N)
    return resp.choices[0].message.content, resp.model_extra["tqbench"]["token_ids"], resp.usage.prompt_tokens


def test_text_content_parts_answer_like_the_same_text_as_a_string(client, solo_chat):
    """OpenAI joins text parts in order with nothing between them: "Name three " + "colours." is the prompt."""
    parts = [{"type": "text", "text": "Name three "}, {"type": "text", "text": "colours."}]
    got = _answer(client, [{"role": "user", "content": parts}])
    assert got == (solo_chat.text, solo_chat.token_ids, solo_chat.input_tokens)
    assert got == _answer(client, MESSAGES)
    for role in ("system", "developer"):  # text parts are accepted for every role
        as_parts = _answer(client, [{"role": role, "content": [{"type": "text", "text": "Be brief."},
                                                               {"type": "text", "text": " Use lists."}]},
                                    *MESSAGES])
        assert as_parts == _answer(client, [{"role": role, "content": "Be brief. Use lists."}, *MESSAGES])


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
    {"type": "file", "file": {"file_id": "file-abc"}},
], ids=lambda p: p["type"])
def test_non_text_part_is_a_clear_400(client, part):
    content = [{"type": "text", "text": "What is in this?"}, part]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-random", max_tokens=N,
                                       messages=[{"role": "user", "content": content}])
    assert err.value.status_code == 400
    body = err.value.body
    assert body["message"].startswith(f"messages.0.content.1 has type '{part['type']}': only text parts")
    assert body["param"] == "messages.0.content.1.type" and body["code"] == "invalid_value"


def test_kv_policy_extension(client, tiny_engine):
    solo = tiny_engine.generate(MESSAGES, "q8k-q8v", max_new_tokens=N)
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=N,
                                          extra_body={"kv_policy": "q8k-q8v"})
    ext = resp.model_extra["tqbench"]
    assert ext["kv_policy"] == parse_policy("q8k-q8v").label
    assert ext["cache_report"]["policy_string"] == solo.cache_report.policy_string
    assert ext["cache_report"]["compressed_storage_bytes"] == solo.cache_report.compressed_storage_bytes
    assert resp.choices[0].message.content == solo.text
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MESSAGES, extra_body={"kv_policy": "k=turbo9"})
    assert err.value.body["code"] == "invalid_kv_policy"


def test_stop_sequence_is_cut_and_not_returned(client, tiny_engine):
    solo = tiny_engine.generate(MESSAGES, "turbo4", max_new_tokens=N, stop_at_eos=False)
    text = solo.text
    stop = text[4:6]
    assert stop and len(text) > 6
    want = text[: text.find(stop)]
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=N, stop=[stop],
                                          extra_body={"ignore_eos": True})
    assert resp.choices[0].message.content == want
    assert resp.choices[0].finish_reason == "stop"
    assert resp.model_extra["tqbench"]["stopped_by"] == "stop"
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=N, stop=stop,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want


def test_seeded_sampling_is_reproducible(client, tiny_engine):
    solo = tiny_engine.generate(MESSAGES, "turbo4", max_new_tokens=N,
                                sampling=Sampling(temperature=0.9, top_p=0.95, seed=7))
    texts = [client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=N, temperature=0.9,
                                            top_p=0.95, seed=7).choices[0].message.content for _ in range(2)]
    assert texts == [solo.text, solo.text]


def test_api_key(tiny_engine):
    from serverkit import LiveServer

    from tqbench.server import create_app

    app = create_app(tiny_engine, max_new_tokens=8, max_queue=2, api_key="s3cret")
    with LiveServer(app) as live:
        url = live.base_url + "/v1"
        with pytest.raises(openai.AuthenticationError) as err:
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        assert "invalid API key" in err.value.body["message"]
        status, headers, body = live.request("POST", "/v1/chat/completions", {"messages": MESSAGES})
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert body["error"]["message"].startswith("missing API key")
        assert live.request("GET", "/health")[0] == 200
        good = openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0)
        resp = good.chat.completions.create(model="tiny-random", messages=MESSAGES, max_tokens=3,
                                            extra_body={"ignore_eos": True})
        assert (resp.usage.completion_tokens, resp.choices[0].finish_reason) == (3, "length")
        assert resp.choices[0].message.content == tiny_engine.generate(
            MESSAGES, "turbo4", max_new_tokens=3, stop_at_eos=False).text


def test_chat_stream_with_logprobs(client):
    """Streamed logprobs in the chunk shape the official client parses: each content chunk carries the
    ``choices[0].logprobs.content`` entries of its tokens; together they are the non-streamed response's."""
    kwargs = dict(model="tiny-random", messages=MESSAGES, max_tokens=N, temperature=0, logprobs=True,
                  top_logprobs=3, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    want = whole.choices[0].logprobs.content
    assert len(entries) == len(want) == N
    assert [(e.token, e.logprob, e.bytes) for e in entries] == [(e.token, e.logprob, e.bytes) for e in want]
    assert [[(t.token, t.logprob) for t in e.top_logprobs] for e in entries] == \
        [[(t.token, t.logprob) for t in e.top_logprobs] for e in want]
    assert all(len(e.top_logprobs) == 3 for e in entries)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    # logprobs ride on content chunks (the role chunk and the finish chunk carry none)
    assert chunks[0].choices[0].logprobs is None and chunks[-1].choices[0].finish_reason == "length"


def test_completion_stream_with_logprobs(client):
    kwargs = dict(model="tiny-random", prompt="Once upon a time", max_tokens=N, temperature=0, logprobs=2,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0].logprobs
    chunks = list(client.completions.create(**kwargs, stream=True))
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == whole.tokens
    assert [x for p in parts for x in p.token_logprobs] == whole.token_logprobs
    assert [x for p in parts for x in p.top_logprobs] == whole.top_logprobs
    assert [x for p in parts for x in p.text_offset] == whole.text_offset
