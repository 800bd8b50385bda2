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
    tok = tiny_engine.tokenizer
    assert tok.decode(on[0]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # the ChatML template
    assert off[0].tolist() == tok.encode("hi", add_special_tokens=False) and tok.decode(off[0]) == "hi"


def test_stops_at_eos(tiny_engine, monkeypatch):
    """Make the token the tiny model greedily writes at step k its end-of-sequence id: generation must stop
    right there (the eos token kept, nothing after it), and run on to the budget when eos is ignored."""
    free = tiny_engine.generate("abc", "fp16", max_new_tokens=30, stop_at_eos=False)
    assert free.stopped_by == "max_new_tokens" and len(free.token_ids) == 30
    k = next(i for i, t in enumerate(free.token_ids) if i >= 3 and t not in free.token_ids[:i])
    eos = free.token_ids[k]
    assert eos not in tiny_engine.eos_ids  # a plain byte token until the config names it
    monkeypatch.setattr(tiny_engine.model.generation_config, "eos_token_id", eos)
    assert eos in tiny_engine.eos_ids
    r = tiny_engine.generate("abc", "fp16", max_new_tokens=30)
    assert r.stopped_by == "eos" and r.token_ids == free.token_ids[:k + 1]
    assert r.text == tiny_engine.tokenizer.decode(free.token_ids[:k + 1])
    assert tiny_engine.generate("abc", "fp16", max_new_tokens=30, stop_at_eos=False).token_ids == free.token_ids


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
    assert [s.step for s in steps] == list(range(5))
    assert all(s.same_token and s.same_top1 and s.kl == pytest.approx(0, abs=1e-9) for s in steps)
    events = list(tiny_engine.lockstep("hello world", "fp16", "k=turbo1,v=turbo1", max_new_tokens=5))
    steps = [e for e in events if isinstance(e, PairStep)]
    assert [s.step for s in steps] == list(range(5))
    # the first token comes from the prefill, which attends over exact K/V in both runs: identical logits;
    # every later step reads 1-bit K/V and its distribution moves away from the baseline's
    assert steps[0].kl == 0.0 and steps[0].same_token, steps[0]
    assert all(s.kl > 0.1 for s in steps[1:]), [s.kl for s in steps]
    finished = {e.run: e.result for e in events if isinstance(e, GenerationFinished)}
    assert set(finished) == {"baseline", "candidate"}
    assert [s.baseline.token_id for s in steps] == finished["baseline"].token_ids
    assert [s.candidate.token_id for s in steps] == finished["candidate"].token_ids


@pytest.mark.parametrize("bad, needle", [
    (dict(max_new_tokens=0), "max_new_tokens=0 is invalid"),
    (dict(max_new_tokens=-3), "max_new_tokens=-3 is invalid"),
])
def test_bad_generation_arguments(tiny_engine, bad, needle):
    with pytest.raises(ValueError, match=needle):
        tiny_engine.generate("abc", "fp16", **bad)


@pytest.mark.parametrize("bad, needle", [
    (dict(temperature=-1), "temperature=-1 is invalid"),
    (dict(top_p=2.0), r"top_p=2 is invalid: use a number in \(0, 1\]"),
    (dict(top_p=0.0), r"top_p=0 is invalid: use a number in \(0, 1\]"),
])
def test_bad_sampling_is_refused(bad, needle):
    with pytest.raises(ValueError, match=needle):
        Sampling(**bad)


def test_prompt_longer_than_context_is_refused(tiny_engine):
    n = tiny_engine.max_context
    with pytest.raises(ValueError, match="has a context of"):
        tiny_engine.encode_prompt("word " * (n + 10), chat=False)


def test_empty_prompt_is_refused(tiny_engine):
    with pytest.raises(ValueError, match="the prompt is empty"):
        tiny_engine.encode_prompt("   ")
