"""The validation suite on the real default model (SmolLM2-135M-Instruct): short runs only."""

from __future__ import annotations

import pytest

from tests.integration.default_model import require_default_model
from tqbench.engine.engine import Engine
from tqbench.engine.metrics import compare_tokens, decide_verdict
from tqbench.engine.scan import scan
from tqbench.engine.validate import self_test, validate

pytestmark = pytest.mark.integration
PROMPT = "Explain in a few sentences why the sky is blue."
NEW = 12


@pytest.fixture(scope="module")
def engine() -> Engine:
    require_default_model()
    return Engine.load("default", device="cpu", dtype="float32")


def test_self_test_exact_match(engine):
    rep = self_test(engine, PROMPT, max_new_tokens=NEW)
    assert rep.quality_verdict == "exact-match" and rep.passed
    assert len(rep.token_ids.baseline) == NEW


#: (candidate, saved % of the 12-token run's cache (bytes: deterministic), KL mean bounds). Measured (fp32, 1
#: thread): turbo4 exact-match, KL mean 3.3e-4, saved 41.49 %; turbo2 diverges at step 9, KL mean 9.0e-3, 49.19 %
@pytest.mark.parametrize("candidate,saved,kl_bounds", [
    ("turbo4", 41.49, (1e-5, 1e-2)),
    ("turbo2", 49.19, (1e-4, 1e-1)),
])
def test_turbo_candidates_get_honest_verdicts(engine, candidate, saved, kl_bounds):
    rep = validate(engine, PROMPT, "fp16", candidate, max_new_tokens=NEW, collect_logits=True)
    d = rep.to_dict()
    base, cand = d["token_ids"]["baseline"], d["token_ids"]["candidate"]
    assert d["quality_verdict"] == decide_verdict(compare_tokens(base, cand))
    assert (d["quality_verdict"] == "exact-match") == (base == cand)
    assert d["cache_mode"] == "compressed" and not d["storage_only"]
    assert d["policy_summary"]["memory_saved_pct"] == d["candidate_cache_report"]["memory_saved_pct"] == saved
    lo, hi = kl_bounds
    assert lo < d["logit_comparison"]["kl_mean"] < hi, d["logit_comparison"]
    assert d["candidate_cache_report"]["quality_claims"] is True


def test_scan_all_layers_per_head(engine):
    res = scan(engine, PROMPT * 4, codecs=["int8", "turbo3"], max_prompt_tokens=96)
    d = res.to_dict()
    assert d["layers"] == list(range(30)) and d["kv_heads"] == 3
    kl = d["metrics"]["softmax_kl"]
    assert len(kl["turbo3"]) == 30 and all(len(row) == 3 for row in kl["turbo3"])
    # int8 is closer than 3-bit turbo on nearly every head of the real model
    pairs = [(a, b) for ra, rb in zip(kl["int8"], kl["turbo3"]) for a, b in zip(ra, rb)]
    assert sum(a < b for a, b in pairs) >= 0.9 * len(pairs)
