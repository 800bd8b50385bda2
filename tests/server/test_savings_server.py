"""The server tells what the engine tells: each response's ``tqbench.savings`` is ``Engine.savings`` of the
request's policy against fp16 at the length its cache held (a policy that stores more bytes says so, why, and
from which length it saves), streamed or not; ``/health`` gives the default policy's break-even length."""

from __future__ import annotations

import pytest
from serverkit import stream_chat

from tqbench.engine.cache.savings import break_even_tokens

pytestmark = pytest.mark.server

#: stores more bytes than fp16 below 211 tokens on the tiny model (a 200-token full-precision window)
LONG_WINDOW = "k=turbo4,v=turbo4,sink=4,recent=200"


def _body(**extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 4,
            **extra}


def test_a_policy_that_saves_nothing_says_so_with_the_engines_words(live_server, tiny_engine):
    status, _, d = live_server.request("POST", "/v1/chat/completions", _body(kv_policy=LONG_WINDOW))
    assert status == 200, d
    ext = d["tqbench"]
    tokens = ext["cache_report"]["tokens"]
    want = tiny_engine.savings(LONG_WINDOW, "fp16", tokens)
    assert ext["savings"] == want.to_dict()
    assert ext["savings"]["saves"] is False and ext["savings"]["break_even_tokens"] == 211
    assert ext["savings"]["message"].startswith(f"saves nothing at {tokens} tokens: ")
    assert ext["cache_report"]["memory_saved_pct"] <= 0  # the report's own numbers agree with the rule


def test_the_default_policy_saves_and_streams_the_same_savings(live_server, tiny_engine):
    status, _, d = live_server.request("POST", "/v1/chat/completions", _body())
    assert status == 200, d
    ext = d["tqbench"]
    assert ext["savings"] == tiny_engine.savings("turbo4", "fp16", ext["cache_report"]["tokens"]).to_dict()
    assert ext["savings"]["saves"] is True and ext["savings"]["reasons"] == []  # the chat prompt is past 27 tokens
    status, _, _, events = stream_chat(live_server.port, _body())
    assert status == 200 and events[-1] == "[DONE]"
    assert events[-2]["tqbench"]["savings"] == ext["savings"]


def test_health_gives_the_default_policys_break_even(live_server, tiny_engine):
    status, _, health = live_server.request("GET", "/health")
    assert status == 200
    assert health["kv_policy_break_even_tokens"] == break_even_tokens(
        "turbo4", "fp16", tiny_engine.geometry, tiny_engine.max_context) == 27
    assert live_server.state.break_even_line() == (
        "kv_policy turbo4 stores fewer bytes than fp16 from 27 tokens on (shorter requests save nothing: "
        "tqbench.savings in each response)")
