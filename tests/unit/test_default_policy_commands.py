"""``bench``, ``tasks`` and ``serve`` without a policy run the model's default (``engine.policy.default``), as
``validate`` does: turbo4, or the measured hybrid default on a model mixing sliding-window and global layers."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tqbench.cli import main
from tqbench.engine.policy import HYBRID_DEFAULT_POLICY, parse_policy

HYBRID = parse_policy(HYBRID_DEFAULT_POLICY)


@pytest.mark.parametrize(("model", "want"), [("tiny-gemma3_text", HYBRID), ("tiny", parse_policy("turbo4"))])
def test_bench_without_a_policy_runs_the_models_default(model, want):
    r = CliRunner().invoke(main, ["--headless", "bench", "--model", model, "--prompt", "Hi there", "--max-new-tokens",
                                  "2", "--threads", "1", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["cache_report"]["policy_string"] == want.to_string()


def test_tasks_without_a_candidate_runs_the_models_default(tmp_path, monkeypatch):
    monkeypatch.setenv("TQBENCH_CACHE_DIR", str(tmp_path))
    r = CliRunner().invoke(main, ["--headless", "tasks", "--model", "tiny-gemma3_text", "--context", "512", "--tasks",
                                  "variable_tracking", "--samples", "1", "--protocol", "aware", "--threads", "1", "--json"])
    assert r.exit_code in (0, 1), r.output
    d = json.loads(r.output[r.output.index("{"):])
    assert d["candidate"] == HYBRID.label, {k: d[k] for k in d if "cand" in k}


def test_serve_without_a_policy_serves_the_models_default(monkeypatch):
    import uvicorn

    apps = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *a, **k: apps.append(self.config.app))
    for model, want in (("tiny-gemma3_text", HYBRID), ("tiny", parse_policy("turbo4"))):
        r = CliRunner().invoke(main, ["serve", "--model", model, "--port", "0", "--threads", "1"])
        assert r.exit_code == 0, r.output
        assert apps[-1].state.server.policy.label == want.label
        assert f"kv_policy {want.label}, cache mode" in r.output
