"""Load on a small queue (every request: same tokens as a solo greedy run, or a clean 429) and disconnects.

Nothing here depends on how fast the machine is: a ``GatedEngine`` holds the worker where a test needs a
full queue, and the tests wait on worker state and token counts, never on elapsed time.
"""

from __future__ import annotations

import http.client
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from serverkit import CEILING, GatedEngine, LiveServer, sse_events, stream_chat, wait_for

pytestmark = pytest.mark.server

PROMPTS = ["Say hello.", "Count to five.", "What is a cache?", "Name a colour."]
TOKENS = 8


def test_48_streams_at_concurrency_8_on_a_queue_of_2(tiny_engine):
    from tqbench.server import create_app

    solo = {p: tiny_engine.generate([{"role": "user", "content": p}], "turbo4", max_new_tokens=TOKENS)
            for p in PROMPTS}
    app = create_app(tiny_engine, kv_policy="turbo4", max_new_tokens=64, max_queue=2)
    worker = app.state.server.worker
    # The first generation waits until the full queue has turned a request away: at least 3 requests (the
    # running one and the 2 queued) complete and at least one gets a 429, however fast or slow the machine.
    worker.engine = GatedEngine(tiny_engine)
    opener = threading.Thread(target=lambda: wait_for(lambda: worker.stats["rejected"] >= 1)
                              and worker.engine.gate.set(), daemon=True)
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
        opener.start()
        try:
            list(pool.map(one, range(48)))
        finally:
            worker.engine.gate.set()
        assert wait_for(lambda: worker.running is None and worker.waiting == 0)
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
        conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=CEILING)
        body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 4000, "stream": True,
                "ignore_eos": True}
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        seen = 0
        while seen < 3:  # a few content chunks: the long generation is running
            line = resp.readline()
            assert line, "the stream ended before the client disconnected"
            seen += line.startswith(b"data: ") and b'"content"' in line
        assert live.state.worker.running is not None
        conn.sock.close()  # the client goes away mid-stream
        conn.close()

        # The slot frees because the engine stops the abandoned generation (cancelled, not 4000 tokens
        # later): the next request then runs and completes. Counted, not timed.
        stats = live.state.worker.stats
        assert wait_for(lambda: stats["cancelled"] + stats["completed"] == 1), stats
        assert stats["cancelled"] == 1, stats
        status, _, data = live.request("POST", "/v1/chat/completions",
                                       {"messages": [{"role": "user", "content": "next"}], "max_tokens": 4})
        assert status == 200
        assert data["usage"]["completion_tokens"] >= 1
        assert wait_for(lambda: stats["completed"] == 1), stats
        assert stats["cancelled"] == 1


def test_disconnect_while_queued_skips_the_job(tiny_engine):
    from tqbench.server import create_app

    app = create_app(tiny_engine, kv_policy="fp16", max_new_tokens=4000, max_queue=2)
    worker = app.state.server.worker
    worker.engine = GatedEngine(tiny_engine)  # the first request runs only once the second has left
    with LiveServer(app) as live:
        first = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 8, "ignore_eos": True}
        answers = []
        runner = threading.Thread(target=lambda: answers.append(
            live.request("POST", "/v1/chat/completions", first)))
        runner.start()
        try:
            assert wait_for(lambda: worker.running is not None)
            conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=CEILING)
            conn.request("POST", "/v1/chat/completions", body=json.dumps({**first, "max_tokens": 4}),
                         headers={"Content-Type": "application/json"})
            assert wait_for(lambda: worker.waiting == 1)
            conn.sock.close()  # the client leaves while its request waits
            conn.close()
            assert wait_for(lambda: [j.cancelled.is_set() for j in worker.waiting_jobs()] == [True])
        finally:
            worker.engine.gate.set()
        runner.join(CEILING)
        assert answers and answers[0][0] == 200
        stats = worker.stats
        assert wait_for(lambda: stats["skipped"] + stats["completed"] == 2), stats
        assert stats["skipped"] == 1 and stats["completed"] == 1


def test_shutdown_ends_running_streams_and_refuses_new_requests(tiny_engine):
    from tqbench.server import create_app

    app = create_app(tiny_engine, kv_policy="fp16", max_new_tokens=4000, max_queue=2)
    with LiveServer(app) as live:
        conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=CEILING)
        body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 4000, "stream": True,
                "ignore_eos": True}
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.readline().startswith(b"data: ")
        live.state.worker.cancel_all()  # what Ctrl-C does before uvicorn stops
        rest = resp.read().decode()
        conn.close()
        assert rest.rstrip().endswith("data: [DONE]")
        final = [e for e in sse_events(rest) if isinstance(e, dict) and e.get("tqbench")][-1]
        # ended by the cancel, not by running out its 4000 tokens (a count, not a stopwatch)
        assert final["tqbench"]["stopped_by"] == "cancelled"
        assert final["usage"]["completion_tokens"] < 4000
        status, _, data = live.request("POST", "/v1/chat/completions",
                                       {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
        assert status == 503 and data["error"]["code"] == "shutting_down"
