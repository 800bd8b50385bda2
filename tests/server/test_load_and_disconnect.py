"""Load on a small queue (every request: same tokens as a solo greedy run, or a clean 429) and disconnects."""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from serverkit import LiveServer, stream_chat, wait_for

pytestmark = pytest.mark.server

PROMPTS = ["Say hello.", "Count to five.", "What is a cache?", "Name a colour."]
TOKENS = 8


def test_48_streams_at_concurrency_8_on_a_queue_of_2(tiny_engine):
    from tqbench.server import create_app

    solo = {p: tiny_engine.generate([{"role": "user", "content": p}], "turbo4", max_new_tokens=TOKENS)
            for p in PROMPTS}
    app = create_app(tiny_engine, kv_policy="turbo4", max_new_tokens=64, max_queue=2)
    outcomes = []
    lock = threading.Lock()

    def one(i: int) -> None:
        prompt = PROMPTS[i % len(PROMPTS)]
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": TOKENS, "temperature": 0,
                "stream_options": {"include_usage": True}}
        status, headers, text, events = stream_chat(live.port, body)
        with lock:
            outcomes.append((prompt, status, headers, text, events))

    with LiveServer(app) as live, ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(one, range(48)))
        assert wait_for(lambda: live.state.worker.running is None and live.state.worker.waiting == 0)
        _, _, health = live.request("GET", "/health")

    statuses = [o[1] for o in outcomes]
    assert len(outcomes) == 48
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) >= 3 and statuses.count(429) >= 1
    for prompt, status, headers, text, events in outcomes:
        if status == 429:
            assert int(headers["retry-after"]) >= 1
            assert events[0]["error"]["code"] == "queue_full"
            assert "retry after" in events[0]["error"]["message"]
            continue
        want = solo[prompt]
        assert text == want.text
        assert events[-1] == "[DONE]"
        final = events[-2]
        assert final["usage"]["completion_tokens"] == want.output_tokens
        assert final["tqbench"]["token_ids"] == want.token_ids
    assert health["requests"]["completed"] == statuses.count(200)
    assert health["requests"]["rejected"] == statuses.count(429)
    assert health["requests"]["failed"] == 0


def test_disconnect_mid_stream_frees_the_slot(tiny_engine):
    from tqbench.server import create_app

    app = create_app(tiny_engine, kv_policy="fp16", max_new_tokens=4000, max_queue=2)
    with LiveServer(app) as live:
        conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=30)
        body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 4000, "stream": True,
                "ignore_eos": True}
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        seen = 0
        while seen < 3:  # a few content chunks: the long generation is running
            line = resp.readline()
            seen += line.startswith(b"data: ") and b'"content"' in line
        assert live.state.worker.running is not None
        conn.sock.close()  # the client goes away mid-stream
        conn.close()

        start = time.perf_counter()
        status, _, data = live.request("POST", "/v1/chat/completions",
                                       {"messages": [{"role": "user", "content": "next"}], "max_tokens": 4})
        elapsed = time.perf_counter() - start
        assert status == 200
        assert data["tqbench"]["queue_seconds"] < 2.0, data["tqbench"]
        assert elapsed < 5.0
        stats = live.state.worker.stats
        assert wait_for(lambda: stats["completed"] == 1), stats
        assert stats["cancelled"] == 1


def test_disconnect_while_queued_skips_the_job(tiny_engine):
    from tqbench.server import create_app

    app = create_app(tiny_engine, kv_policy="fp16", max_new_tokens=4000, max_queue=2)
    with LiveServer(app) as live:
        long = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 600, "ignore_eos": True}
        runner = threading.Thread(target=live.request, args=("POST", "/v1/chat/completions", long))
        runner.start()
        deadline = time.monotonic() + 10
        while live.state.worker.running is None and time.monotonic() < deadline:
            time.sleep(0.01)
        conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=30)
        conn.request("POST", "/v1/chat/completions", body=json.dumps({**long, "max_tokens": 4}),
                     headers={"Content-Type": "application/json"})
        deadline = time.monotonic() + 5
        while live.state.worker.waiting == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert live.state.worker.waiting == 1
        conn.sock.close()
        conn.close()
        runner.join(60)
        stats = live.state.worker.stats
        assert wait_for(lambda: stats["skipped"] + stats["completed"] == 2), stats
        assert stats["skipped"] == 1 and stats["completed"] == 1


def test_shutdown_ends_running_streams_and_refuses_new_requests(tiny_engine):
    from tqbench.server import create_app

    app = create_app(tiny_engine, kv_policy="fp16", max_new_tokens=4000, max_queue=2)
    with LiveServer(app) as live:
        conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=30)
        body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 4000, "stream": True,
                "ignore_eos": True}
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.readline().startswith(b"data: ")
        live.state.worker.cancel_all()  # what Ctrl-C does before uvicorn stops
        start = time.perf_counter()
        rest = resp.read().decode()
        conn.close()
        assert time.perf_counter() - start < 5.0
        assert rest.rstrip().endswith("data: [DONE]")
        assert '"stopped_by": "cancelled"' in rest
        status, _, data = live.request("POST", "/v1/chat/completions",
                                       {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
        assert status == 503 and data["error"]["code"] == "shutting_down"
