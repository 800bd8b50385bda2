"""Golden shapes of the CLI's JSON: a refactor may not drop, rename or reorder a field of ``bench --json``."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tqbench.cli import main

#: ``tqbench --headless bench --model tiny --json``: top-level keys, in order
BENCH_KEYS = [
    "kv_policy", "cache_mode", "input_tokens", "output_tokens", "token_ids", "text", "stopped_by",
    "prefill_seconds", "decode_seconds", "elapsed_seconds", "tokens_per_second", "decode_tokens_per_second",
    "cache_report", "kv_policy_string", "model", "device", "dtype", "threads",
]
#: its ``cache_report`` (engine.cache.report.CacheReport.to_dict())
CACHE_REPORT_KEYS = [
    "cache_mode", "kv_policy", "policy_string", "tokens", "compressed_storage_bytes", "dense_fp16_bytes",
    "resident_decode_bytes", "shared_bytes", "bits_per_element", "memory_saved_pct",
    "compressed_at_rest_saved_pct", "active_decode_memory_saved_pct", "quality_claims", "layers",
    "shared_objects", "bypassed_layers", "fused_calls", "fallbacks", "fused_impl", "sparse_v", "fused_groups", "notes",
]
#: one row of ``cache_report.layers``
LAYER_KEYS = [
    "layer", "k_codec", "v_codec", "tokens", "k_bytes", "v_bytes", "full_precision_bytes", "packed_bytes",
    "state_bytes", "k_packed_tokens", "v_packed_tokens", "dense_fp16_bytes", "reason", "evicted_prefill",
    "evicted_decode", "demoted_tokens", "head_tokens", "total_bytes",
]


def test_bench_json_keys_are_golden():
    r = CliRunner().invoke(main, ["--headless", "bench", "--model", "tiny", "--max-new-tokens", "4",
                                  "--prompt", "hello there", "--threads", "1", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert list(d) == BENCH_KEYS
    assert list(d["cache_report"]) == CACHE_REPORT_KEYS
    assert d["cache_report"]["layers"] and all(list(row) == LAYER_KEYS for row in d["cache_report"]["layers"])
    assert d["threads"] == 1 and d["kv_policy"] == "turbo4" and d["cache_mode"] == "compressed"


def test_bench_baseline_runs_the_same_tokens_with_a_16_bit_dense_cache_and_names_it():
    r = CliRunner().invoke(main, ["--headless", "bench", "--model", "tiny", "--max-new-tokens", "6", "--cache-mode",
                                  "fused", "--prompt", "hello there", "--threads", "1", "--baseline", "dense-fp16",
                                  "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert list(d) == [*BENCH_KEYS, "baseline"]
    b = d["baseline"]
    assert (b["name"], b["kv_dtype"]) == ("dense-fp16", "float16") and b["decode_tokens_per_second"] > 0
    assert b["decode_ratio"] == pytest.approx(d["decode_tokens_per_second"] / b["decode_tokens_per_second"], rel=1e-3)
    r = CliRunner().invoke(main, ["--headless", "bench", "--model", "tiny", "--max-new-tokens", "4",
                                  "--prompt", "hello there", "--threads", "1", "--baseline", "dense"])
    assert r.exit_code == 0, r.output
    assert "baseline" in r.stdout and "dense (float32 K/V; attention: the model's attention)" in r.stdout
    r = CliRunner().invoke(main, ["--headless", "bench", "--model", "tiny", "--baseline", "fp16"])
    assert r.exit_code == 2 and "'fp16' is not one of 'dense', 'dense-fp16', 'dense-bf16'" in r.output


def test_policies_json_keys_are_golden():
    r = CliRunner().invoke(main, ["--headless", "policies", "--json", "--seq-len", "256"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert all(list(row) == ["name", "policy", "meaning", "bits_per_element", "saved_pct", "kv_bytes",
                             "dense_fp16_bytes", "seq_len"] for row in rows)
    assert {row["seq_len"] for row in rows} == {256}
