"""``tqbench serve`` on the command line: bad input is one line and exit code 2; fused mode serves."""

from __future__ import annotations

import socket

import pytest
from click.testing import CliRunner
from serverkit import LiveServer

from tqbench.cli import main

pytestmark = pytest.mark.server


def test_serve_is_registered_and_binds_loopback_by_default():
    result = CliRunner().invoke(main, ["serve", "--help"])
    assert result.exit_code == 0
    assert "--kv-policy" in result.output and "--max-queue" in result.output and "--api-key" in result.output
    assert "[default: 127.0.0.1]" in result.output
    assert "fused" in result.output


def test_unknown_policy_is_one_line_before_loading_the_model():
    result = CliRunner().invoke(main, ["serve", "--kv-policy", "turbo99"])
    assert result.exit_code == 2
    assert result.output.startswith("error: unknown policy preset 'turbo99'")
    assert len(result.output.strip().splitlines()) == 1


def test_taken_port_is_one_line():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        result = CliRunner().invoke(main, ["serve", "--model", "tiny", "--port", str(port)])
    assert result.exit_code == 2
    assert result.output.startswith(f"error: cannot bind 127.0.0.1:{port} (")
    assert result.output.strip().endswith("pick another --port")


def test_fused_cache_mode_serves():
    from tqbench.engine.engine import Engine
    from tqbench.server import create_app

    engine = Engine.tiny()  # its own model: fused mode reroutes the model's attention
    solo = engine.generate("abc", "turbo4", "fused", max_new_tokens=6, chat=False)
    with LiveServer(create_app(engine, kv_policy="turbo4", cache_mode="fused", max_new_tokens=16)) as live:
        status, _, body = live.request("POST", "/v1/completions", {"prompt": "abc", "max_tokens": 6})
    assert status == 200
    assert body["choices"][0]["text"] == solo.text
    report = body["tqbench"]["cache_report"]
    assert report["cache_mode"] == "fused" and report["fused_calls"] > 0


def test_max_new_tokens_zero_is_the_engine_rule_before_loading_the_model():
    result = CliRunner().invoke(main, ["serve", "--max-new-tokens", "0"])
    assert result.exit_code == 2
    assert result.output.strip() == "error: --max-new-tokens=0 is invalid: ask for at least 1 token"
