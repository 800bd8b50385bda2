"""The KV byte budget (``--kv-budget``): a request is admitted when its cache at prompt + max_tokens under its own
policy (the exact estimate) fits beside the running ones, else it waits; a request that could never fit is
refused; ``/health`` and ``/metrics`` (vLLM's names) show the budget, the bytes reserved, running and waiting.

Synchronised on a gated engine and worker state, never on time."""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from serverkit import CEILING, GatedEngine, LiveServer, wait_for

pytestmark = pytest.mark.server

PROMPT = "Tell me about caches."
MAX_TOKENS = 200
N = 8


class HoldSecondStep(GatedEngine):
    """Gated like ``GatedEngine``; the second decode step (the first after the admission wave) waits for ``release``."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.calls = 0
        self.held = threading.Event()
        self.release = threading.Event()

    def decode_step(self, seqs):
        self.calls += 1
        if self.calls == 2:
            self.held.set()
            self.release.wait(CEILING)
        return self.engine.decode_step(seqs)


def _bytes_per_request(engine, policy: str) -> int:
    from tqbench.engine import parse_policy
    from tqbench.server.admission import request_kv_bytes

    n = engine.encode_prompt([{"role": "user", "content": PROMPT}]).shape[1]
    return request_kv_bytes(parse_policy(policy), engine.geometry, n + MAX_TOKENS)


def _sample(text: str, name: str, policy: str) -> float:
    m = re.search(rf'^{re.escape(name)}\{{model_name="[^"]+",kv_policy="{re.escape(policy)}"\}} (\S+)$', text, re.M)
    assert m, f"{name} for {policy} not in /metrics:\n{text}"
    return float(m.group(1))


def _run(engine, policy: str, budget: int):
    """N requests of ``policy`` under ``budget``: (/metrics and /health while the admitted ones run, answers)."""
    from tqbench.server import create_app

    app = create_app(engine, kv_policy=policy, max_new_tokens=MAX_TOKENS, max_queue=N, max_batch=N,
                     kv_budget=budget)
    worker = app.state.server.worker
    hold = worker.engine = HoldSecondStep(engine)
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS, "ignore_eos": True}
    with LiveServer(app) as live, ThreadPoolExecutor(max_workers=N) as pool:
        futures = [pool.submit(live.request, "POST", "/v1/chat/completions", body) for _ in range(N)]
        assert wait_for(lambda: worker.waiting == N - 1)
        hold.gate.set()
        assert hold.held.wait(CEILING)
        _, _, metrics = live.request("GET", "/metrics")
        _, _, health = live.request("GET", "/health")
        hold.release.set()
        answers = [f.result() for f in futures]
    return metrics, health, answers


def test_the_budget_admits_more_turbo4_than_fp16_sequences(tiny_engine):
    fp16, turbo4 = _bytes_per_request(tiny_engine, "fp16"), _bytes_per_request(tiny_engine, "turbo4")
    budget = 2 * fp16 + fp16 // 2  # two fp16 caches fit, a third does not
    fits = {"fp16": 2, "turbo4": min(N, budget // turbo4)}
    assert fits["turbo4"] >= 5
    for policy, each in (("fp16", fp16), ("turbo4", turbo4)):
        metrics, health, answers = _run(tiny_engine, policy, budget)
        assert [a[0] for a in answers] == [200] * N
        assert all(a[2]["usage"]["completion_tokens"] == MAX_TOKENS for a in answers)
        running = fits[policy]
        assert _sample(metrics, "tqbench:num_requests_running", policy) == running
        assert _sample(metrics, "tqbench:num_requests_waiting", policy) == N - running
        assert _sample(metrics, "tqbench:kv_cache_reserved_bytes", policy) == running * each
        assert _sample(metrics, "tqbench:kv_cache_usage_perc", policy) == pytest.approx(running * each / budget)
        assert f'tqbench:kv_cache_budget_bytes{{model_name="{tiny_engine.name}"}} {budget}' in metrics
        kv = health["kv_budget"]
        assert (kv["budget_bytes"], kv["reserved_bytes"], kv["running"], kv["waiting"]) == \
            (budget, running * each, running, N - running)
        assert kv["by_policy"] == {policy: {"running": running, "reserved_bytes": running * each,
                                            "waiting": N - running}}


def test_a_request_that_could_never_fit_is_refused(tiny_engine):
    from tqbench.server import create_app

    fp16 = _bytes_per_request(tiny_engine, "fp16")
    app = create_app(tiny_engine, kv_policy="fp16", max_new_tokens=MAX_TOKENS, kv_budget=fp16 - 1)
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS}
    with LiveServer(app) as live:
        status, _, err = live.request("POST", "/v1/chat/completions", body)
        ok, _, _ = live.request("POST", "/v1/chat/completions", {**body, "kv_policy": "turbo4"})
    assert status == 400 and err["error"]["code"] == "kv_budget_exceeded" and err["error"]["param"] == "max_tokens"
    assert f"takes {fp16} bytes, more than the server's whole KV budget of {fp16 - 1} bytes" in err["error"]["message"]
    assert ok == 200  # the same request under a smaller policy fits


def test_kv_budget_sizes_parse_and_the_default_is_a_stated_share():
    from tqbench.constants import DEFAULT_KV_SHARE
    from tqbench.server.admission import KVBudget, available_memory

    assert KVBudget.resolve("512MiB").bytes == 512 * 2**20
    assert KVBudget.resolve("2GB").bytes == 2 * 10**9
    with pytest.raises(ValueError, match="use a size like"):
        KVBudget.resolve("lots")
    auto = KVBudget.resolve(None)
    assert f"{DEFAULT_KV_SHARE:.0%} of the" in auto.source and "available beside the model" in auto.source
    assert 0 < auto.bytes <= available_memory()[0]
