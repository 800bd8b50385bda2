"""Auto-policy on the default model: a small allocation whose own cache report on a 1K-token prompt is within
its budget, verified on held-out text; the shipped allocations load, fit and carry this model's fingerprint."""

from __future__ import annotations

import warnings

import pytest

from tqbench.engine.engine import Engine

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.load("default", device="cpu", threads=1)  # two test workers share 2 cores


def test_allocation_within_budget_on_a_1k_prompt_and_verified(engine):
    from tqbench.engine.allocate import allocate_policy

    rep = allocate_policy(engine, 3.0, calib_prefill=256, calib_steps=16, codecs=["turbo2", "turbo4"],
                          k_codecs=["turbo2", "turbo4"], verify_prefill=256, verify_steps=16, context=1024,
                          max_measurements=4)
    v = rep.verified
    assert rep.measured_cells == 30 * 2 * 2 and v.text == "corpus:rivers" and rep.unseen.text == "heldout:technical"
    assert len([s for s in rep.steps if s.kind == "exchange"]) <= 4
    assert v.report_bits_per_element <= 3.0 and v.report_bits_per_element == pytest.approx(
        rep.allocation.bits_per_element, abs=1e-4)
    assert set(rep.allocation.k) | set(rep.allocation.v) <= {"turbo2", "turbo4"}
    assert 0 < v.kl_mean < 0.5 and v.top1_agreement > 0.5


@pytest.mark.parametrize("name, budget, calibration", [
    ("smollm2-alloc-2.5bit", 2.5, "corpus:lighthouses"), ("smollm2-alloc-3.5bit", 3.5, "corpus:lighthouses"),
    ("smollm2-head-2.5bit", 2.5, "mix:prose+code+legal+chat"), ("smollm2-head-3.5bit", 3.5, "mix:prose+code+legal+chat")])
def test_shipped_allocations_fit_and_belong_to_this_model(engine, name, budget, calibration):
    from tqbench.engine.allocate import frontier
    from tqbench.engine.policy import load_policy_artifact, shipped_policy_path

    art = load_policy_artifact(shipped_policy_path(name))
    assert art.model["fingerprint"] == engine.loaded.fingerprint and art.verified["text"] == "corpus:rivers"
    assert art.allocation["bits_per_element"] <= budget and art.allocation["calibration"] == calibration
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert engine.policy_warning(str(shipped_policy_path(name))) is None
        (p,) = frontier(engine, [name], prefill=256, steps=8, context=1024)
    assert p.report_bits_per_element <= budget
