"""The prefix cache (``serve --prefix-cache``, ``cache_prefix``): a shared prefix compressed once and reused.

Exact tokens (float64 tiny models, greedy): a request served from the stored compressed prefix answers what
``Engine.compress(prefix)`` then generating in-process answers, for the default policy, an evicting one (keep at the
prefix's end: query-agnostic) and a sliding-window family past its window; under a policy that keeps every row
exactly it answers what the uncompressed path answers. Bytes: a prefix's bytes count once (``/metrics``,
``/health``, the response), however many requests read it; entries, bytes and live tensors do not grow with the
number of requests; a byte cap evicts the least recently used prefix.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading

import pytest
import torch
from serverkit import GatedEngine, LiveServer, wait_for

from tqbench.server import create_app

PROMPT = ("the quick brown fox jumps over the lazy dog while the river runs past the old mill and the miller "
          "counts his sacks of grain one by one ") * 2
EVICTING = "turbo4,keep=0.5,score=snapkv,window=8"
NEW = 6


@pytest.fixture(scope="module")
def engine64():
    from tqbench.engine.engine import Engine

    torch.set_num_threads(1)
    return Engine.tiny(dtype=torch.float64)


@pytest.fixture(scope="module")
def ids(engine64):
    return engine64.tokenizer(PROMPT, return_tensors="pt")["input_ids"]


@pytest.fixture(scope="module")
def live(engine64):
    app = create_app(engine64, kv_policy="turbo4", max_new_tokens=64, max_queue=16)
    with LiveServer(app) as server:
        yield server


def complete(server, ids: list[int], **extra):
    body = {"prompt": ids, "max_tokens": NEW, "ignore_eos": True, **extra}
    status, _, data = server.request("POST", "/v1/completions", body)
    assert status == 200, data
    return data


@contextlib.contextmanager
def _logged(log: logging.Logger):
    """The INFO lines ``log`` emits meanwhile (LiveServer runs uvicorn at log level warning)."""
    handler, level = _Lines(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield handler.lines
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def in_process(engine, ids, cut: int, policy: str, mode: str = "compressed") -> list[int]:
    ctx = engine.compress(ids[:, :cut], policy, mode, prefill_chunk=0)
    return ctx.generate(ids[:, cut:], max_new_tokens=NEW, stop_at_eos=False).token_ids


@pytest.mark.parametrize(("policy", "mode"), [("turbo4", "compressed"), ("turbo4", "fused"),
                                              (EVICTING, "compressed")])
def test_cached_prefix_answers_as_compress_then_generate(live, engine64, ids, policy, mode):
    from tqbench.engine.cache import estimate_kv

    live.state.prefix_cache.clear()
    cut = 40
    full = ids[0].tolist()
    first = complete(live, full[:60], cache_prefix=cut, kv_policy=policy, cache_mode=mode)
    second = complete(live, full[:55], cache_prefix=cut, kv_policy=policy, cache_mode=mode)
    auto = complete(live, full[:50], kv_policy=policy, cache_mode=mode)  # no prefix named: the longest stored
    p1, p2, p3 = (r["tqbench"]["prefix_cache"] for r in (first, second, auto))
    assert (p1["hit"], p2["hit"], p3["hit"]) == (False, True, True)
    assert p1["key"] == p2["key"] == p3["key"] and p1["tokens"] == cut and p1["stored"]
    for r, n in ((first, 60), (second, 55), (auto, 50)):
        assert r["tqbench"]["token_ids"] == in_process(engine64, ids[:, :n], cut, policy, mode)
        assert r["usage"]["prompt_tokens"] == n
        # bytes to the byte: the estimate of a cache prefilled up to the prefix, every later row appended
        report = r["tqbench"]["cache_report"]
        assert report["compressed_storage_bytes"] == estimate_kv(policy, engine64.geometry, n + NEW - 1,
                                                                 prefill=cut).total_bytes
        if mode == "fused":
            assert report["fused_calls"] > 0 and not report["fallbacks"]
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # it compressed the prefix itself
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": cut}
    # the request's cache holds the prefix's rows + its own: its report counts every token
    assert second["tqbench"]["cache_report"]["tokens"] == 55 + NEW - 1
    if policy == EVICTING:  # query-agnostic: the kept rows were chosen at the prefix's end, not the prompt's
        aware = engine64.generate(ids[:, :55], policy, max_new_tokens=NEW, stop_at_eos=False, prefill_chunk=0)
        assert aware.cache_report.compressed_storage_bytes < second["tqbench"]["cache_report"][
            "compressed_storage_bytes"]


def test_lossless_policy_answers_as_the_uncompressed_path(live, engine64, ids):
    live.state.prefix_cache.clear()
    full = ids[0].tolist()
    complete(live, full[:48], cache_prefix=30, kv_policy="fp16")
    hit = complete(live, full[:52], cache_prefix=30, kv_policy="fp16")
    assert hit["tqbench"]["prefix_cache"]["hit"]
    plain = engine64.generate(ids[:, :52], None, max_new_tokens=NEW, stop_at_eos=False)  # DynamicCache
    assert hit["tqbench"]["token_ids"] == plain.token_ids


def test_bytes_count_once_and_nothing_grows_with_requests(live, engine64, ids):
    """N requests reading one prefix: one entry, its bytes once (metrics, health, response), the same live
    tensors after the 3rd request as after the Nth (each request's private copy is freed when it ends)."""
    live.state.prefix_cache.clear()
    full = ids[0].tolist()
    cut = 32

    def tensors() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))

    start = dict(live.state.prefix_cache.counters)
    for k in range(3):
        complete(live, full[:cut + 4 + k], cache_prefix=cut)
    stored = live.state.prefix_cache.entries()[0]
    before = tensors()
    for k in range(12):
        r = complete(live, full[:cut + 4 + k % 5], cache_prefix=cut)
        assert r["tqbench"]["prefix_cache"] == {**r["tqbench"]["prefix_cache"], "hit": True,
                                                "bytes": stored.bytes, "key": stored.key}
    assert tensors() <= before
    stats = live.state.prefix_cache.stats()
    assert (stats["entries"], stats["bytes"], stats["hits"] - start["hits"], stats["misses"] - start["misses"]) == (
        1, stored.bytes, 14, 1)
    assert stored.bytes == stored.context.report().compressed_storage_bytes > 0
    _, _, text = live.request("GET", "/metrics")
    assert f"tqbench_prefix_cache_bytes {stored.bytes}\n" in text
    assert "tqbench_prefix_cache_entries 1\n" in text
    assert f'tqbench_prefix_cache_requests_total{{outcome="hit"}} {stats["hits"]}\n' in text
    assert stats["hit_tokens"] - start["hit_tokens"] == 14 * cut
    _, _, health = live.request("GET", "/health")
    assert health["prefix_cache"]["prefixes"] == [{"key": stored.key, "tokens": cut, "bytes": stored.bytes,
                                                   "kv_policy": "turbo4", "cache_mode": "compressed", "hits": 14}]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record) -> None:
        self.lines.append(record.getMessage())


def test_byte_cap_evicts_the_least_recently_used(engine64, ids):
    full = ids[0].tolist()
    one = engine64.compress(ids[:, :30], "turbo4", "compressed", prefill_chunk=0).report().compressed_storage_bytes
    app = create_app(engine64, kv_policy="turbo4", max_new_tokens=64, max_queue=4, prefix_cache=one * 2 + 100)
    log = logging.getLogger("uvicorn.error")  # the server's log (uvicorn prints it at --log-level info)
    with LiveServer(app) as server, _logged(log) as lines:
        cache = server.state.prefix_cache
        a = complete(server, full[:40], cache_prefix=30)
        complete(server, full[10:50], cache_prefix=30)  # another prefix: both fit
        complete(server, full[:42], cache_prefix=30)  # a hit: a is now the most recently used
        c = complete(server, full[20:60], cache_prefix=30)  # a third: the least recently used (b) goes
        assert c["tqbench"]["prefix_cache"]["stored"]
        assert cache.counters["evicted"] == 1 and len(cache) == 2 and cache.total_bytes <= cache.cap
        assert {e.key for e in cache.entries()} == {a["tqbench"]["prefix_cache"]["key"],
                                                    c["tqbench"]["prefix_cache"]["key"]}
        b_again = complete(server, full[10:52], cache_prefix=30)
        assert not b_again["tqbench"]["prefix_cache"]["hit"]  # compressed again after its eviction
        _, _, text = server.request("GET", "/metrics")
        assert "tqbench_prefix_cache_evictions_total 2\n" in text
    a_key = a["tqbench"]["prefix_cache"]["key"]
    assert f"prefix cache: stored {a_key} (30 tokens, {one} bytes, turbo4, compressed, compressed in" in lines[0]
    assert lines[0].endswith(f"1 entries, {one} of {one * 2 + 100} bytes")
    assert lines[2].startswith(f"prefix cache: hit {a_key} (30 tokens, {one} bytes, turbo4, compressed; hit 1 times)")
    assert sum(x.startswith("prefix cache: evicted ") and "least recently used" in x for x in lines) == 2
    small = create_app(engine64, kv_policy="turbo4", max_new_tokens=64, max_queue=4, prefix_cache=one - 1)
    with LiveServer(small) as server:
        r = complete(server, full[:40], cache_prefix=30)
        use = r["tqbench"]["prefix_cache"]
        assert (use["stored"], use["hit"]) == (False, False) and "more than the whole prefix cache" in use["reason"]
        assert r["tqbench"]["token_ids"] == in_process(engine64, ids[:, :40], 30, "turbo4")
        assert len(server.state.prefix_cache) == 0


def test_chat_system_prompt_is_the_prefix(live, engine64):
    live.state.prefix_cache.clear()
    system = {"role": "system", "content": "You answer questions about rivers and mills in one short line."}
    answers = []
    for q in ("Where does the river run?", "Who counts the sacks?"):
        body = {"messages": [system, {"role": "user", "content": q}], "max_tokens": NEW, "ignore_eos": True,
                "cache_prefix": True}
        status, _, data = live.request("POST", "/v1/chat/completions", body)
        assert status == 200, data
        answers.append(data)
    head = engine64.tokenizer.apply_chat_template([system], add_generation_prompt=False)
    head = list(head["input_ids"] if not isinstance(head, list) else head)
    assert [a["tqbench"]["prefix_cache"]["tokens"] for a in answers] == [len(head)] * 2
    assert [a["tqbench"]["prefix_cache"]["hit"] for a in answers] == [False, True]
    ids = engine64.encode_prompt(body["messages"], chat=True)
    assert answers[1]["tqbench"]["token_ids"] == in_process(engine64, ids, len(head), "turbo4")


@pytest.mark.parametrize("mode", ["compressed", "fused"])
def test_concurrent_requests_share_one_prefix_and_batch(live, engine64, ids, mode):
    """Requests queued together (held by a gate) decode in one batch, each from its own copy of one stored prefix."""
    live.state.prefix_cache.clear()
    full = ids[0].tolist()
    cut = 36
    complete(live, full[:cut + 2], cache_prefix=cut, cache_mode=mode)  # stored
    worker = live.state.worker
    gated = GatedEngine(engine64)
    worker.engine = gated
    results: dict[int, dict] = {}
    lengths = (40, 47, 44, 52)
    try:
        threads = [threading.Thread(target=lambda i=i, n=n: results.__setitem__(
            i, complete(live, full[:n], cache_mode=mode))) for i, n in enumerate(lengths)]
        for t in threads:
            t.start()
        assert wait_for(lambda: worker.waiting >= len(lengths) - 1)
        steps = worker.counters["decode_steps"]
        gated.gate.set()
        for t in threads:
            t.join()
    finally:
        worker.engine = engine64
    for i, n in enumerate(lengths):
        assert results[i]["tqbench"]["prefix_cache"]["hit"]
        assert results[i]["tqbench"]["token_ids"] == in_process(engine64, ids[:, :n], cut, "turbo4", mode)
    assert worker.counters["decode_steps"] - steps < len(lengths) * (NEW - 1)  # some steps ran them together
    assert live.state.prefix_cache.stats()["entries"] == 1


def test_sliding_window_family_past_its_window():
    from tqbench.engine.engine import Engine
    from tqbench.engine.models.families import family_model
    from tqbench.engine.validate.quality import corpus_ids

    eng = Engine(family_model("gemma3_text", dtype=torch.float64))
    assert eng.geometry.sliding_window == 8
    ids = corpus_ids(eng.tokenizer, "rivers", 48)
    app = create_app(eng, kv_policy="turbo4", max_new_tokens=16, max_queue=4)
    with LiveServer(app) as server:
        full = ids[0].tolist()
        for n in (40, 48):  # prefix 30 tokens (past the 8-token window), then 10 and 18 more
            r = complete(server, full[:n], cache_prefix=30)
            assert r["tqbench"]["token_ids"] == in_process(eng, ids[:, :n], 30, "turbo4")
        assert r["tqbench"]["prefix_cache"]["hit"]


@pytest.mark.parametrize(("body", "message"), [
    ({"prompt": "a b c d", "cache_prefix": True}, "names a chat's system messages"),
    ({"prompt": "a b c d", "cache_prefix": "x"}, "must be a non-empty start of the prompt"),
    ({"prompt": [1, 2, 3], "cache_prefix": 3}, "send a token count from 1 to 2"),
    ({"prompt": "a b c d", "cache_prefix": 2, "echo": True, "max_tokens": 1}, "cannot run with echo"),
    ({"messages": [{"role": "user", "content": "hi"}], "cache_prefix": True}, "starts with a 'user' message"),
    ({"messages": [{"role": "user", "content": "hi"}], "cache_prefix": "hi"}, "not text"),
    ({"messages": [{"role": "user", "content": "hi"}], "cache_prefix": 2}, "message count from 1 to 1"),
])
def test_bad_cache_prefix_is_a_400_saying_what_to_send(live, body, message):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    status, _, data = live.request("POST", path, {"max_tokens": 2, **body})
    assert status == 400 and data["error"]["param"] == "cache_prefix", data
    assert message in data["error"]["message"]


def test_prefix_cache_off_refuses_cache_prefix_and_reuses_nothing(engine64, ids):
    app = create_app(engine64, kv_policy="turbo4", max_new_tokens=64, max_queue=4, prefix_cache=0)
    with LiveServer(app) as server:
        status, _, data = server.request("POST", "/v1/completions",
                                         {"prompt": ids[0, :20].tolist(), "max_tokens": 2, "cache_prefix": 10})
        assert status == 400 and "--prefix-cache SIZE" in data["error"]["message"]
        r = complete(server, ids[0, :20].tolist())
        assert r["tqbench"]["prefix_cache"] is None and "prompt_tokens_details" not in r["usage"]


def test_evicting_policy_reserves_its_cache_from_the_prefix_it_reads(live, engine64, ids):
    """Admission reserves an evicting policy's cache from the prefix (its keep at the prefix's end, every row after
    it kept); a request whose stored prefix appeared after it was admitted gets its reservation raised at start."""
    from tqbench.server.admission import request_kv_bytes

    live.state.prefix_cache.clear()
    full = ids[0].tolist()
    cut, n = 40, 56
    worker = live.state.worker
    seen: dict[str, tuple[int, bool]] = {}

    class Recording(GatedEngine):
        def compress(self, *args, **kwargs):  # the named prefix is stored only once the gate opens
            self.gate.wait()
            return self.engine.compress(*args, **kwargs)

        def sequence(self, *args, **kwargs):
            job = next(r.job for r in worker._running if f"request-{r.job.number}" == kwargs["run"])
            seen[kwargs["run"]] = (job.kv_bytes, kwargs.get("context") is not None)
            return self.engine.sequence(*args, **kwargs)

    gated = Recording(engine64)
    worker.engine = gated
    out: dict[str, dict] = {}
    try:
        named = threading.Thread(target=lambda: out.__setitem__("named", complete(
            live, full[:n], cache_prefix=cut, kv_policy=EVICTING)))
        named.start()
        assert wait_for(lambda: worker.running is not None)
        auto = threading.Thread(target=lambda: out.__setitem__("auto", complete(live, full[:n], kv_policy=EVICTING)))
        auto.start()  # admitted while nothing is stored: its reservation is the whole prompt's
        assert wait_for(lambda: worker.waiting == 1)
        gated.gate.set()
        named.join()
        auto.join()
    finally:
        worker.engine = engine64
    whole = request_kv_bytes(EVICTING, engine64.geometry, n + NEW, prompt=n)
    from_prefix = request_kv_bytes(EVICTING, engine64.geometry, n + NEW, prompt=n, prefix=cut)
    assert from_prefix > whole
    assert sorted(seen.values()) == [(from_prefix, True), (from_prefix, True)]  # auto's raised from ``whole``
    assert out["auto"]["tqbench"]["prefix_cache"]["hit"]
    assert out["auto"]["tqbench"]["cache_report"]["compressed_storage_bytes"] <= from_prefix
    assert worker.kv_reserved == 0  # every reservation was given back


def test_a_bad_prefix_cache_size_names_the_option_and_a_valid_form():
    from tqbench.server.prefix import PrefixCache

    with pytest.raises(ValueError, match=r"prefix cache size 'lots' is invalid: use a size like 24GiB"):
        PrefixCache("lots")
