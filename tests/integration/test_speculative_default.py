"""Prompt-lookup decoding with a compressed cache on the real default model: turbo4 in fused and compressed
mode gives the tokens of plain greedy decoding (float64)."""

from __future__ import annotations

import pytest

from tests.integration.default_model import require_default_model
from tqbench.engine.engine import Engine

pytestmark = pytest.mark.integration

PROMPT = ("Repeat this list exactly, then continue it with three more animals: cat, dog, horse, cow, sheep, "
          "goat, pig, duck, goose, hen. The list again: cat, dog, horse,")


@pytest.fixture(scope="module")
def engine64():
    require_default_model()
    return Engine.load("default", device="cpu", dtype="float64", threads=1)


@pytest.mark.parametrize("mode", ["fused", "compressed"])
def test_prompt_lookup_turbo4_gives_plain_greedy_tokens_in_float64(engine64, mode):
    eng = engine64
    ids = eng.encode_prompt(PROMPT)
    eng.enable_fused()  # compressed mode's verification calls need tqbench's attention too

    def run(**kw):
        cache = eng.make_cache("turbo4", mode)
        out = eng.model.generate(ids, max_new_tokens=40, min_new_tokens=40, do_sample=False, cache=cache, **kw)
        return out[0, ids.shape[1]:].tolist(), cache

    plain, _ = run()
    spec, cache = run(prompt_lookup_num_tokens=8)
    assert spec == plain
    assert sum(la.verify_calls for la in cache.layers if hasattr(la, "verify_calls")) > 0
    assert len(plain) == 40 and cache.get_seq_length() == ids.shape[1] + 39
