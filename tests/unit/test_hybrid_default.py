"""Hybrid (sliding-window + global) models: every verdict states its bytes at the lengths the model is used at
(1K, 8K, 32K within its context), from the exact estimate. Config only (the shipped Gemma-3 270M geometry)."""

from __future__ import annotations

import json

import pytest

from tqbench.engine.cache import estimate_kv, model_geometry
from tqbench.engine.cache.savings import USAGE_LENGTHS, Savings, savings

GEMMA = model_geometry("gemma3-270m").geometry


def test_savings_state_the_bytes_at_the_usage_lengths_within_the_context():
    s = savings("turbo4", "fp16", GEMMA, 1050, limit=32768)
    assert USAGE_LENGTHS == (1024, 8192, 32768)
    want = tuple((n, estimate_kv("turbo4", GEMMA, n).total_bytes, estimate_kv("fp16", GEMMA, n).total_bytes)
                 for n in USAGE_LENGTHS)
    assert s.at_lengths == want
    assert want[1] == (8192, 9145428, 33014784)  # kv-estimate's row (docs/gemma3-270m.md)
    assert s.lengths_message.split("; ")[1] == "8192 tokens: 9145428 B against 33014784 B (72.3% saved)"
    d = s.to_dict()
    assert d["at_lengths"][1] == {"tokens": 8192, "bytes": 9145428, "baseline_bytes": 33014784, "saved_pct": 72.3}
    assert Savings.from_dict(d) == s
    assert [n for n, _, _ in savings("turbo4", "fp16", GEMMA, 100, limit=4096).at_lengths] == [1024]


# ---- the layer-kind selectors and the default policy of a hybrid model ------------------------------------------
def test_kind_selectors_name_the_windows_and_the_globals_of_a_hybrid_model_only():
    from tqbench.engine.policy import select_layers, validate_selector

    types = GEMMA.layer_types
    assert select_layers("global", 18, types) == {5, 11, 17}
    assert select_layers("sliding", 18, types) == set(range(18)) - {5, 11, 17}
    assert select_layers("sliding+global", 18, types) == set(range(18))
    uniform = ("full_attention",) * 4
    assert select_layers("global", 4, uniform) == select_layers("sliding", 4, uniform) == set()
    assert select_layers("global", 4) == set()  # no layer types known: no kind
    assert validate_selector(" Sliding+first2 ") == "sliding+first2"
    with pytest.raises(ValueError, match="bad layer selector part 'globals': .*sliding or global"):
        validate_selector("globals")


def test_the_default_is_turbo4_without_sliding_layers_and_the_measured_mix_on_a_hybrid_model():
    from tqbench.engine.policy import DEFAULT_POLICY, HYBRID_DEFAULT_POLICY, default_policy, parse_policy

    smol = model_geometry("default").geometry
    assert default_policy(smol.layer_types) == parse_policy("turbo4") and DEFAULT_POLICY == "turbo4"
    # the measured hybrid default (docs/gemma3-270m.md): a change of string or bytes must be a deliberate one
    assert HYBRID_DEFAULT_POLICY == "turbo4,rotation=hadamard,k@global=int4,kblock=64,srecent=48"
    pol = default_policy(GEMMA.layer_types)
    assert pol == parse_policy(HYBRID_DEFAULT_POLICY)
    plans = pol.plan(GEMMA.num_layers, list(GEMMA.layer_types))
    assert {(p.k, p.v, p.sink, p.recent) for p in plans if p.sliding} == {("turbo4", "turbo4", 0, 48)}
    assert [(p.layer, p.k, p.v, p.sink, p.recent) for p in plans if not p.sliding] == [
        (i, "int4", "turbo4", 4, 16) for i in (5, 11, 17)]
    # >= 70% of the model's own fp16 cache saved at 8K (issue 39), every byte counted
    est = [estimate_kv(pol, GEMMA, n) for n in USAGE_LENGTHS]
    assert [e.total_bytes for e in est] == [3486092, 9378188, 29579660]
    assert [round(e.saved_pct, 1) for e in est] == [68.3, 71.6, 72.7]


def test_the_hybrid_default_on_a_tiny_gemma3_stores_the_estimated_bytes_in_every_mode():
    import torch

    from tqbench.engine import Engine
    from tqbench.engine.policy import HYBRID_DEFAULT_POLICY

    eng = Engine.load("tiny-gemma3_text")  # window 8: srecent=48 keeps the whole window fp16 here
    ids = torch.randint(5, 300, (1, 70), generator=torch.Generator().manual_seed(0))  # past one 64-row key block
    runs = {m: eng.generate(ids, HYBRID_DEFAULT_POLICY, m, max_new_tokens=6, stop_at_eos=False, prefill_chunk=0)
            for m in ("simulate", "compressed", "fused")}
    assert runs["simulate"].token_ids == runs["compressed"].token_ids == runs["fused"].token_ids
    assert runs["fused"].cache_report.fused_impl == {"native-cpu": runs["fused"].cache_report.fused_calls}
    want = estimate_kv(HYBRID_DEFAULT_POLICY, eng.geometry, 75, prefill=70).total_bytes
    assert want == 31932  # 26300 with 32-row key blocks
    assert {m: r.cache_report.compressed_storage_bytes for m, r in runs.items()} == dict.fromkeys(runs, want)


def test_validate_without_a_candidate_runs_the_models_default():
    from click.testing import CliRunner

    from tqbench.cli import main
    from tqbench.engine.policy import HYBRID_DEFAULT_POLICY, parse_policy

    args = ["--headless", "validate", "--prompt", "Hi there", "--max-new-tokens", "2", "--threads", "1", "--json"]
    r = CliRunner().invoke(main, [*args, "--model", "tiny-gemma3_text"])
    assert r.exit_code in (0, 1), r.output
    d = json.loads(r.stdout)
    assert d["candidate_policy"] == parse_policy(HYBRID_DEFAULT_POLICY).to_string()
    r = CliRunner().invoke(main, [*args, "--model", "tiny"])
    assert json.loads(r.stdout)["candidate_policy"] == parse_policy("turbo4").to_string()
