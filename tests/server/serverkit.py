"""A real uvicorn server on a free loopback port, and small HTTP/SSE helpers, for the server tests.

No server test may fail because the machine is slow: every wait and timeout here is a ceiling of minutes
(``CEILING``) that only a hung server reaches, and no test asserts on wall-clock time. Tests synchronise on
state (worker counters, a ``GatedEngine``), never on sleeps.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time

CEILING = 600.0  # seconds: the longest any wait or HTTP call may take before a test calls the server hung


class LiveServer:
    """uvicorn running ``app`` in a background thread on ``127.0.0.1:<free port>``."""

    def __init__(self, app) -> None:
        import uvicorn

        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + CEILING
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(CEILING)
        with contextlib.suppress(OSError):
            self.sock.close()

    @property
    def state(self):
        return self.app.state.server

    def request(self, method: str, path: str, body=None, headers: dict | None = None,
                timeout: float = CEILING):
        """(status, headers, parsed JSON or raw text) of one plain HTTP request."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            if body is not None and not isinstance(body, (bytes, str)):
                body = json.dumps(body)
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=body, headers=hdrs)
            resp = conn.getresponse()
            raw = resp.read().decode()
            try:
                data = json.loads(raw)
            except ValueError:
                data = raw
            return resp.status, dict(resp.getheaders()), data
        finally:
            conn.close()


def stream_chat(port: int, body: dict, timeout: float = CEILING) -> tuple[int, dict, str, list]:
    """POST a streaming chat request; (status, headers, concatenated content, decoded SSE payloads)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps({**body, "stream": True}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read().decode()
        if resp.status != 200:
            return resp.status, dict(resp.getheaders()), "", [json.loads(raw)]
        events = sse_events(raw)
        text = "".join(
            (e["choices"][0]["delta"].get("content") or "")
            for e in events if isinstance(e, dict) and e.get("choices")
        )
        return resp.status, dict(resp.getheaders()), text, events
    finally:
        conn.close()


def sse_events(raw: str) -> list:
    """The ``data:`` payloads of a server-sent-event body (JSON decoded; ``[DONE]`` kept as text)."""
    out = []
    for block in raw.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                payload = line[len("data: "):]
                out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def wait_for(predicate, timeout: float = CEILING) -> bool:
    """Poll ``predicate`` until it is true (the worker thread updates its counters asynchronously).

    ``timeout`` is a hang detector, not a speed requirement: only a stuck server reaches it.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


class GatedEngine:
    """Delegates to the real engine, but every new sequence (a request the worker starts) first waits until
    ``gate`` is set.

    Swap it in as ``worker.engine`` to hold the worker on a known job while a test builds a queue, without
    depending on how fast the machine generates.
    """

    def __init__(self, engine, gate: threading.Event | None = None) -> None:
        self.engine = engine
        self.gate = gate or threading.Event()

    def sequence(self, *args, **kwargs):
        self.gate.wait(CEILING)
        return self.engine.sequence(*args, **kwargs)

    def decode_step(self, seqs):
        return self.engine.decode_step(seqs)

    def __getattr__(self, name):  # everything else (enable_fused, geometry, ...) is the real engine's
        return getattr(self.engine, name)


LM_EVAL_TASKS = __import__("pathlib").Path(__file__).resolve().parents[1] / "data" / "lm_eval"


def run_lm_eval(base_url: str, model_type: str, model: str, task: str, out_dir, *extra: str,
                limit: int | None = None, timeout: float = CEILING) -> tuple[dict, list[dict]]:
    """Run ``lm_eval`` as a user would (a subprocess, offline) against ``base_url``; (results, samples).

    ``local-completions`` talks to ``/v1/completions`` and tokenizes through the server's ``/tokenize``
    (auto-detected: no tokenizer download); ``local-chat-completions`` sends chat messages.
    """
    import os
    import subprocess
    import sys
    from pathlib import Path

    endpoint = "/v1/completions" if model_type == "local-completions" else "/v1/chat/completions"
    cmd = [sys.executable, "-m", "lm_eval", "--model", model_type,
           "--model_args", f"base_url={base_url}{endpoint},model={model},max_retries=1,timeout={int(timeout)}",
           "--tasks", task, "--include_path", str(LM_EVAL_TASKS), "--output_path", str(out_dir),
           "--log_samples", *extra]
    if limit is not None:
        cmd += ["--limit", str(limit)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_CACHE": str(Path(out_dir) / "datasets-cache")}
    done = subprocess.run(cmd, cwd=LM_EVAL_TASKS, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"lm_eval failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    results = sorted(Path(out_dir).rglob("results_*.json"))
    samples = sorted(Path(out_dir).rglob(f"samples_{task}_*.jsonl"))
    assert results and samples, f"lm_eval wrote no results under {out_dir}:\n{done.stderr[-3000:]}"
    data = json.loads(results[-1].read_text())
    rows = [json.loads(line) for line in samples[-1].read_text().splitlines() if line.strip()]
    return data["results"][task], rows
