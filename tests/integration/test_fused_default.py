"""The fused mode on the real default model: the CLI gives the compressed mode's tokens in float64, fp32
teacher-forced agreement and logit deltas against compressed, and plain ``model.generate()`` runs fused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.default_model import require_default_model
from tqbench.engine.engine import Engine
from tqbench.engine.validate import corpus_ids

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PROMPT = (
    "A lighthouse keeper on a remote island kept a logbook for forty years. Every evening he wrote down the "
    "direction of the wind, the state of the sea, the ships that passed, and the birds that rested on the "
    "gallery rail. In two sentences, say why such a logbook is useful to historians."
)


def _engine(dtype: str) -> Engine:
    require_default_model()
    return Engine.load("default", device="cpu", dtype=dtype)


@pytest.mark.parametrize("policy", ["turbo4", "smollm2-head-2.5bit"])
def test_cli_bench_fused_equals_compressed_in_float64(policy):
    """The CLI check for turbo4 and a shipped per-head allocation with calibrated pcaq keys (q8k-int4v: the
    engine-level test in test_engine_default.py)."""
    tokens = {}
    for mode in ("compressed", "fused"):
        cmd = [sys.executable, "-m", "tqbench", "--headless", "bench", "--dtype", "float64", "--threads", "1",
               "--kv-policy", policy, "--cache-mode", mode, "--prompt", PROMPT, "--max-new-tokens", "8", "--json"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        data = json.loads(proc.stdout)
        tokens[mode] = data["token_ids"]
        rep = data["cache_report"]
        assert rep["cache_mode"] == mode
        if mode == "fused":
            assert rep["fused_calls"] > 0 and rep["fallbacks"] == {}
            assert list(rep["fused_impl"]) == ["native-cpu"]
    assert len(tokens["fused"]) == 8 and tokens["fused"] == tokens["compressed"]


@pytest.fixture(scope="module")
def engine32() -> Engine:
    return _engine("float32")


def _teacher_forced_logits(engine: Engine, ids: torch.Tensor, prefill: int, policy: str, mode: str):
    cache = engine.make_cache(policy, mode)
    out = []
    with torch.inference_mode():
        engine.model(input_ids=ids[:, :prefill], cache=cache, use_cache=True)
        for t in range(prefill, ids.shape[1]):
            out.append(engine.model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True).logits[0, -1].float())
    return torch.stack(out), cache.report()


@pytest.mark.parametrize("policy", ["turbo4", "q8k-int4v"])
def test_fp32_fused_agrees_with_compressed_teacher_forced(engine32, policy):
    """In fp32 a 1e-7 summation-order difference may flip a later layer's quantization step, so compare
    teacher-forced: top-1 agreement >= 0.99 and small logit deltas."""
    ids = corpus_ids(engine32.tokenizer, "rivers", 150)
    a, _ = _teacher_forced_logits(engine32, ids, 120, policy, "compressed")
    b, rep = _teacher_forced_logits(engine32, ids, 120, policy, "fused")
    assert rep.fused_calls == 30 * 30 and rep.fallbacks == {}
    top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    kl = torch.nn.functional.kl_div(torch.log_softmax(b, -1), torch.log_softmax(a, -1), log_target=True,
                                    reduction="none").sum(-1)
    delta = (a - b).abs().max().item()
    # seen (fp32, 1-2 threads): top-1 1.0, KL mean ~1e-6 or below, max |delta logit| ~1e-3
    assert top1 >= 0.99, (top1, delta)
    assert kl.mean().item() < 1e-3 and delta < 0.5, (kl.mean().item(), delta)


def test_plain_generate_runs_fused_on_the_default_model(engine32):
    ids = engine32.encode_prompt(PROMPT)
    cache = engine32.make_cache("turbo4", "fused")
    with torch.inference_mode():
        out = engine32.model.generate(ids, cache=cache, max_new_tokens=6, do_sample=False,
                                      pad_token_id=engine32.tokenizer.pad_token_id)
    rep = cache.report()
    assert out.shape[1] == ids.shape[1] + 6
    assert rep.fused_calls == 5 * 30 and rep.fallbacks == {}  # every decode step of every layer read the store
    assert rep.resident_decode_bytes < rep.dense_fp16_bytes


@pytest.mark.parametrize("policy", ["smollm2-head-2.5bit", "smollm2-head-3.5bit"])
def test_shipped_per_head_policies_run_fused_with_no_torch_reference_call(policy):
    """Calibrated pcaq keys and per-head layers: every fused call of the shipped allocations is one native
    kernel call per layer (issue 30: the report shows no torch-reference call)."""
    require_default_model()
    from tqbench.kernels.cpu import native_status

    if not native_status()[0]:
        pytest.skip(native_status()[1])
    cmd = [sys.executable, "-m", "tqbench", "--headless", "bench", "--threads", "1", "--kv-policy", policy,
           "--cache-mode", "fused", "--prompt", PROMPT, "--max-new-tokens", "8", "--json"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rep = json.loads(proc.stdout)["cache_report"]
    assert rep["fused_calls"] > 0 and rep["fused_impl"] == {"native-cpu": rep["fused_calls"]}, rep["fused_impl"]
    assert rep["fallbacks"] == {}
    assert rep["fused_groups"] and all(set(ran) == {"native-cpu"} for ran in rep["fused_groups"].values())
    assert any(g.startswith("k=pcaq") for g in rep["fused_groups"])
