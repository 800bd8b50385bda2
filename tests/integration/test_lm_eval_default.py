"""The default model behind ``tqbench serve``: echo log-probabilities equal a direct forward pass (fp16 policy),
and lm-evaluation-harness's ``local-completions`` runs the shipped log-likelihood task against it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.integration.default_model import require_default_model
from tqbench.engine.engine import Engine

pytestmark = pytest.mark.integration
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))


@pytest.fixture(scope="module")
def default_engine():
    require_default_model()
    return Engine.load("default", device="cpu", threads=1)


def test_echo_logprobs_match_a_direct_forward_pass_and_lm_eval_runs(default_engine, tmp_path):
    pytest.importorskip("lm_eval")
    from serverkit import LiveServer, run_lm_eval

    from tqbench.server import create_app

    prompt = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
    ids = default_engine.tokenizer(prompt)["input_ids"]
    with torch.inference_mode():
        ref = torch.log_softmax(default_engine.model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    app = create_app(default_engine, kv_policy="fp16", max_new_tokens=16)
    with LiveServer(app) as live:
        status, _, body = live.request("POST", "/v1/completions", {
            "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0})
        assert status == 200, body
        lp = body["choices"][0]["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) and lp["token_logprobs"][0] is None
        worst = max(abs(lp["token_logprobs"][i] - float(ref[i - 1, ids[i]])) for i in range(1, len(ids)))
        assert worst < 1e-3, worst
        result, samples = run_lm_eval(live.base_url, "local-completions", default_engine.name, "tqbench_mc",
                                      tmp_path, limit=8)
    assert len(samples) == 8
    assert result["acc,none"] >= 0.5  # a 135M instruct model knows most of these; chance is 0.25
