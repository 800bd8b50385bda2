"""The query-agnostic protocol with per-layer keeps (``keep@L=f``, what ``allocate --axes bits,tokens`` writes):
transformers builds one mask per layer type from the first layer's cache, so a question appended after the
eviction used to reach layers of other widths with the wrong mask (a RuntimeError in compressed/simulate mode)."""

from __future__ import annotations

import pytest
import torch

from tqbench.engine.cache.fused.install import fit_causal_mask
from tqbench.engine.events import GenerationFinished
from tqbench.engine.policy import parse_policy

POLICY = "turbo4,sink=2,recent=4,keep@0=0.5,keep@1+2=0.25"


def _answer(engine, ids, mode):
    ctx = engine.compress(ids[:, :100], parse_policy(POLICY), mode)
    res = [ev.result for ev in ctx.stream(ids[:, 100:], max_new_tokens=6) if isinstance(ev, GenerationFinished)][0]
    return res.token_ids


def test_a_question_after_per_layer_eviction_reads_each_layer_at_its_width(tiny_engine64):
    """compressed mode (the model's attention over dequantized rows, the mask refit per layer) gives the fused
    mode's tokens (the packed store read with its own masks), in float64."""
    ids = torch.randint(3, 200, (1, 120), generator=torch.Generator().manual_seed(0))
    assert _answer(tiny_engine64, ids, "compressed") == _answer(tiny_engine64, ids, "fused")


def test_the_mask_refit_keeps_causality_and_refuses_padding():
    m = torch.arange(8)[None, :] <= torch.arange(5, 8)[:, None]  # 3 queries, the last 3 of 8 rows
    fit = fit_causal_mask(m[None, None], 3, 5)
    assert fit.shape == (1, 1, 3, 5) and fit[0, 0].tolist() == [[True] * 3 + [False] * 2, [True] * 4 + [False],
                                                               [True] * 5]
    flt = torch.zeros(1, 1, 3, 8).masked_fill(~m, torch.finfo(torch.float32).min)
    assert torch.equal(fit_causal_mask(flt, 3, 5) == 0, fit)
    assert fit_causal_mask(m[None, None], 3, 8) is not None and fit_causal_mask(None, 3, 5) is None
    padded = m.clone()
    padded[:, 0] = False
    with pytest.raises(ValueError, match="with padding"):
        fit_causal_mask(padded[None, None], 3, 5)
