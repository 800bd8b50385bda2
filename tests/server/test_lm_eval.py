"""lm-evaluation-harness run as a user would (``python -m lm_eval`` in a subprocess, offline) against a real
uvicorn server on the tiny model: a log-likelihood task through ``local-completions`` (echo + logprobs) and a
generation task through ``local-chat-completions``. The tasks are local YAML over a JSONL file shipped in
tests/data/lm_eval; nothing touches the hub."""

from __future__ import annotations

import json
import math

import pytest
import torch
from serverkit import LiveServer, run_lm_eval

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.server

LIMIT = 4  # documents; each multiple-choice document is 4 log-likelihood requests


@pytest.fixture(scope="module")
def fp16_live(tiny_engine):
    from tqbench.server import create_app

    app = create_app(tiny_engine, kv_policy="fp16", max_new_tokens=64, max_queue=16)
    with LiveServer(app) as live:
        yield live


def _direct_loglikelihood(engine, context: str, continuation: str) -> float:
    """What lm-eval's ``loglikelihood`` means, from one plain forward pass: sum of the continuation tokens'
    log-probabilities (context and continuation tokenized as lm-eval does: whole minus context)."""
    whole = engine.tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    ctx = engine.tokenizer(context, add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        lp = torch.log_softmax(engine.model(input_ids=torch.tensor([whole])).logits[0].float(), -1)
    return float(sum(lp[i - 1, whole[i]] for i in range(len(ctx), len(whole))))


def test_lm_eval_local_completions_loglikelihood_matches_the_model(fp16_live, tiny_engine, tmp_path):
    before = fp16_live.state.worker.stats["completed"]
    result, samples = run_lm_eval(fp16_live.base_url, "local-completions", tiny_engine.name, "tqbench_mc",
                                  tmp_path, limit=LIMIT)
    assert 0.0 <= result["acc,none"] <= 1.0
    assert len(samples) == LIMIT
    assert fp16_live.state.worker.stats["completed"] - before == 4 * LIMIT  # one request per choice
    for sample in samples:
        assert sample["acc"] in (0.0, 1.0)
        lls = []
        for args, resp in zip(sample["arguments"].values(), sample["resps"]):
            context, continuation = args["arg_0"], args["arg_1"]
            ll = float(resp[0][0])  # the samples file stores (loglikelihood, is_greedy) as strings
            assert math.isclose(ll, _direct_loglikelihood(tiny_engine, context, continuation), abs_tol=1e-3)
            lls.append(ll)
        assert sample["acc"] == float(max(range(len(lls)), key=lls.__getitem__) == sample["doc"]["answer"])


def test_lm_eval_local_chat_completions_generation(fp16_live, tiny_engine, tmp_path):
    from tqbench.engine.generate import Sampling

    result, samples = run_lm_eval(fp16_live.base_url, "local-chat-completions", tiny_engine.name, "tqbench_gen",
                                  tmp_path, "--apply_chat_template", limit=2)
    assert result["exact_match,none"] in (0.0, 0.5, 1.0)
    assert len(samples) == 2
    for sample in samples:  # each answer is what the engine generates for that chat, cut at the first "\n"
        messages = json.loads(sample["arguments"]["gen_args_0"]["arg_0"][0])
        solo = tiny_engine.generate(messages, "fp16", max_new_tokens=8, sampling=Sampling(), stop=["\n"])
        assert sample["resps"][0][0] == solo.text.split("\n")[0]
