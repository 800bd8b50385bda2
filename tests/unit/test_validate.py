"""validate / self-test / teacher-forced / compare-policies on the tiny model, and the verdict rules."""

from __future__ import annotations

import json

import pytest

from tqbench.engine.events import GenerationStarted, PairStep, Progress, ValidationDone
from tqbench.engine.metrics import compare_tokens, decide_verdict
from tqbench.engine.validate import (
    Cancelled,
    CompareResult,
    CompareRow,
    compare_policies,
    recommend_policy,
    self_test,
    teacher_forced_quality,
    validate,
)

PROMPT = "The lighthouse keeper wrote"


# ---- verdict rules ----------------------------------------------------------------------------------
def _verdict(base, cand, **kw):
    return decide_verdict(compare_tokens(base, cand), **kw)


def test_compare_tokens_fields():
    c = compare_tokens([1, 2, 3, 4], [1, 2, 9, 4])
    assert (c.exact_match, c.first_divergence_index, c.token_match_ratio, c.prefix_match_ratio) == (False, 2, 0.75, 0.5)
    c = compare_tokens([1, 2, 3], [1, 2, 3, 4])  # one run stopped early: the divergence is where it stopped
    assert (c.exact_match, c.first_divergence_index, c.token_match_ratio, c.prefix_match_ratio) == (False, 3, 0.75, 0.75)
    assert compare_tokens([5, 6], [5, 6]).first_divergence_index is None


def test_verdict_rules():
    base = list(range(64))
    assert _verdict(base, list(base)) == "exact-match"
    late = base[:60] + [999, 998, 997, 996]
    assert _verdict(base, late) == "near-stable"  # prefix 60/64 = 0.94 >= 0.9
    assert _verdict(base, late, quality_threshold=0.95) == "prefix-stable-then-diverged"
    one_flip = base[:10] + [999] + base[11:]  # realigns after one token: 63/64 positions match
    assert _verdict(base, one_flip) == "near-stable"
    mid = base[:20] + [900 + i for i in range(44)]
    assert _verdict(base, mid) == "prefix-stable-then-diverged"  # 20/64 = 0.31 >= 0.25
    early = base[:3] + [900 + i for i in range(61)]
    assert _verdict(base, early) == "diverged"
    assert _verdict(base, [999] + base[1:]) == "near-stable"  # first token only
    with pytest.raises(ValueError, match="quality_threshold=0 is invalid"):
        _verdict(base, base, quality_threshold=0)


def test_recommend_policy_rule():
    rows = [CompareRow.from_dict(r) for r in [
        {"policy": "a", "verdict": "exact-match", "memory_saved_pct": 40.0, "token_match_ratio": 1.0, "kl_mean": 0.0},
        {"policy": "b", "verdict": "exact-match", "memory_saved_pct": 60.0, "token_match_ratio": 1.0, "kl_mean": 0.0},
        {"policy": "c", "verdict": "near-stable", "memory_saved_pct": 75.0, "token_match_ratio": 0.95, "kl_mean": 0.01},
        {"policy": "d", "verdict": "diverged", "memory_saved_pct": 80.0, "token_match_ratio": 0.1, "kl_mean": 0.2},
    ]]
    rec = recommend_policy(rows)
    assert (rec["recommended_policy"], rec["status"], rec["unsafe_policies"]) == ("b", "compressed-policy", ["d"])
    rec = recommend_policy(rows[2:])
    assert (rec["recommended_policy"], rec["best_risky_policy"], rec["status"]) == ("fp16", "c", "keep-baseline")
    assert rec["unsafe_policies"] == ["d"]
    rec = recommend_policy(rows, storage_only=True)
    assert rec["status"] == "keep-baseline" and "dense-shadow" in rec["note"]


# ---- validate on the tiny model ---------------------------------------------------------------------------
def test_self_test_is_exact_match(tiny_engine):
    rep = self_test(tiny_engine, PROMPT, max_new_tokens=8)
    d = json.loads(json.dumps(rep.to_dict()))
    assert d["quality_verdict"] == "exact-match" and d["passed"] and d["self_test"]
    assert d["comparison"]["first_divergence_index"] is None and d["comparison"]["token_match_ratio"] == 1.0
    assert d["token_ids"]["baseline"] == d["token_ids"]["candidate"]
    assert d["policy_recommendation"]["status"] == "self-test-passed"


def test_validate_report_fields_events_and_exact_tokens(tiny_engine):
    events = []
    rep = validate(tiny_engine, PROMPT, "fp16", "turbo2", max_new_tokens=10, collect_logits=True,
                   on_event=events.append)
    d = json.loads(json.dumps(rep.to_dict()))
    for key in ("quality_verdict", "comparison", "step_comparison", "logit_comparison", "policy_summary",
                "policy_recommendation", "texts", "baseline_cache_report", "candidate_cache_report", "per_step"):
        assert key in d, key
    for key in ("first_divergence_index", "token_match_ratio", "prefix_match_ratio"):
        assert key in d["comparison"]
    assert "top1_match_ratio" in d["step_comparison"]
    # the logit figures summarise the per-step ones up to and including the first divergence (after it the two
    # runs read different contexts; those steps are summarised apart)
    lc, steps = d["logit_comparison"], d["per_step"]
    first = d["comparison"]["first_divergence_index"]
    assert first is not None and lc["steps_compared"] == first + 1, (first, lc)
    upto, after = steps[:first + 1], steps[first + 1:]
    assert lc["kl_mean"] == pytest.approx(sum(s["kl"] for s in upto) / len(upto), rel=1e-9)
    assert lc["kl_max"] == max(s["kl"] for s in upto) > 0  # turbo2 moves the distribution of the diverging step
    assert lc["max_abs_logit_delta"] == max(s["max_abs_logit_delta"] for s in upto) > 0
    assert lc["after_divergence_steps"] == len(after) == 10 - first - 1
    assert lc["after_divergence_kl_mean"] == pytest.approx(sum(s["kl"] for s in after) / len(after), rel=1e-9)
    for key in ("memory_saved_pct", "compression_ratio", "throughput_ratio"):
        assert key in d["policy_summary"]
    assert set(d["policy_recommendation"]) >= {"status", "cause_hint", "next_policy"}
    # the baseline run is exactly what a plain generation gives
    plain = tiny_engine.generate(PROMPT, "fp16", max_new_tokens=10)
    assert d["token_ids"]["baseline"] == plain.token_ids and d["texts"]["baseline"] == plain.text
    cand = tiny_engine.generate(PROMPT, "turbo2", max_new_tokens=10)
    assert d["token_ids"]["candidate"] == cand.token_ids
    # the verdict follows the documented rule, and turbo2 is never called exact-match unless identical
    assert d["quality_verdict"] == decide_verdict(compare_tokens(plain.token_ids, cand.token_ids))
    assert (d["quality_verdict"] == "exact-match") == (plain.token_ids == cand.token_ids)
    pairs = [e for e in events if isinstance(e, PairStep)]
    assert len(pairs) == len(d["per_step"]) == 10
    assert isinstance(events[-1], ValidationDone) and events[-1].report is rep
    assert d["candidate_cache_report"]["kv_policy"] == "turbo2"


def test_validate_cancel_and_bad_input(tiny_engine):
    seen = []

    def on_event(ev):
        if isinstance(ev, PairStep):
            seen.append(ev)

    with pytest.raises(Cancelled):
        validate(tiny_engine, PROMPT, max_new_tokens=20, on_event=on_event, cancel=lambda: len(seen) >= 3)
    assert len(seen) == 3
    with pytest.raises(ValueError, match="max_new_tokens=0 is invalid"):
        validate(tiny_engine, PROMPT, max_new_tokens=0)
    with pytest.raises(ValueError, match="unknown policy preset 'turbo9'"):
        validate(tiny_engine, PROMPT, candidate="turbo9")


def test_dense_shadow_is_storage_only(tiny_engine):
    rep = validate(tiny_engine, PROMPT, candidate="turbo2", cache_mode="dense-shadow", max_new_tokens=6,
                   per_step=False)
    assert rep.storage_only and rep.quality_verdict == "exact-match"  # exact K/V: equal by construction
    assert rep.policy_recommendation.status == "storage-only" and not rep.passed
    assert rep.to_dict()["per_step"] is None


def test_teacher_forced_quality(tiny_engine):
    rep = teacher_forced_quality(tiny_engine, ["fp16", "turbo2"], corpus="bread", context_tokens=48, eval_tokens=12)
    d = rep.to_dict()
    assert d["source"] == "corpus:bread" and d["prefill_tokens"] == 48 and d["steps"] == 12
    fp16, turbo2 = d["results"]
    # the baseline is one causal forward, the candidate single-token steps: the same math, another float32
    # summation order (fp16 KL ~2e-8 here; 0 to 1e-20 in float64, test_allocate_verify_batch.py)
    assert fp16["kv_policy"] == "fp16" and fp16["kl_mean"] < 1e-6 and fp16["top1_agreement"] == 1.0
    assert fp16["ppl_candidate"] == pytest.approx(fp16["ppl_baseline"], rel=1e-6)
    assert turbo2["kl_mean"] > fp16["kl_mean"] and turbo2["bits_per_element"] < 16
    rep = teacher_forced_quality(tiny_engine, "turbo4", prompt=PROMPT, max_new_tokens=6)
    assert rep.source == "prompt+baseline-continuation" and rep.steps == 6


# ---- compare-policies ---------------------------------------------------------------------------------
def test_compare_policies_baseline_once_per_prompt(tiny_engine, monkeypatch):
    starts = []
    real = tiny_engine.stream

    def counting(*a, **kw):
        it = real(*a, **kw)
        for ev in it:
            if isinstance(ev, GenerationStarted):
                starts.append((ev.run, ev.kv_policy))
            yield ev

    monkeypatch.setattr(tiny_engine, "stream", counting)
    events = []
    res = compare_policies(tiny_engine, ["q8k-q8v", "turbo2"], [PROMPT, "Rivers carry"], max_new_tokens=6,
                           on_event=events.append)
    assert starts.count(("baseline", "fp16")) == 2
    assert len([s for s in starts if s[0] == "candidate"]) == 4
    assert len([e for e in events if isinstance(e, Progress)]) == 2 + 4 + 2
    d = json.loads(json.dumps(res.to_dict()))
    assert [r["policy"] for r in d["rows"]] == ["q8k-q8v", "turbo2"]
    for r in d["rows"]:
        for key in ("memory_saved_pct", "bits_per_element", "verdict", "token_match_ratio", "top1_match_ratio",
                    "kl_mean", "throughput_ratio"):
            assert key in r, key
    # each cell equals a plain generation of that policy
    plain = tiny_engine.generate("Rivers carry", "turbo2", max_new_tokens=6)
    cell = [c for c in d["cells"] if c["policy"] == "turbo2" and c["prompt_index"] == 1][0]
    assert cell["text"] == plain.text
    assert d["recommendation"] == recommend_policy([CompareRow.from_dict(r) for r in d["rows"]], evidence=res.evidence)
    assert [r.to_dict() for r in res.rows] == d["rows"]  # typed rows, the same JSON
    # from_dict inverts to_dict exactly, in memory and through JSON (a saved session's comparison)
    assert CompareResult.from_dict(res.to_dict()).to_dict() == res.to_dict()
    assert json.dumps(CompareResult.from_dict(d).to_dict()) == json.dumps(res.to_dict())
    res.threads = 3  # what the CLI records: the one optional key, last
    assert list(res.to_dict())[-1] == "threads" and CompareResult.from_dict(res.to_dict()) == res
    with pytest.raises(ValueError, match="listed twice"):
        compare_policies(tiny_engine, ["turbo4", "turbo4"], [PROMPT])


def test_next_policy_ladder_on_the_default_geometry():
    from tqbench.engine.cache.estimate import KVGeometry
    from tqbench.engine.policy import parse_policy
    from tqbench.engine.validate import recommend

    g = KVGeometry(30, 3, 64)

    def nxt(verdict, name):
        return recommend(verdict, parse_policy(name), g).next_policy

    # a failed policy: the cheapest preset with more bits and neither K nor V less precise (no QJL detour)
    assert nxt("diverged", "turbo3") == "turbo3.5"
    assert nxt("prefix-stable-then-diverged", "turbo4") == "q8k-turbo4v"
    assert nxt("diverged", "turbo2") == "k3v2"
    # an exact match: the gentlest preset with fewer bits and neither K nor V more precise
    assert nxt("exact-match", "q8k-q8v") == "q8k-int4v-last8-q8v"
    assert nxt("exact-match", "turbo4") == "turbo3.5"
    rec = recommend("diverged", parse_policy("k=turbo4,v=turbo2"), g)
    assert rec.status == "unsafe" and "values are the lower-precision side" in rec.cause_hint


def test_cause_hint_reads_codec_aliases_by_their_bits():
    from tqbench.engine.policy import parse_policy
    from tqbench.engine.validate import recommend

    rec = recommend("diverged", parse_policy("k=q8,v=q4"))  # q8 / q4 are int8 / int4: values are the lower side
    assert "values are the lower-precision side (q4)" in rec.cause_hint and rec.next_policy is None
