"""The model-family matrix: every family's random-weight model (``family_model``: a few MB, its own config
class, float64) x every cache mode x {fp16, turbo4, q8k-int4v}.

Per cell: the manual decode loop, plain ``model.generate()`` and a left-padded batch give the same tokens;
the byte report equals the config-only kv-estimate to the byte; fp16 equals ``DynamicCache``; lossy
policies give the same tokens in simulate, compressed and fused (float64: equivalent attention paths are
exact); turbo4's teacher-forced KL against the baseline stays under ``TURBO4_KL_BOUND`` on corpus text.
Falcon (no ``AttentionInterface``) and DeepSeek-V3 (multi-head latent attention: the cache holds the latent,
K and V are expanded after it) run every mode but fused, which they refuse (test_family_refusals.py).
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import DynamicCache

from tests.unit.families.short_windows import short_window_model
from tqbench.constants import CACHE_MODES
from tqbench.engine.cache.estimate import estimate_kv
from tqbench.engine.cache.geometry import falcon_attention_interface
from tqbench.engine.engine import Engine
from tqbench.engine.models.families import FAMILIES
from tqbench.engine.validate.quality import corpus_ids, teacher_forced

POLICIES = ("fp16", "turbo4", "q8k-int4v")
NEW = 8
PROMPT_TOKENS = 40
#: mean teacher-forced KL (nats) of KL_POLICY in fused mode, 8 steps after 40 corpus tokens: measured
#: 0.00001 (cohere) .. 0.018 (qwen2) on these models; the bound leaves ~3x room
TURBO4_KL_BOUND = 0.05
#: a recent window shorter than the families' 8-token sliding windows, so sliding layers pack rows too
KL_POLICY = "turbo4,recent=4"
#: families that refuse the fused mode (test_family_refusals.py): Falcon has no AttentionInterface,
#: DeepSeek-V3 caches its MLA latent and expands K/V after the cache
#: families whose attention tqbench cannot install (Falcon: before transformers 5.25, which routes it through
#: the AttentionInterface)
NO_FUSED = ("deepseek_v3",) if falcon_attention_interface() else ("falcon", "deepseek_v3")
CELLS = [(f, m, p) for f in FAMILIES for m in CACHE_MODES for p in POLICIES if not (f in NO_FUSED and m == "fused")]


@functools.cache
def engine(family: str) -> Engine:
    return Engine(short_window_model(family, dtype=torch.float64))


@functools.cache
def prompt(family: str, n: int = PROMPT_TOKENS) -> torch.Tensor:
    return corpus_ids(engine(family).tokenizer, "rivers", n)


@functools.cache
def baseline(family: str) -> list[int]:
    return engine(family).generate(prompt(family), None, max_new_tokens=NEW, stop_at_eos=False).token_ids


@functools.cache
def manual(family: str, mode: str, policy: str):
    r = engine(family).generate(prompt(family), policy, mode, max_new_tokens=NEW, stop_at_eos=False)
    return r.token_ids, r.cache_report


SHORT = 27


@functools.cache
def padded_batch(family: str, mode: str | None, policy: str | None) -> list[list[int]]:
    """[the prompt, its first SHORT tokens left-padded] -> the new tokens of each row."""
    eng, ids = engine(family), prompt(family)
    n = ids.shape[1]
    batch_ids = torch.cat([ids, torch.cat([torch.full((1, n - SHORT), eng.tokenizer.pad_token_id), ids[:, :SHORT]],
                                          1)], 0)
    mask = torch.ones_like(batch_ids)
    mask[1, : n - SHORT] = 0
    cache = DynamicCache(config=eng.config) if policy is None else eng.make_cache(policy, mode)
    return _generate(eng, cache, input_ids=batch_ids, attention_mask=mask)[:, n:].tolist()


def _generate(eng: Engine, cache, **inputs) -> torch.Tensor:
    kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=eng.tokenizer.pad_token_id)
    with torch.inference_mode():
        return eng.model.generate(**inputs, cache=cache, **kw)


@pytest.mark.parametrize("family,mode,policy", CELLS)
def test_family_cell(family, mode, policy):
    eng = engine(family)
    ids = prompt(family)
    tokens, rep = manual(family, mode, policy)
    assert len(tokens) == NEW

    # plain generate() on a fresh cache
    out = _generate(eng, eng.make_cache(policy, mode), input_ids=ids)
    assert out[0, ids.shape[1]:].tolist() == tokens, "generate() and the manual loop disagree"

    # a left-padded batch: the unpadded row gives the single run's tokens; the short prompt padded on the
    # left gives DynamicCache's padded tokens under fp16 and the same tokens in every lossy mode (lossy
    # codecs calibrate on the pad rows too, so not the unpadded run's)
    got = padded_batch(family, mode, policy)
    assert got[0] == tokens, "the unpadded row of a batch differs from the single run"
    if policy == "fp16":
        assert got == padded_batch(family, None, None), "the padded batch differs from DynamicCache's"
    elif mode != "dense-shadow":
        want = padded_batch(family, "compressed", policy)
        if padded_batch(family, None, None)[1] == [0] * NEW:
            # transformers itself gives NaN for this padded row (Gemma-2's float64 eager softmax): every mode reads
            # garbage there (argmax 0), except fused over compressed sliding windows, which stays finite
            got, want = got[:1], want[:1]
        assert got == want, f"{mode} and compressed disagree on the batch"

    # bytes: the report equals the config-only estimate, to the byte
    est = estimate_kv(policy, eng.geometry, rep.tokens)
    assert rep.compressed_storage_bytes == est.total_bytes
    assert [r.total_bytes for r in rep.layers] == est.layer_bytes
    assert rep.dense_fp16_bytes == est.dense_fp16_bytes

    if policy == "fp16":
        assert tokens == baseline(family), "fp16 differs from DynamicCache"
    elif mode != "dense-shadow":
        ref = manual(family, "compressed", policy)[0]
        assert tokens == ref, f"{mode} and compressed disagree in float64"
    if mode == "fused" and policy != "fp16":  # (a lossless policy stores rows as they are: no fused read)
        assert rep.fused_calls > 0 and rep.fallbacks == {}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_turbo4_teacher_forced_kl_is_bounded(family):
    """turbo4 (fused, the mode that reads the packed store directly; compressed where fused is refused) on
    corpus text the codecs never saw: lossy (KL > 0: packed rows were read) and bounded."""
    eng = engine(family)
    ids = prompt(family, PROMPT_TOKENS + NEW + 1)
    r = teacher_forced(eng, ids, PROMPT_TOKENS, KL_POLICY, "compressed" if family in NO_FUSED else "fused")
    assert r.steps == NEW
    assert 0 < r.kl_mean < TURBO4_KL_BOUND, r


@pytest.mark.parametrize("family", list(FAMILIES))
def test_baseline_unchanged_after_fused_install(family):
    """Baseline tokens and logits are identical before and after the fused attention is installed (plain
    tensors go to the implementation the model had before: its eager, soft-cap and sinks included)."""
    eng = Engine(short_window_model(family, dtype=torch.float64))
    ids = prompt(family)

    def run():
        with torch.inference_mode():
            logits = eng.model(ids, cache=DynamicCache(config=eng.config)).logits
        return logits, eng.generate(ids, None, max_new_tokens=NEW, stop_at_eos=False).token_ids

    before_logits, before_tokens = run()
    try:
        eng.make_cache("turbo4", "fused")
    except ValueError:
        assert family in NO_FUSED
    after_logits, after_tokens = run()
    assert torch.equal(before_logits, after_logits)
    assert before_tokens == after_tokens
