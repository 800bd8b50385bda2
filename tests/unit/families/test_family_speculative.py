"""Prompt-lookup decoding on every family's random-weight model (float64) in every cache mode it runs: the
tokens of plain greedy decoding. The families that refuse the fused mode (Falcon, DeepSeek-V3) cannot install
tqbench's attention, so their compressed and simulate caches refuse speculation with what to do instead."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.unit.families.short_windows import short_window_model
from tests.unit.families.test_family_matrix import NO_FUSED
from tqbench.constants import CACHE_MODES
from tqbench.engine.cache.fused import FusedUnsupportedError
from tqbench.engine.engine import Engine
from tqbench.engine.models.families import FAMILIES
from tqbench.engine.validate.quality import corpus_ids

#: packs rows on the families' 8-token sliding windows too, and inside a 4-token verification call
POLICY = "turbo4,recent=4"
NEW = 16


@functools.cache
def engine(family: str) -> Engine:
    return Engine(short_window_model(family, dtype=torch.float64))


@functools.cache
def prompt(family: str) -> torch.Tensor:
    ids = corpus_ids(engine(family).tokenizer, "rivers", 20)
    return torch.cat([ids, ids], 1)  # repeated: prompt lookup finds drafts


def _generate(eng: Engine, cache, **kw) -> list[int]:
    ids = kw.pop("ids")
    out = eng.model.generate(ids, cache=cache, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             pad_token_id=eng.tokenizer.pad_token_id, **kw)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("family,mode", [(f, m) for f in FAMILIES for m in CACHE_MODES])
def test_prompt_lookup_gives_greedy_tokens(family, mode):
    eng, ids = engine(family), prompt(family)
    if family in NO_FUSED:
        if mode in ("compressed", "simulate"):
            with pytest.raises(ValueError, match="needs tqbench's attention function"):
                _generate(eng, eng.make_cache(POLICY, mode), ids=ids, prompt_lookup_num_tokens=4)
            return
        if mode == "fused":
            with pytest.raises(FusedUnsupportedError):
                eng.make_cache(POLICY, mode)
            return
    else:
        eng.enable_fused()
    plain = _generate(eng, eng.make_cache(POLICY, mode), ids=ids)
    cache = eng.make_cache(POLICY, mode)
    assert _generate(eng, cache, ids=ids, prompt_lookup_num_tokens=4) == plain
    assert cache.get_seq_length() == ids.shape[1] + NEW - 1
