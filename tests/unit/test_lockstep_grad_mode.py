"""Regression: lockstep interleaves two generators; neither may leave its grad mode to the other (or the caller)."""

import pytest
import torch

from tqbench.engine.events import GenerationFinished, PairStep

PROMPT = "Explain in a few sentences why the sky is blue."  # long enough that turbo rows get packed


@pytest.mark.parametrize("track_bytes", [False, True])
@pytest.mark.parametrize("limit", [11, 30])
def test_lockstep_survives_one_stream_stopping_first(tiny_engine, limit, track_bytes):
    calls = {"n": 0}

    def cancel():  # both streams check it; it trips mid-run, so the baseline stops a step before the candidate
        calls["n"] += 1
        return calls["n"] > limit

    events = list(tiny_engine.lockstep(PROMPT, "fp16", "turbo4", max_new_tokens=3000, cancel=cancel,
                                       track_bytes=track_bytes))
    steps = [e for e in events if isinstance(e, PairStep)]
    done = {e.run: e.result for e in events if isinstance(e, GenerationFinished)}
    assert len(steps) == limit // 2 + 1 - (limit % 2 == 0)
    assert done["baseline"].stopped_by == "cancelled" and done["candidate"].stopped_by == "cancelled"
    assert not torch.is_inference_mode_enabled()
