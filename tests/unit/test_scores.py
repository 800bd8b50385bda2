"""Scores as objects (``cache.evict.scores``): the registry, the ``Chunked`` wrapper over any score, the allocator's
keep cells ranking with the same objects as the store, and KVzip (its rule written out as kvpress's, its context
pass, every cache mode, fused natively)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.unit.cache_helpers import runs_in_every_mode
from tqbench.engine.cache import TQCache
from tqbench.engine.cache.evict import scores
from tqbench.engine.cache.evict.compact import EvictionError
from tqbench.engine.cache.evict.reconstruct import SINK, chunk_score, context_scores
from tqbench.engine.policy.keep import SCORES

PROMPT = "the quick brown fox jumps over the lazy dog and keeps running far away " * 3


def test_registry_holds_every_policy_score_one_class_each():
    assert set(scores.REGISTRY) == set(SCORES)  # (policy.keep.SCORES: the torch-free names the grammar checks)
    for name, cls in scores.REGISTRY.items():
        assert cls.name == name and cls.reference and scores.get_score(name).name == name
    assert scores.get_score("tova", chunk=8).inner.__class__ is scores.REGISTRY["tova"]
    with pytest.raises(ValueError, match="score=.l2. is invalid: valid scores are expected, h2o, keynorm, kvzip"):
        scores.get_score("l2")


def _input(t=24, kv=2, n_rep=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, kv * n_rep, 6, d, generator=g)
    k, v = torch.randn(1, kv, t, d, generator=g), torch.randn(1, kv, t, d, generator=g)
    pos = torch.arange(t).expand(1, kv, t)
    return scores.ScoreInput(q, k, lambda: v, 0.35, t, pos, window=q, mass=torch.rand(1, kv, t, generator=g),
                             rows=torch.rand(1, kv, t, generator=g))


@pytest.mark.parametrize("name", SCORES)
def test_chunked_wraps_any_score_one_value_per_chunk(name):
    x = _input()
    plain = scores.get_score(name)(x)
    got = scores.get_score(name, chunk=4)(x)
    assert got.shape == plain.shape == (1, 2, 24)
    for c in range(6):
        want = plain[..., 4 * c : 4 * c + 4].mean(-1, keepdim=True)
        assert torch.allclose(got[..., 4 * c : 4 * c + 4], want.expand(-1, -1, 4), atol=1e-6)


def test_keynorm_is_kvpress_knorm_press():
    """kvpress ``KnormPress.score``: ``-keys.norm(dim=-1)``; the rows a store keeps are its top rows."""
    x = _input(seed=4)
    assert torch.equal(scores.get_score("keynorm")(x), -x.keys.norm(dim=-1))


def test_kvzip_chunk_score_is_kvpress_score_kvzip():
    """kvpress ``KVzipPress.score_kvzip``, written out: keys subsampled to the first ``min(n_sink, start)`` rows,
    the chunk's rows and the repeat's own ``q`` rows; the repeat block causal; softmax; the chunk's columns; the
    max over the query heads of each KV head and over the queries."""
    g = torch.Generator().manual_seed(1)
    kv, n_rep, d, n, q_len, start, end = 2, 3, 8, 40, 14, 10, 30
    q = torch.randn(1, kv * n_rep, q_len, d, generator=g) * 1.5
    k = torch.randn(1, kv, n + q_len, d, generator=g)
    got = chunk_score(q, k, d ** -0.5, start, end)
    sink = min(4, start)
    sub = torch.cat([k[:, :, :sink], k[:, :, start:end], k[:, :, -q_len:]], dim=2)
    qs = q.view(1, kv, n_rep, q_len, d)
    w = qs @ sub.unsqueeze(2).transpose(-2, -1) / math.sqrt(d)
    mask = torch.full((q_len, q_len), torch.finfo(w.dtype).min)
    mask.masked_fill_(torch.arange(q_len) < (torch.arange(q_len) + 1).view(q_len, 1), 0)
    w[..., -q_len:, -q_len:] += mask
    want = torch.softmax(w, dim=-1)[..., sink : sink + end - start].amax(dim=(-3, -2))
    assert torch.allclose(got, want, atol=1e-6)


def test_context_pass_scores_every_row_in_chunks(tiny_engine):
    ids = tiny_engine.encode_prompt(PROMPT, chat=False)
    n = ids.shape[1]
    whole, seconds = context_scores(tiny_engine.model, tiny_engine.tokenizer, ids)
    parts, _ = context_scores(tiny_engine.model, tiny_engine.tokenizer, ids, chunk=64)
    assert len(whole) == tiny_engine.config.num_hidden_layers and seconds > 0
    for a, b in zip(whole, parts):
        assert a.shape == (1, tiny_engine.config.num_key_value_heads, n)
        assert (a[..., :SINK] == 1).all() and (a[..., SINK:] > 0).all() and (a <= 1).all()
        assert not torch.equal(a, b)  # a chunk's repeat reads only its own rows (and the sinks)
    assert tiny_engine.model.config._attn_implementation != "tqbench_kvzip"  # the model's attention restored


def test_kvzip_without_its_pass_says_what_to_do(tiny_engine):
    tiny_engine.enable_fused()  # (eviction scores read the queries in tqbench's attention function)
    cache = TQCache("turbo4,keep=0.5,score=kvzip", tiny_engine.config)
    assert cache.needs_context_pass
    with pytest.raises(EvictionError, match="score=kvzip ranks rows by a context-reconstruction pass"), \
            torch.inference_mode():
        tiny_engine.model(tiny_engine.encode_prompt(PROMPT, chat=False), cache=cache)


def test_kvzip_keeps_the_rows_the_pass_scores_highest(tiny_engine):
    ids = tiny_engine.encode_prompt(PROMPT, chat=False)
    rows, _ = context_scores(tiny_engine.model, tiny_engine.tokenizer, ids)
    tiny_engine.enable_fused()
    cache = TQCache("fp16,keep=0.5,score=kvzip,sink=4,recent=8,window=8", tiny_engine.config)
    cache.set_context_scores(rows)
    with torch.inference_mode():
        tiny_engine.model(ids, cache=cache)
    n = ids.shape[1]
    middle = n - 4 - 8
    for i, la in enumerate(cache.layers):
        pos = la.evictor.positions.view()[0]
        for h in range(pos.shape[0]):
            want = (rows[i][0, h, 4 : n - 8].topk(middle // 2).indices + 4).sort().values.tolist()
            assert pos[h].tolist() == [0, 1, 2, 3, *want, *range(n - 8, n)]


@pytest.mark.parametrize("policy", ["turbo4,keep=0.5,score=kvzip", "k=turbo4,v=turbo3,keep=0.4,score=kvzip,chunk=4",
                                    "turbo4,keep=0.5,score=kvzip,heads=ada"])
def test_kvzip_in_every_mode_fused_natively(tiny_engine64, policy):
    ids = tiny_engine64.encode_prompt(PROMPT, chat=False)
    runs = runs_in_every_mode(tiny_engine64, ids, policy)
    rep = runs["fused"].cache_report
    assert all(r.context_pass_seconds > 0 for r in runs.values())
    assert rep.compressed_storage_bytes < tiny_engine64.generate(
        ids, "turbo4", "compressed", max_new_tokens=8, stop_at_eos=False).cache_report.compressed_storage_bytes


def test_keep_cells_rank_with_the_stores_objects(tiny_engine):
    """The allocator's keep cell keeps, per KV head, the rows a cache evicting at the end of the same prefill
    keeps (one ranking object, ``scores.get_score``), for an attention score and a chunked one."""
    from tqbench.engine.allocate.chunk import ChunkRunner
    from tqbench.engine.allocate.keeps import KeepCells

    ids = tiny_engine.encode_prompt(PROMPT * 2, chat=False)
    from tqbench.engine.policy import parse_policy

    runner = ChunkRunner(tiny_engine, ids, int(ids.shape[1]) - 16)
    tiny_engine.enable_fused()
    for pol_text, score, chunk in (("fp16,keep=0.5,score=tova,window=8", "tova", 1),
                                   ("fp16,keep=0.5,score=snapkv,window=8,chunk=4", "snapkv", 4)):
        cells = KeepCells(runner, score, 8, chunk)
        cache = TQCache(pol_text, tiny_engine.config)
        with torch.inference_mode():
            tiny_engine.model(ids[:, : runner.prefill], cache=cache)
        for layer, la in enumerate(cache.layers):
            pol = parse_policy(pol_text)
            idx = cells.index(layer, 0.5, pol.sink, pol.recent)
            assert idx.tolist() == la.evictor.positions.view().long().tolist(), (score, layer)


def test_kvzip_on_a_sliding_window_family_past_its_window():
    """Gemma-3's layout (tiny-gemma3_text: window 8, full attention every few layers): the reconstruction pass reads
    the full-attention layers (the only ones keep= evicts) while the sliding ones keep their window; every mode
    gives the same tokens in float64 and the fused one runs only native calls."""
    from tqbench.engine.engine import Engine

    eng = Engine.load("tiny-gemma3_text", dtype="float64", threads=1)
    ids = eng.encode_prompt(PROMPT, chat=False)
    assert ids.shape[1] > 8 * 4  # well past the window
    runs = {m: eng.generate(ids, "turbo4,keep=0.5,score=kvzip", m, max_new_tokens=6, stop_at_eos=False)
            for m in ("simulate", "compressed", "fused")}
    assert runs["fused"].token_ids == runs["compressed"].token_ids == runs["simulate"].token_ids
    rep = runs["fused"].cache_report
    assert rep.fused_impl == {"native-cpu": rep.fused_calls} and rep.fused_calls > 0
    assert all(r.context_pass_seconds > 0 for r in runs.values())
