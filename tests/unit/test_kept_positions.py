"""``kept_positions`` and the ``KeptTokens`` event: which positions each KV head holds after a run, from the cache."""

from tqbench.engine.cache.evict.kept import kept_positions
from tqbench.engine.events import GenerationFinished, KeptTokens
from tqbench.engine.policy import parse_policy
from tqbench.engine.policy.keep import kept_rows

PROMPT = "the quick brown fox jumps over the lazy dog and keeps running far away " * 3
POLICY = "k=turbo4,v=turbo4,sink=2,recent=4,keep=0.5,score=keynorm,window=4"


def _events(engine, policy, n=5, **kw):
    return list(engine.stream(PROMPT, policy, "compressed", max_new_tokens=n, chat=False, track_kept=True, **kw))


def test_kept_tokens_event_matches_the_cache_report_and_the_rule(tiny_engine):
    events = _events(tiny_engine, POLICY)
    kept_ev = [e for e in events if isinstance(e, KeptTokens)]
    assert len(kept_ev) == 1 and isinstance(events[events.index(kept_ev[0]) + 1], GenerationFinished)
    ev, result = kept_ev[0], events[-1].result
    k = ev.kept
    prompt_ids = tiny_engine.encode_prompt(PROMPT, chat=False)[0].tolist()
    n = len(prompt_ids)
    assert k.prompt_tokens == n and k.seen == n + 5 - 1  # the last generated token was never fed
    assert list(ev.token_ids) == prompt_ids + result.token_ids[:4]
    assert len(ev.texts) == k.seen
    assert k.policy == parse_policy(POLICY).to_string()
    target = kept_rows(n, 0.5, 2, 4, 4)
    report = {row.layer: row for row in result.cache_report.layers}
    assert [la.layer for la in k.layers] == [0, 1, 2, 3]
    for la in k.layers:
        assert len(la.heads) == 2
        assert la.evicted_prefill == n - target == report[la.layer].evicted_prefill and la.evicted_decode == 0
        for pos in la.heads:
            assert len(pos) == target + 4 == report[la.layer].tokens
            assert list(pos) == sorted(set(pos))
            assert pos[:2] == (0, 1)  # sinks
            assert pos[-8:] == tuple(range(n - 4, n + 4))  # the protected window, then every decoded row
        mask = k.mask(la.layer, 0)
        assert len(mask) == k.seen and sum(mask) == len(la.heads[0])
    # key norm ranks each head by its own keys: the heads of a layer keep different rows
    assert any(la.heads[0] != la.heads[1] for la in k.layers)
    d = k.to_dict()
    assert d["seen"] == k.seen and d["layers"][0]["kept"][1] == list(k.layers[0].heads[1])


def test_decode_eviction_keeps_the_budget_and_counts(tiny_engine):
    ev = next(e for e in _events(tiny_engine, POLICY + ",every=2", n=7) if isinstance(e, KeptTokens))
    k = ev.kept
    for la in k.layers:
        assert la.evicted_decode > 0
        assert all(len(h) == kept_rows(k.seen, 0.5, 2, 4, 4) for h in la.heads)  # 6 decoded rows: 3 eviction points


def test_no_event_without_eviction_or_without_asking(tiny_engine):
    assert not [e for e in _events(tiny_engine, "turbo4") if isinstance(e, KeptTokens)]
    plain = tiny_engine.stream(PROMPT, POLICY, "compressed", max_new_tokens=3, chat=False)
    assert not [e for e in plain if isinstance(e, KeptTokens)]


def test_layers_without_eviction_are_left_out(tiny_engine):
    ev = next(e for e in _events(tiny_engine, POLICY + ",keep@0-1=1.0") if isinstance(e, KeptTokens))
    assert [la.layer for la in ev.kept.layers] == [2, 3]
    cache = tiny_engine.make_cache(parse_policy("turbo4"), "compressed")
    assert kept_positions(cache) is None
