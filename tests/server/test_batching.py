"""Batched decoding in the server: requests that share a policy and cache mode decode in one forward call per
step, join and leave between steps, and each gets exactly its solo tokens (float64 tiny model); requests of
another kind wait their turn; the fused mode batches too. Synchronised on a
``GatedEngine`` and worker state, never on time."""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from serverkit import GatedEngine, LiveServer, wait_for

pytestmark = pytest.mark.server

PROMPTS = ["Say hello.", "Count to five.", "What is a cache?", "Name a colour.", "Why is the sea salty?"]
BUDGETS = [6, 11, 16, 9, 13]


class RecordingEngine(GatedEngine):
    """Gated like ``GatedEngine``; also records every decode step's (batch size, policy labels)."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.steps: list[tuple[int, set]] = []

    def decode_step(self, seqs):
        self.steps.append((len([s for s in seqs if s.next_token is not None]), {s.result.kv_policy for s in seqs}))
        return self.engine.decode_step(seqs)


def _fire(live, bodies):
    def one(body):
        return live.request("POST", "/v1/chat/completions", body)

    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        return list(pool.map(one, bodies))


def _bodies(policies):
    return [{"messages": [{"role": "user", "content": p}], "max_tokens": n, "ignore_eos": True, "kv_policy": pol}
            for p, n, pol in zip(PROMPTS, BUDGETS, policies)]


def _run_held(engine, bodies, **app_kwargs):
    """Hold the worker on the first request until every other one waits, then let them all run."""
    from tqbench.server import create_app

    app = create_app(engine, kv_policy="turbo4", max_new_tokens=64, max_queue=8, **app_kwargs)
    worker = app.state.server.worker
    rec = worker.engine = RecordingEngine(engine)
    opener = threading.Thread(target=lambda: wait_for(lambda: worker.waiting == len(bodies) - 1)
                              and rec.gate.set(), daemon=True)
    with LiveServer(app) as live:
        opener.start()
        try:
            answers = _fire(live, bodies)
        finally:
            rec.gate.set()
        assert wait_for(lambda: worker.running is None)
        _, _, health = live.request("GET", "/health")
        _, _, metrics = live.request("GET", "/metrics")
    return answers, rec.steps, health, metrics


@pytest.mark.parametrize("policy", ["fp16", "turbo4"])
def test_batched_requests_get_their_solo_tokens_float64(tiny_engine64, policy):
    bodies = _bodies([policy] * len(PROMPTS))
    solo = [tiny_engine64.generate(b["messages"], policy, max_new_tokens=b["max_tokens"], stop_at_eos=False)
            for b in bodies]
    answers, steps, health, metrics = _run_held(tiny_engine64, bodies)
    assert [a[0] for a in answers] == [200] * len(bodies)
    for (_, _, body), want in zip(answers, solo):
        assert body["tqbench"]["token_ids"] == want.token_ids
        assert body["choices"][0]["message"]["content"] == want.text
    sizes = [n for n, _ in steps]
    assert max(sizes) == len(bodies)  # all five decoded in one forward call at some step
    assert sizes[-1] == 1  # the longest ran on alone once the others had left
    assert sum(sizes) == sum(BUDGETS) - len(BUDGETS)  # one decode row per token after each first
    assert health["requests"]["completed"] == len(bodies) and health["batch"]["unbatched_reason"] is None
    assert f'tqbench_requests_total{{outcome="completed"}} {len(bodies)}' in metrics
    assert f"tqbench_decode_steps_total {len(steps)}" in metrics
    assert f"tqbench_decode_rows_total {sum(sizes)}" in metrics
    assert f"tqbench_generated_tokens_total {sum(BUDGETS)}" in metrics


def test_other_policies_wait_their_turn_and_never_share_a_step(tiny_engine64):
    policies = ["turbo4", "fp16", "turbo4", "fp16", "turbo4"]
    bodies = _bodies(policies)
    solo = [tiny_engine64.generate(b["messages"], p, max_new_tokens=b["max_tokens"], stop_at_eos=False)
            for b, p in zip(bodies, policies)]
    answers, steps, _, _ = _run_held(tiny_engine64, bodies)
    assert [a[2]["tqbench"]["token_ids"] for a in answers] == [s.token_ids for s in solo]
    assert all(len(labels) == 1 for _, labels in steps)  # every forward call served one policy


def test_fused_mode_batches_too():
    import torch

    from tqbench.engine.engine import Engine

    engine = Engine.tiny(dtype=torch.float64)  # its own model: the fused mode reroutes the model's attention
    bodies = _bodies(["turbo4"] * 4)
    solo = [engine.generate(b["messages"], "turbo4", "fused", max_new_tokens=b["max_tokens"],
                            stop_at_eos=False) for b in bodies]
    answers, steps, health, _ = _run_held(engine, bodies, cache_mode="fused")
    assert [a[2]["tqbench"]["token_ids"] for a in answers] == [s.token_ids for s in solo]
    assert max(n for n, _ in steps) == 4  # all four decoded in one forward call
    assert health["batch"]["unbatched_reason"] is None and health["cache_mode"] == "fused"
    assert health["fused_implementation"]["implementation"] == "native-cpu"


def test_metrics_is_prometheus_text(live_server):
    assert live_server.request("GET", "/v1/nothing-here")[0] == 404  # refused requests are counted (issue 42)
    status, headers, text = live_server.request("GET", "/metrics")
    assert re.search(r'^tqbench_error_responses_total\{status="404"\} [1-9]', text, re.M), text
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    sample = re.compile(r'^[a-z_:0-9]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? -?[0-9.e+-]+$')
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge")
            names.add(name)
        elif not line.startswith("# HELP "):
            assert sample.match(line), line
    assert {"tqbench_requests_total", "tqbench_queue_depth", "tqbench_batch_size", "tqbench_decode_tokens_per_second",
            "tqbench_kv_resident_bytes", "tqbench_generated_tokens_total", "tqbench:kv_cache_usage_perc",
            "tqbench:num_requests_running", "tqbench:num_requests_waiting", "tqbench:kv_cache_budget_bytes"} <= names
