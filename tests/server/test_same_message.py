"""The same bad value gets the same message, from one definition (``tqbench.engine.request``), through the
engine API, the CLI and the server. The server names a field as its clients send it (``max_tokens``), the CLI
as its flag (``--max-new-tokens``); the rule and its reason are the engine's (``RequestError.spelled``). (On ``/v1/completions``, where ``echo`` exists, a 0
also says how it would be allowed.)"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from tqbench.cli.group import main
from tqbench.engine import GenerationRequest, RequestError
from tqbench.engine.request import PromptTooLongError, check_max_new_tokens, check_top_p

pytestmark = pytest.mark.server

LONG = "word " * 5000  # > the tiny model's 4096-token context


def engine_message(tiny_engine, **kwargs) -> str:
    """The message the engine API gives: a request built, then generated (as a library user would)."""
    prompt = kwargs.pop("prompt", "Hello")
    try:
        req = GenerationRequest(**kwargs)
        tiny_engine.generate(prompt, "turbo4", max_new_tokens=req.max_new_tokens, sampling=req.sampling)
    except ValueError as exc:
        return str(exc)
    raise AssertionError("the engine accepted a bad request")


def cli_message(*args) -> str:
    r = CliRunner().invoke(main, ["--headless", "bench", "--model", "tiny", *args])
    assert r.exit_code == 2, r.output
    lines = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1, r.stderr
    return lines[0].removeprefix("error: ")


def server_message(live_server, body: dict, field: str) -> str:
    status, _, d = live_server.request("POST", "/v1/chat/completions", {"model": "tiny", **body})
    assert status == 400, d
    assert d["error"]["param"] == field
    return d["error"]["message"]


def definition(rule, value, field: str) -> str:
    with pytest.raises(RequestError) as info:
        rule(value)
    return info.value.spelled(field)


def test_max_new_tokens_zero(tiny_engine, live_server):
    engine = engine_message(tiny_engine, max_new_tokens=0)
    cli = cli_message("--max-new-tokens", "0")
    server = server_message(live_server, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0},
                            "max_tokens")
    assert engine == definition(check_max_new_tokens, 0, "max_new_tokens") == \
        "max_new_tokens=0 is invalid: ask for at least 1 token"
    assert cli == definition(check_max_new_tokens, 0, "--max-new-tokens") == \
        "--max-new-tokens=0 is invalid: ask for at least 1 token"
    assert server == definition(check_max_new_tokens, 0, "max_tokens") == \
        "max_tokens=0 is invalid: ask for at least 1 token"


def test_top_p_two(tiny_engine, live_server):
    engine = engine_message(tiny_engine, top_p=2.0)
    cli = cli_message("--top-p", "2")
    server = server_message(live_server, {"messages": [{"role": "user", "content": "Hi"}], "top_p": 2}, "top_p")
    assert engine == server == definition(check_top_p, 2.0, "top_p") == "top_p=2 is invalid: use a number in (0, 1]"
    assert cli == definition(check_top_p, 2.0, "--top-p") == "--top-p=2 is invalid: use a number in (0, 1]"


def test_a_prompt_longer_than_the_context(tiny_engine, live_server):
    engine = engine_message(tiny_engine, prompt=LONG, max_new_tokens=8)
    cli = cli_message("--prompt", LONG, "--max-new-tokens", "8")
    server = server_message(live_server, {"messages": [{"role": "user", "content": LONG}], "max_tokens": 8},
                            "messages")
    with pytest.raises(PromptTooLongError) as info:
        tiny_engine.encode_prompt(LONG)
    n = info.value.prompt_tokens
    assert engine == cli == server == (f"the prompt has {n} tokens and tiny-random has a context of 4096 tokens: "
                                       "no room is left for new tokens; shorten the prompt")
