"""Fused batching across the family matrix (float64): sequences of different lengths decode in one forward
call, each attending over its own packed store, and give exactly their solo fused tokens. Mixed sliding/full
families batch too under the default ``sliding=auto`` (window-bounded compressed stores); with
``sliding=bypass`` (transformers' dense windows) they do not batch and say so (``why_not_batched``)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.families.short_windows import short_window_model
from tests.unit.families.test_family_matrix import NO_FUSED
from tqbench.engine.batch import decode_step, why_not_batched
from tqbench.engine.engine import Engine
from tqbench.engine.models.families import FAMILIES
from tqbench.engine.validate.quality import corpus_ids

LENGTHS = (40, 27, 33)
BUDGETS = (8, 11, 5)
POLICY = "turbo4,recent=4,sink=2"
#: mixed sliding/full families: under sliding=bypass their windows stay dense (bounded history): no batching
SLIDING = ("gemma2", "gemma3_text", "gpt_oss")


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in NO_FUSED])
def test_fused_batch_equals_solo_float64(family):
    eng = Engine(short_window_model(family, dtype=torch.float64))
    eng.enable_fused()
    ids = corpus_ids(eng.tokenizer, "rivers", max(LENGTHS))
    prompts = [ids[:, :n] for n in LENGTHS]
    solo = [eng.generate(p, POLICY, "fused", max_new_tokens=b, stop_at_eos=False).token_ids
            for p, b in zip(prompts, BUDGETS)]
    seqs = [eng.sequence(p, POLICY, "fused", max_new_tokens=b, stop_at_eos=False, run=str(i))
            for i, (p, b) in enumerate(zip(prompts, BUDGETS))]
    why = why_not_batched(seqs[0].cache)
    if family in SLIDING:
        dense = eng.sequence(prompts[0], POLICY + ",sliding=bypass", "fused", max_new_tokens=1, stop_at_eos=False)
        assert why_not_batched(dense.cache) == ("the policy keeps dense sliding-window layers, which bound their "
                                                "own history")
    assert why is None, why
    for s in seqs:
        s.start()
    sizes = []
    while True:
        for s in seqs:
            if not s.done:
                s.step()
        going = [s for s in seqs if not s.done]
        if not going:
            break
        sizes.append(len(going))
        decode_step(eng.model, going)
    assert max(sizes) == len(seqs)
    assert [s.result.token_ids for s in seqs] == solo
    for s in seqs:
        rep = s.cache.report()
        assert rep.fused_calls > 0 and rep.fallbacks == {}
