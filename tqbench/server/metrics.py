"""``GET /metrics``: what the server is doing, in the Prometheus text exposition format (version 0.0.4).

Counters end in ``_total`` (a scraper takes their rate); gauges are the state now. Resident KV bytes are
re-read from the running requests' caches at most once a second by the worker (a cache report walks every
layer), so they may lag the batch by up to a second.
"""

from __future__ import annotations

from tqbench import __version__


def _line(name: str, kind: str, help_: str, samples: list[tuple[dict, float]]) -> list[str]:
    out = [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        tag = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
        out.append(f"{name}{{{tag}}} {_number(value)}" if tag else f"{name} {_number(value)}")
    return out


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    return repr(float(value))


def prometheus_text(server) -> str:
    """The exposition text for ``server`` (a ``tqbench.server.app.Server``)."""
    w = server.worker
    stats = dict(w.stats)
    c = dict(w.counters)
    running = w.running or []
    lines: list[str] = []
    lines += _line("tqbench_info", "gauge", "The served model, default KV policy and cache mode (always 1).",
                   [({"model": server.model_id, "kv_policy": server.policy.label, "cache_mode": server.cache_mode,
                      "version": __version__}, 1)])
    lines += _line("tqbench_requests_total", "counter",
                   "Requests by outcome: completed, cancelled (client left or shutdown), failed (engine error), "
                   "rejected (429, queue full), skipped (client left while queued).",
                   [({"outcome": k}, v) for k, v in sorted(stats.items())])
    errors = dict(server.error_responses)
    lines += _line("tqbench_error_responses_total", "counter",
                   "Error responses by HTTP status (4xx: the request was refused, with a message; 5xx: server errors).",
                   [({"status": str(k)}, v) for k, v in sorted(errors.items())])
    lines += _line("tqbench_queue_depth", "gauge", "Requests waiting for the engine.", [({}, w.waiting)])
    lines += _line("tqbench_queue_capacity", "gauge", "Most requests allowed to wait (--max-queue).",
                   [({}, w.max_queue)])
    lines += _line("tqbench_running_requests", "gauge", "Requests the engine is running (prefill or decode batch).",
                   [({}, len(running))])
    lines += _line("tqbench_batch_size", "gauge", "Sequences in the last decode step (0 when idle).",
                   [({}, w.batch_size)])
    lines += _line("tqbench_batch_capacity", "gauge", "Most sequences per decode step (--max-batch).",
                   [({}, w.max_batch)])
    lines += _line("tqbench_decode_steps_total", "counter", "Decode forward calls (one per step of the batch).",
                   [({}, c["decode_steps"])])
    lines += _line("tqbench_decode_rows_total", "counter",
                   "Sequences summed over decode steps (divided by steps: the mean batch size).",
                   [({}, c["decode_rows"])])
    lines += _line("tqbench_prompt_tokens_total", "counter", "Prompt tokens prefilled.", [({}, c["prompt_tokens"])])
    lines += _line("tqbench_generated_tokens_total", "counter", "Tokens generated.", [({}, c["generated_tokens"])])
    lines += _line("tqbench_prefill_seconds_total", "counter", "Wall time spent in prefills.",
                   [({}, c["prefill_seconds"])])
    lines += _line("tqbench_decode_seconds_total", "counter", "Wall time spent in decode forward calls.",
                   [({}, c["decode_seconds"])])
    lines += _line("tqbench_decode_tokens_per_second", "gauge",
                   "Tokens decoded per second over the last 10 s, all running requests together.",
                   [({}, round(w.tokens_per_second(), 3))])
    kv = dict(w.kv_bytes)
    lines += _line("tqbench_kv_resident_bytes", "gauge",
                   "KV bytes resident during decode, summed over the running requests (cache report).",
                   [({}, kv["resident"])])
    lines += _line("tqbench_kv_packed_bytes", "gauge",
                   "KV storage bytes (packed + full-precision rows + metadata) of the running requests.",
                   [({}, kv["packed"])])
    lines += _line("tqbench_kv_dense_fp16_bytes", "gauge",
                   "What the running requests' K/V would take as dense fp16.", [({}, kv["dense_fp16"])])
    lines += _prefix_lines(server.prefix_cache.stats())
    lines += _vllm_named(server)
    return "\n".join(lines) + "\n"


def _vllm_named(server) -> list[str]:
    """The KV budget and the scheduler state under vLLM's metric names (``vllm:`` -> ``tqbench:``), labelled with
    ``model_name`` as vLLM does, plus ``kv_policy`` (one sample per policy running or waiting; the server's
    default policy when idle)."""
    usage = server.kv_usage()
    model = {"model_name": server.model_id}
    by = usage["by_policy"] or {server.policy.label: {"running": 0, "reserved_bytes": 0, "waiting": 0}}
    budget = usage["budget_bytes"]
    out: list[str] = []
    out += _line("tqbench:kv_cache_usage_perc", "gauge",
                 "Share of the KV budget reserved by the running requests (1 means 100 percent), as vLLM's.",
                 [({**model, "kv_policy": k}, v["reserved_bytes"] / budget) for k, v in by.items()])
    out += _line("tqbench:num_requests_running", "gauge", "Requests running (prefill or decode), as vLLM's.",
                 [({**model, "kv_policy": k}, v["running"]) for k, v in by.items()])
    out += _line("tqbench:num_requests_waiting", "gauge", "Requests waiting for admission, as vLLM's.",
                 [({**model, "kv_policy": k}, v["waiting"]) for k, v in by.items()])
    out += _line("tqbench:kv_cache_reserved_bytes", "gauge",
                 "KV bytes reserved by the running requests (each its cache at prompt + max_tokens, exact estimate).",
                 [({**model, "kv_policy": k}, v["reserved_bytes"]) for k, v in by.items()])
    out += _line("tqbench:kv_cache_budget_bytes", "gauge", "The KV byte budget (--kv-budget).", [(model, budget)])
    return out


def _prefix_lines(p: dict) -> list[str]:
    """The prefix cache (``server.prefix``): a stored prefix's bytes count once, however many requests read it."""
    out: list[str] = []
    out += _line("tqbench_prefix_cache_entries", "gauge", "Compressed prefixes stored.", [({}, p["entries"])])
    out += _line("tqbench_prefix_cache_bytes", "gauge",
                 "Bytes of the stored compressed prefixes (each counted once; cache report storage bytes).",
                 [({}, p["bytes"])])
    out += _line("tqbench_prefix_cache_capacity_bytes", "gauge", "The prefix cache's byte cap (--prefix-cache; 0: off).",
                 [({}, p["cap_bytes"])])
    out += _line("tqbench_prefix_cache_requests_total", "counter",
                 "Requests that named or matched a prefix: hit (read a stored one), miss (compressed it).",
                 [({"outcome": "hit"}, p["hits"]), ({"outcome": "miss"}, p["misses"])])
    out += _line("tqbench_prefix_cache_hit_tokens_total", "counter",
                 "Prompt tokens read from stored compressed prefixes instead of prefilled.", [({}, p["hit_tokens"])])
    out += _line("tqbench_prefix_cache_evictions_total", "counter",
                 "Prefixes evicted to fit the cap (least recently used first).", [({}, p["evicted"])])
    return out
