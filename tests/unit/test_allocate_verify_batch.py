"""Verification in one batch (``verify.frontier_texts``, ``quality.teacher_forced_batch``, ``quality.dense_logprobs``):
the same numbers as one text at a time, in float64 to a tight tolerance."""

from __future__ import annotations

import pytest
import torch

from tqbench.engine.allocate.texts import text_ids
from tqbench.engine.allocate.verify import frontier, frontier_texts, report_at_context
from tqbench.engine.policy import parse_policy
from tqbench.engine.validate.quality import (
    _run,
    dense_logprobs,
    per_sequence,
    teacher_forced,
    teacher_forced_batch,
)

PREFILL, STEPS = 40, 8
POLICY = "k=turbo2,v=turbo3,sink=2,recent=4"
TEXTS = ["rivers", "heldout:technical"]


def _ids(engine, n=PREFILL + STEPS + 1):
    return torch.cat([text_ids(engine.tokenizer, t, n)[0] for t in TEXTS])


def test_one_forward_baseline_equals_the_stepped_baseline(tiny_engine64):
    ids = _ids(tiny_engine64)
    one = dense_logprobs(tiny_engine64, ids, PREFILL)
    for b in range(2):
        stepped = _run(tiny_engine64.model, ids[b:b + 1], PREFILL, tiny_engine64.make_cache(None), "baseline",
                       "dynamic-cache", None, None)
        assert one.shape == (2, STEPS, stepped.shape[-1])
        torch.testing.assert_close(one[b], stepped[0], rtol=0, atol=1e-9)


@pytest.mark.parametrize("mode", ["simulate", "compressed"])
def test_a_batch_of_texts_equals_each_text_alone(tiny_engine64, mode):
    ids = _ids(tiny_engine64)
    batch = teacher_forced_batch(tiny_engine64, ids, PREFILL, POLICY, mode)
    for b, r in enumerate(batch):
        alone = teacher_forced(tiny_engine64, ids[b:b + 1], PREFILL, POLICY, mode)
        assert r.kl_mean == pytest.approx(alone.kl_mean, rel=1e-9, abs=1e-15), (b, r, alone)
        assert r.kl_max == pytest.approx(alone.kl_max, rel=1e-9, abs=1e-15)
        assert r.top1_agreement == alone.top1_agreement and r.steps == alone.steps == STEPS
        assert r.ppl_candidate == pytest.approx(alone.ppl_candidate, rel=1e-12)
        assert r.ppl_baseline == pytest.approx(alone.ppl_baseline, rel=1e-12)
        # one sequence's share of the batch cache's bytes: the bytes of that sequence's own cache
        assert (r.compressed_storage_bytes, r.dense_fp16_bytes, r.bits_per_element) == \
            (alone.compressed_storage_bytes, alone.dense_fp16_bytes, alone.bits_per_element)
    assert batch[0].kl_mean != batch[1].kl_mean  # two texts, two answers (no row mixed up)


@pytest.mark.parametrize("context", [PREFILL, PREFILL + 16])
def test_frontier_on_two_texts_equals_one_text_at_a_time(tiny_engine64, context):
    pols = [POLICY, "turbo4"]
    both = frontier_texts(tiny_engine64, pols, texts=TEXTS, prefill=PREFILL, steps=STEPS, context=context)
    for text in TEXTS:
        alone = frontier(tiny_engine64, pols, text=text, prefill=PREFILL, steps=STEPS, context=context)
        for p, q in zip(both[text], alone):
            assert p.text == q.text and p.kv_policy == q.kv_policy
            assert (p.report_bits_per_element, p.report_bytes, p.bits_per_element) == \
                (q.report_bits_per_element, q.report_bytes, q.bits_per_element)
            assert p.kl_mean == pytest.approx(q.kl_mean, rel=1e-9, abs=1e-15)
            assert p.top1_agreement == q.top1_agreement


def test_the_candidates_own_report_equals_a_compressed_prefill_of_the_context(tiny_engine64):
    """The report at context comes from the simulate-mode candidate after its prefill (context == prefill): the
    bytes a compressed-mode prefill of that context reports, per sequence."""
    ids = _ids(tiny_engine64)
    pol = parse_policy(POLICY)
    seen = []
    teacher_forced_batch(tiny_engine64, ids, PREFILL, pol, "simulate", after_prefill=lambda c: seen.append(c.report()))
    own = per_sequence(seen[0], 2)
    for b in range(2):
        ref = report_at_context(tiny_engine64, pol, ids[b:b + 1], PREFILL)
        assert own["compressed_storage_bytes"] == ref.compressed_storage_bytes
        assert own["dense_fp16_bytes"] == ref.dense_fp16_bytes
        assert own["bits_per_element"] == ref.bits_per_element


def test_per_sequence_refuses_an_uneven_batch(tiny_engine):
    class Rep:
        kv_policy, shared_bytes, compressed_storage_bytes, dense_fp16_bytes = "x", 10, 10 + 7, 8
        bits_per_element = memory_saved_pct = 0.0
    with pytest.raises(ValueError, match="not an equal share"):
        per_sequence(Rep(), 2)
