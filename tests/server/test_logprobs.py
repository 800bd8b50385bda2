"""Log-probabilities over HTTP: echo + logprobs + max_tokens 0 (what lm-evaluation-harness sends), legacy
completion logprobs, chat logprobs through the official openai client, each checked against a direct forward
pass of the model (the fp16 policy stores K/V losslessly, so the server's numbers must be the model's)."""

from __future__ import annotations

import math

import openai
import pytest
import torch
from serverkit import CEILING, LiveServer

pytestmark = pytest.mark.server

PROMPT = "The lighthouse keeper climbed the stairs"
TOL = 1e-4


@pytest.fixture(scope="module")
def fp16_server(tiny_engine):
    from tqbench.server import create_app

    app = create_app(tiny_engine, kv_policy="fp16", max_new_tokens=64, max_queue=8, model_aliases=("tiny",))
    with LiveServer(app) as live:
        yield live


def direct_logprobs(engine, ids: list[int]) -> torch.Tensor:
    """log-softmax of one plain forward pass over ``ids`` (no cache): row i predicts token i+1."""
    with torch.inference_mode():
        logits = engine.model(input_ids=torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), -1)


def test_echo_logprobs_max_tokens_0_match_a_direct_forward_pass(fp16_server, tiny_engine):
    status, _, body = fp16_server.request("POST", "/v1/completions", {
        "model": "tiny", "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0})
    assert status == 200, body
    ids = tiny_engine.tokenizer(PROMPT)["input_ids"]
    choice = body["choices"][0]
    assert choice["text"] == PROMPT
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids)
    assert lp["tokens"] == [tiny_engine.tokenizer.decode([i]) for i in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = direct_logprobs(tiny_engine, ids)
    for i in range(1, len(ids)):
        assert abs(lp["token_logprobs"][i] - float(ref[i - 1, ids[i]])) < TOL, i
        (best_text, best_lp), = lp["top_logprobs"][i].items()
        best = int(ref[i - 1].argmax())
        assert best_text == tiny_engine.tokenizer.decode([best])
        assert abs(best_lp - float(ref[i - 1, best])) < TOL
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], lp["tokens"]))
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    assert body["tqbench"]["token_ids"] == [] and body["tqbench"]["prefill_chunk"] == 0


def test_lm_eval_request_token_ids_max_tokens_1(fp16_server, tiny_engine):
    """lm-eval 0.4.13 ``local-completions`` log-likelihood: token ids, echo, logprobs 1, max_tokens 1; it reads
    ``token_logprobs[ctxlen:-1]`` (the last entry is the generated token's)."""
    ids = tiny_engine.tokenizer(PROMPT)["input_ids"]
    status, _, body = fp16_server.request("POST", "/v1/completions", {
        "model": "tiny", "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
        "echo": True})
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    gen = body["tqbench"]["token_ids"]
    assert len(gen) == 1 and len(lp["token_logprobs"]) == len(ids) + 1
    ref = direct_logprobs(tiny_engine, ids + gen)
    for i in range(1, len(ids) + 1):
        assert abs(lp["token_logprobs"][i] - float(ref[i - 1, (ids + gen)[i]])) < TOL, i
    # greedy: the generated token is the top alternative, with the same log-probability
    assert math.isclose(lp["token_logprobs"][-1], max(lp["top_logprobs"][-1].values()), abs_tol=1e-9)
    assert body["choices"][0]["text"] == tiny_engine.tokenizer.decode(ids) + tiny_engine.tokenizer.decode(gen)


def test_completion_logprobs_without_echo_cover_the_generated_tokens(fp16_server, tiny_engine):
    status, _, body = fp16_server.request("POST", "/v1/completions", {
        "prompt": PROMPT, "logprobs": 3, "max_tokens": 6, "ignore_eos": True})
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    gen = body["tqbench"]["token_ids"]
    assert len(gen) == 6 and lp["tokens"] == [tiny_engine.tokenizer.decode([t]) for t in gen]
    ids = tiny_engine.tokenizer(PROMPT)["input_ids"]
    ref = direct_logprobs(tiny_engine, ids + gen)
    for k, t in enumerate(gen):
        row = ref[len(ids) - 1 + k]
        assert abs(lp["token_logprobs"][k] - float(row[t])) < TOL
        assert len(lp["top_logprobs"][k]) <= 3  # distinct token texts; ids whose text repeats collapse
        assert math.isclose(max(lp["top_logprobs"][k].values()), float(row.max()), abs_tol=TOL)


def test_chat_logprobs_through_the_openai_client(fp16_server, tiny_engine):
    client = openai.OpenAI(base_url=fp16_server.base_url + "/v1", api_key="unused", max_retries=0,
                           timeout=CEILING)
    messages = [{"role": "user", "content": "Name three colours."}]
    resp = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, logprobs=True,
                                          top_logprobs=2, extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    gen = resp.model_extra["tqbench"]["token_ids"]
    assert len(content) == len(gen) == resp.usage.completion_tokens == 8
    prompt_ids = tiny_engine.encode_prompt(messages)[0].tolist()
    ref = direct_logprobs(tiny_engine, prompt_ids + gen)
    for k, (entry, t) in enumerate(zip(content, gen)):
        row = ref[len(prompt_ids) - 1 + k]
        assert entry.token == tiny_engine.tokenizer.decode([t])
        assert bytes(entry.bytes).decode() == entry.token
        assert abs(entry.logprob - float(row[t])) < TOL
        assert len(entry.top_logprobs) == 2
        top2 = row.topk(2)
        assert [abs(a.logprob - float(b)) < TOL for a, b in zip(entry.top_logprobs, top2.values)] == [True, True]
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy picks the top token
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize(("path", "body", "param", "fragment"), [
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", "from 0 to 20"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs", "send an integer"),
    ("/v1/completions", {"prompt": "x", "top_logprobs": 2}, "top_logprobs", "send the number of alternatives"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", "0 is allowed with echo=true"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, "echo",
     "not supported with stream=true"),
    ("/v1/completions", {"prompt": [[5, 999999]], "echo": True, "max_tokens": 0}, "prompt", "outside"),
    ("/v1/completions", {"prompt": [[]], "max_tokens": 1}, "prompt", "empty list of token ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, "logprobs",
     "send true or false"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs",
     "needs logprobs=true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs", "from 0 to 20"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo",
     "/v1/completions field"),
])
def test_bad_logprob_requests_say_what_to_send(fp16_server, path, body, param, fragment):
    status, _, data = fp16_server.request("POST", path, body)
    assert status == 400, data
    assert data["error"]["param"] == param
    assert fragment in data["error"]["message"]


def test_tokenizer_endpoints_round_trip(fp16_server, tiny_engine):
    status, _, info = fp16_server.request("GET", "/tokenizer_info")
    assert status == 200 and info["eos_token"] == tiny_engine.tokenizer.eos_token
    status, _, tok = fp16_server.request("POST", "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})
    assert status == 200 and tok["tokens"] == tiny_engine.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert tok["count"] == len(tok["tokens"])
    status, _, back = fp16_server.request("POST", "/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and back["prompt"] == tiny_engine.tokenizer.decode(tok["tokens"])
    status, _, chat = fp16_server.request("POST", "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200
    assert chat["tokens"] == tiny_engine.encode_prompt([{"role": "user", "content": "hi"}])[0].tolist()
    status, _, bad = fp16_server.request("POST", "/detokenize", {"tokens": [-1]})
    assert status == 400 and "outside" in bad["error"]["message"]
