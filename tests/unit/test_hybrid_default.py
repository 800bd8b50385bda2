"""Hybrid (sliding-window + global) models: every verdict states its bytes at the lengths the model is used at
(1K, 8K, 32K within its context), from the exact estimate. Config only (the shipped Gemma-3 270M geometry)."""

from __future__ import annotations

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
