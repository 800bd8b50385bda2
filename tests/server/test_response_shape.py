"""Golden shapes of the server's responses: the keys of a non-stream chat completion and of the final
stream chunks, taken from the server's output, so a refactor cannot drop or rename a field."""

from __future__ import annotations

import pytest
from serverkit import stream_chat

pytestmark = pytest.mark.server

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 6}

COMPLETION_KEYS = ["id", "object", "created", "model", "choices", "usage", "tqbench"]
CHOICE_KEYS = ["index", "message", "logprobs", "finish_reason"]
CHUNK_CHOICE_KEYS = ["index", "delta", "logprobs", "finish_reason"]
USAGE_KEYS = ["prompt_tokens", "completion_tokens", "total_tokens"]
TQBENCH_KEYS = ["kv_policy", "policy_warning", "cache_mode", "stopped_by", "seed", "token_ids", "queue_seconds", "prefill_seconds",
                "decode_seconds", "decode_tokens_per_second", "cache_report", "prefill_chunk", "savings", "prefix_cache"]
#: the summary cache report (no per-layer rows)
CACHE_REPORT_KEYS = [
    "cache_mode", "kv_policy", "policy_string", "tokens", "compressed_storage_bytes", "dense_fp16_bytes",
    "resident_decode_bytes", "shared_bytes", "bits_per_element", "memory_saved_pct",
    "compressed_at_rest_saved_pct", "active_decode_memory_saved_pct", "quality_claims", "shared_objects",
    "fused_calls", "fallbacks", "fused_impl", "sparse_v", "fused_groups", "notes", "layer_count", "bypassed_layer_count",
]


def _assert_tqbench(ext: dict) -> None:
    assert list(ext) == TQBENCH_KEYS
    assert list(ext["cache_report"]) == CACHE_REPORT_KEYS


def test_chat_completion_shape(live_server):
    status, _, d = live_server.request("POST", "/v1/chat/completions", BODY)
    assert status == 200, d
    assert list(d) == COMPLETION_KEYS and d["object"] == "chat.completion"
    assert len(d["choices"]) == 1 and list(d["choices"][0]) == CHOICE_KEYS
    assert list(d["choices"][0]["message"]) == ["role", "content"]
    assert list(d["usage"]) == USAGE_KEYS
    _assert_tqbench(d["tqbench"])


def test_final_stream_chunk_shape(live_server):
    status, _, _, events = stream_chat(live_server.port, BODY)
    assert status == 200 and events[-1] == "[DONE]"
    final = events[-2]
    assert list(final) == COMPLETION_KEYS and final["object"] == "chat.completion.chunk"
    assert len(final["choices"]) == 1 and list(final["choices"][0]) == CHUNK_CHOICE_KEYS
    assert final["choices"][0]["delta"] == {} and final["choices"][0]["finish_reason"] == "length"
    assert list(final["usage"]) == USAGE_KEYS
    _assert_tqbench(final["tqbench"])
    first = events[0]
    assert list(first) == ["id", "object", "created", "model", "choices"]
    assert list(first["choices"][0]) == CHUNK_CHOICE_KEYS


def test_final_stream_chunks_with_include_usage(live_server):
    status, _, _, events = stream_chat(live_server.port, {**BODY, "stream_options": {"include_usage": True}})
    assert status == 200 and events[-1] == "[DONE]"
    finish, usage = events[-3], events[-2]
    assert list(finish) == COMPLETION_KEYS and finish["usage"] is None
    assert finish["choices"][0]["finish_reason"] == "length"
    _assert_tqbench(finish["tqbench"])
    assert list(usage) == COMPLETION_KEYS and usage["choices"] == []
    assert list(usage["usage"]) == USAGE_KEYS
    _assert_tqbench(usage["tqbench"])
