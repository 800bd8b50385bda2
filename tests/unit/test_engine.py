import pytest

from tqbench.engine.events import GenerationFinished, GenerationStarted, PairStep, PrefillDone, TokenGenerated
from tqbench.engine.generate import Sampling


def test_stream_yields_events_in_order(tiny_engine):
    events = list(tiny_engine.stream("hello there", "turbo4", max_new_tokens=6, stop_at_eos=False))
    assert isinstance(events[0], GenerationStarted) and isinstance(events[1], PrefillDone)
    toks = [e for e in events if isinstance(e, TokenGenerated)]
    assert [t.step for t in toks] == list(range(6))
    fin = events[-1]
    assert isinstance(fin, GenerationFinished)
    assert fin.result.token_ids == [t.token_id for t in toks]
    assert "".join(t.text_delta for t in toks) == fin.result.text
    assert fin.result.cache_report.cache_mode == "compressed"
    assert len(fin.result.step_seconds) == 5


def test_greedy_is_deterministic_and_seeded_sampling_reproducible(tiny_engine):
    a = tiny_engine.generate("abc", "fp16", max_new_tokens=8, stop_at_eos=False)
    b = tiny_engine.generate("abc", "fp16", max_new_tokens=8, stop_at_eos=False)
    assert a.token_ids == b.token_ids
    s = Sampling(temperature=1.0, top_p=0.9, seed=7)
    c = tiny_engine.generate("abc", "fp16", max_new_tokens=8, sampling=s, stop_at_eos=False)
    d = tiny_engine.generate("abc", "fp16", max_new_tokens=8, sampling=s, stop_at_eos=False)
    assert c.token_ids == d.token_ids
    e = tiny_engine.generate("abc", "fp16", max_new_tokens=8, sampling=Sampling(1.0, 0.9, 8), stop_at_eos=False)
    assert e.token_ids != c.token_ids


def test_chat_template_on_and_off(tiny_engine):
    on = tiny_engine.encode_prompt("hi", chat=True)
    off = tiny_engine.encode_prompt("hi", chat=False)
    assert on.shape[1] > off.shape[1]


def test_stops_at_eos(tiny_engine):
    eos = next(iter(tiny_engine.eos_ids))
    seen = tiny_engine.generate("abc", "fp16", max_new_tokens=30, stop_at_eos=False).token_ids
    if eos in seen:
        r = tiny_engine.generate("abc", "fp16", max_new_tokens=30)
        assert r.stopped_by == "eos" and r.token_ids[-1] == eos


def test_cancel_stops_the_stream(tiny_engine):
    calls = {"n": 0}

    def cancel():
        calls["n"] += 1
        return calls["n"] > 3

    r = tiny_engine.generate("abc", "turbo4", max_new_tokens=50, cancel=cancel, stop_at_eos=False)
    assert r.stopped_by == "cancelled" and len(r.token_ids) == 3


def test_lockstep_pairs_baseline_and_candidate(tiny_engine):
    events = list(tiny_engine.lockstep("hello world", "fp16", "fp16", max_new_tokens=5))
    steps = [e for e in events if isinstance(e, PairStep)]
    assert len(steps) >= 1
    assert all(s.same_token and s.same_top1 and s.kl == pytest.approx(0, abs=1e-9) for s in steps)
    events = list(tiny_engine.lockstep("hello world", "fp16", "k=turbo1,v=turbo1", max_new_tokens=5))
    steps = [e for e in events if isinstance(e, PairStep)]
    assert any(s.kl and s.kl > 0 for s in steps)
    finished = [e for e in events if isinstance(e, GenerationFinished)]
    assert {f.run for f in finished} == {"baseline", "candidate"}


@pytest.mark.parametrize("bad, needle", [
    (dict(max_new_tokens=0), "max_new_tokens=0 is invalid"),
    (dict(sampling=None), None),
])
def test_bad_generation_arguments(tiny_engine, bad, needle):
    if needle is None:
        with pytest.raises(ValueError, match="temperature=-1"):
            Sampling(temperature=-1)
        return
    with pytest.raises(ValueError, match=needle):
        tiny_engine.generate("abc", "fp16", **bad)


def test_prompt_longer_than_context_is_refused(tiny_engine):
    n = tiny_engine.max_context
    with pytest.raises(ValueError, match="has a context of"):
        tiny_engine.encode_prompt("word " * (n + 10), chat=False)


def test_empty_prompt_is_refused(tiny_engine):
    with pytest.raises(ValueError, match="the prompt is empty"):
        tiny_engine.encode_prompt("   ")
