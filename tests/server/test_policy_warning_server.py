"""A policy fitted on another model: ``tqbench serve`` says so at start-up, and every response carries it where
an OpenAI client sees it (``tqbench.policy_warning`` in the body, the ``X-TQBench-Policy-Warning`` header)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from serverkit import LiveServer, stream_chat

from tqbench.cli import main
from tqbench.engine.policy import shipped_policy_path

pytestmark = pytest.mark.server

SHIPPED = "smollm2-alloc-2.5bit"
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 4}
HEADER = "X-TQBench-Policy-Warning"


def fitting_artifact(tmp_path):
    """A policy file fitted on the default model whose layers also exist in the tiny model (no overrides)."""
    text = shipped_policy_path(SHIPPED).read_text(encoding="utf-8")
    path = tmp_path / "from-smollm2.toml"
    path.write_text('format = "tqbench-policy/1"\n\n[policy]\nk = "turbo3"\nv = "turbo2"\nsink = 4\n\n'
                    + text[text.index("[model]"):], encoding="utf-8")
    return path


def _header(headers: dict) -> str | None:
    return {k.lower(): v for k, v in headers.items()}.get(HEADER.lower())


def test_default_policy_fitted_elsewhere_is_in_every_response(tiny_engine, tmp_path):
    from tqbench.server import create_app

    warning = tiny_engine.policy_warning(str(fitting_artifact(tmp_path)))
    assert warning.startswith("this policy was fitted on SmolLM2-135M-Instruct (fingerprint fd81e99705258ac1)")
    app = create_app(tiny_engine, kv_policy=str(fitting_artifact(tmp_path)), max_new_tokens=8,
                     model_aliases=("tiny",))
    assert app.state.server.policy_warning == warning
    with LiveServer(app) as live:
        status, headers, d = live.request("POST", "/v1/chat/completions", BODY)
        assert status == 200, d
        assert d["tqbench"]["policy_warning"] == warning and _header(headers) == warning
        status, headers, _, events = stream_chat(live.port, BODY)
        assert status == 200 and _header(headers) == warning
        assert events[-2]["tqbench"]["policy_warning"] == warning
        # a request that picks a preset has nothing to warn about
        status, headers, d = live.request("POST", "/v1/chat/completions", {**BODY, "kv_policy": "turbo4"})
        assert status == 200 and d["tqbench"]["policy_warning"] is None and _header(headers) is None


def test_a_shipped_allocation_by_name_says_where_it_was_fitted(live_server, tiny_engine):
    status, _, d = live_server.request("POST", "/v1/chat/completions", {**BODY, "kv_policy": SHIPPED})
    assert status == 400 and d["error"]["param"] == "kv_policy"
    assert d["error"]["message"].startswith(f"kv_policy='{SHIPPED}' is invalid: layer index 12 is out of range")
    assert tiny_engine.policy_warning(SHIPPED) in d["error"]["message"]


def test_serve_prints_the_warning_at_start_up(tmp_path, monkeypatch, tiny_engine):
    import uvicorn

    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *a, **k: None)  # start up, then return at once
    r = CliRunner().invoke(main, ["serve", "--model", "tiny", "--port", "0", "--kv-policy",
                                  str(fitting_artifact(tmp_path))])
    assert r.exit_code == 0, r.output
    warning = tiny_engine.policy_warning(str(fitting_artifact(tmp_path)))
    assert f"warning: kv_policy from-smollm2: {warning}" in r.stderr.splitlines()


def test_serve_refuses_the_shipped_allocation_on_a_smaller_model_and_says_why(tiny_engine):
    r = CliRunner().invoke(main, ["serve", "--model", "tiny", "--port", "0", "--kv-policy",
                                  str(shipped_policy_path(SHIPPED))])
    assert r.exit_code == 2
    warning = tiny_engine.policy_warning(SHIPPED)
    lines = r.stderr.strip().splitlines()
    assert f"warning: kv_policy {SHIPPED}: {warning}" in lines
    assert lines[-1].startswith("error: layer index 12 is out of range for a model with 4 layers")
    assert lines[-1].endswith(warning)
