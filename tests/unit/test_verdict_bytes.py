"""Verdicts that know bytes and sample size (issues 30.5, 33.7, 33.8): a policy that stores at least as many bytes
as the baseline at the tested length is never called safe nor recommended, and says from which length it saves
(the exact estimate's break-even); too small a sample carries a caveat and is never an unqualified "safe"; a
run cancelled before the candidate produced a token has no divergence and no match ratio."""

from __future__ import annotations

import pytest

from tqbench.engine.cache.estimate import KVGeometry, estimate_kv
from tqbench.engine.cache.savings import Savings, break_even_tokens, saves, savings
from tqbench.engine.metrics import pair_summary
from tqbench.engine.validate import compare_policies, validate
from tqbench.engine.validate.compare import CompareRow, recommend_policy
from tqbench.engine.validate.evidence import Evidence, evidence

LLAMA = KVGeometry(4, 2, 16)  # the tiny model
GEMMA3 = KVGeometry(4, 2, 32, ("sliding_attention", "full_attention") * 2, 8)  # tiny-gemma3_text


@pytest.fixture(scope="module")
def gemma3():
    from tqbench.engine.engine import Engine

    return Engine.load("tiny-gemma3_text")


# ---- the break-even length is the exact estimate's ---------------------------------------------------------
@pytest.mark.parametrize("geometry", [LLAMA, GEMMA3], ids=["llama", "gemma3"])
@pytest.mark.parametrize("policy", ["turbo4", "turbo2", "k4v2", "q8k-q8v", "k=turbo4,v=turbo4,sink=4,recent=200"])
def test_break_even_is_the_length_from_which_the_estimate_stays_below_the_baseline(geometry, policy):
    n = break_even_tokens(policy, "fp16", geometry)
    assert n is not None
    at, base_at = estimate_kv(policy, geometry, n), estimate_kv("fp16", geometry, n)
    below, base_below = estimate_kv(policy, geometry, n - 1), estimate_kv("fp16", geometry, n - 1)
    assert at.total_bytes < base_at.total_bytes and below.total_bytes >= base_below.total_bytes
    # brute force: the last length up to n + 300 that does not save is n - 1
    last = max(m for m in range(0, n + 300)
               if estimate_kv(policy, geometry, m).total_bytes >= estimate_kv("fp16", geometry, m).total_bytes)
    assert last == n - 1
    assert saves(policy, "fp16", geometry, n) and not saves(policy, "fp16", geometry, n - 1)


def test_break_even_where_bytes_are_not_monotone():
    # q8 keys pack in 32-token blocks: a window-bounded sliding store of the tiny Gemma-3 (window 8) holds up to
    # 38 rows, so q8k-q8v saves at 1 token (int8 values pack at once), stops at 28-31 and 38, then saves for good
    assert saves("q8k-q8v", "fp16", GEMMA3, 1) and not saves("q8k-q8v", "fp16", GEMMA3, 38)
    assert break_even_tokens("q8k-q8v", "fp16", GEMMA3) == 39
    s = savings("q8k-q8v", "fp16", GEMMA3, 30)  # saves nothing at 30; saves at 32-37, not at 38: from 39 on
    assert not s.saves and s.break_even_tokens == 39 and s.message.endswith("it starts to save at 39 tokens")


def test_break_even_of_the_tiny_models_and_never():
    assert break_even_tokens("turbo4", "fp16", LLAMA) == 27
    assert break_even_tokens("turbo4", "fp16", GEMMA3) == 44
    assert break_even_tokens("k=fp16,v=fp16,sink=4", "fp16", LLAMA) is None  # never: same bytes at every length
    assert break_even_tokens("turbo4", "fp16", LLAMA, limit=26) is None  # not within the searched limit
    s = savings("fp16", "fp16", LLAMA, 10, limit=4096)
    assert not s.saves and s.break_even_tokens is None
    assert s.message.endswith("it never saves (none up to 4096 tokens)")
    assert Savings.from_dict(s.to_dict()) == s


# ---- validate: saves nothing, on a sliding model and on the tiny llama at a very short length -------------------
def test_validate_on_a_sliding_model_saves_nothing_and_says_why_and_from_when(gemma3):
    rep = validate(gemma3, "Hi there", "fp16", "turbo4", max_new_tokens=2)
    rec = rep.policy_recommendation
    assert rep.quality_verdict == "exact-match"  # the tokens held, but the bytes did not
    assert rec.status == "saves-nothing" and rec.next_policy is None
    assert rec.next_step == "keep the baseline at this length: it starts to save at 44 tokens"
    s = rec.savings
    assert not s.saves and s.seq_len == rep.candidate_cache_report.tokens == 28
    assert (s.bytes, s.baseline_bytes) == (rep.candidate_cache_report.compressed_storage_bytes,
                                           rep.baseline_cache_report.compressed_storage_bytes) == (23488, 17920)
    assert s.break_even_tokens == break_even_tokens("turbo4", "fp16", gemma3.geometry, gemma3.max_context) == 44
    assert s.message == (
        "saves nothing at 28 tokens: 23488 B against 17920 B for fp16; 8512 B of fixed bytes (8256 B of shared "
        "rotations/codebooks, 256 B of per-layer codec state such as key centering); 13824 B of rows kept at 16 "
        "bits (4 sink + 16 recent tokens per layer, dense layers included); it starts to save at 44 tokens")
    d = rep.to_dict()["policy_recommendation"]
    assert d["status"] == "saves-nothing" and d["savings"]["saves"] is False and d["savings"]["break_even_tokens"] == 44


def test_bypassed_sliding_layers_are_named_as_a_reason(gemma3):
    s = gemma3.savings("turbo4,sliding=bypass", "fp16", 28)
    assert "2 of 4 layers store K/V uncompressed (bypassed: sliding-window layer keeps transformers' bounded " \
           "dense window)" in s.reasons


def test_validate_on_the_tiny_llama_at_a_very_short_length_saves_nothing(tiny_engine):
    rep = validate(tiny_engine, "Hi", "fp16", "turbo4", chat=False, max_new_tokens=2)
    rec = rep.policy_recommendation
    assert rec.status == "saves-nothing" and rec.savings.seq_len < 27
    assert rec.savings.message.startswith(f"saves nothing at {rec.savings.seq_len} tokens: ")
    assert rec.savings.message.endswith("it starts to save at 27 tokens")


def test_the_cli_never_says_safe_for_a_policy_that_saves_nothing():
    from click.testing import CliRunner

    from tqbench.cli import main

    r = CliRunner().invoke(main, ["--headless", "validate", "--model", "tiny-gemma3_text", "--candidate", "turbo4",
                                  "--prompt", "Hi there", "--max-new-tokens", "2", "--threads", "1"])
    assert r.exit_code == 0, r.output
    out = " ".join(r.stdout.split())
    assert "safe: use it" not in out
    assert "saves-nothing: keep the baseline at this length: it starts to save at 44 tokens" in out
    assert "saves nothing at 28 tokens: 23488 B against 17920 B for fp16;" in out


# ---- sample size ----------------------------------------------------------------------------------------------
def test_evidence_rule_and_caveat():
    assert evidence([12]).caveat == (
        "evidence: 1 prompt x 12 tokens; too little to call it safe (needs 64 generated tokens in all, 32 per "
        "prompt): measure teacher-forced quality, or compare on more prompts and tokens")
    assert evidence([64]).enough and evidence([32, 32]).enough and evidence([40, 48]).caveat is None
    assert not evidence([16, 16, 16, 16]).enough and not evidence([]).enough and not evidence([63]).enough
    assert evidence([40, 48, 12]).summary == "3 prompts x 12-48 tokens"
    assert Evidence.from_dict(evidence([12]).to_dict()) == evidence([12])


def test_validate_on_a_small_sample_is_unproven_not_safe(tiny_engine):
    small = validate(tiny_engine, "The lighthouse keeper wrote", "fp16", "q8k-q8v", max_new_tokens=8)
    assert small.quality_verdict == "exact-match" and small.policy_recommendation.savings.saves
    rec = small.policy_recommendation
    assert rec.status == "unproven" and rec.caveat.startswith("evidence: 1 prompt x 8 tokens; too little")
    assert rec.evidence == evidence([8])
    enough = validate(tiny_engine, "The lighthouse keeper wrote", "fp16", "q8k-q8v", max_new_tokens=64)
    assert enough.quality_verdict == "exact-match" and enough.policy_recommendation.status == "safe"
    assert enough.policy_recommendation.caveat is None


def test_compare_recommendation_carries_the_caveat_and_never_picks_a_policy_that_saves_nothing():
    rows = [CompareRow("a", verdict="exact-match", memory_saved_pct=30.0, saves=False, break_even_tokens=90,
                       savings_note="saves nothing at 20 tokens: ..."),
            CompareRow("b", verdict="exact-match", memory_saved_pct=10.0, saves=True)]
    rec = recommend_policy(rows, evidence=evidence([12]))
    assert rec["recommended_policy"] == "b" and rec["status"] == "compressed-policy"
    assert rec["saves_nothing_policies"] == [{"policy": "a", "break_even_tokens": 90,
                                              "note": "saves nothing at 20 tokens: ..."}]
    assert rec["caveat"] == evidence([12]).caveat
    assert recommend_policy(rows[:1])["status"] == "keep-baseline"
    assert recommend_policy(rows, evidence=evidence([64]))["caveat"] is None


def test_compare_on_a_sliding_model_names_the_break_even(gemma3):
    res = compare_policies(gemma3, ["turbo4"], ["Hi there"], max_new_tokens=2)
    row = res.rows[0]
    assert row.verdict == "exact-match" and row.saves is False
    assert row.break_even_tokens == break_even_tokens("turbo4", "fp16", gemma3.geometry, gemma3.max_context)
    assert row.savings_note.startswith("saves nothing at 28 tokens: 23488 B against 17920 B for fp16;")
    assert res.recommendation["status"] == "keep-baseline" and res.recommendation["recommended_policy"] == "fp16"
    assert res.recommendation["saves_nothing_policies"][0]["policy"] == "turbo4"
    assert res.evidence == evidence([2]) and res.recommendation["caveat"] == evidence([2]).caveat


# ---- a cancelled run ------------------------------------------------------------------------------------------
def test_pair_summary_of_cancelled_runs():
    s = pair_summary([False], [False], [None], cancelled=(1, 0))
    assert (s.steps, s.token_match, s.top1_agreement, s.first_divergence, s.exact_match) == (0, None, None, None,
                                                                                             False)
    assert s.cancelled and s.note == "cancelled before the candidate produced a token"
    s = pair_summary([True, True, False], [True, True, False], [0.1, 0.2, None], cancelled=(3, 2))
    assert (s.steps, s.token_match, s.first_divergence, s.exact_match) == (2, 1.0, None, True)
    assert s.note == "cancelled: the 2 steps both runs produced are compared"
    assert pair_summary([True, False], [True, False], [None, None]).first_divergence == 1  # not cancelled: EOS


def test_a_run_cancelled_before_the_candidate_produced_a_token(tiny_engine, monkeypatch):
    from tqbench.engine.events import TokenGenerated
    from tqbench.sessions import RunRecorder

    flag = {"cancel": False}
    real = tiny_engine.stream

    def stream(*args, **kwargs):
        for ev in real(*args, **kwargs):
            if isinstance(ev, TokenGenerated) and ev.run == "baseline":
                flag["cancel"] = True  # set before the candidate's first step checks it: no wall time involved
            yield ev

    monkeypatch.setattr(tiny_engine, "stream", stream)
    rec = RunRecorder("The lighthouse keeper wrote", True, 8, {})
    for ev in tiny_engine.lockstep("The lighthouse keeper wrote", "fp16", "turbo4", max_new_tokens=8,
                                   cancel=lambda: flag["cancel"]):
        rec(ev)
    run = rec.record
    assert len(run.baseline.token_ids) == 1 and run.candidate.token_ids == []
    assert run.candidate.stopped_by == "cancelled" and run.same_token == [False]
    assert run.cancelled_tokens == (1, 0)
    summary = run.summary()
    assert summary["note"] == "cancelled before the candidate produced a token"
    assert summary["first_divergence"] is None and summary["token_match"] is None and summary["steps"] == 0
    assert run.first_divergence is None
