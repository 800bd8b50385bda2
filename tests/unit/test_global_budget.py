"""``budget=global`` (``cache.evict.global_budget``): the KVzip scores of every layer and KV head ranked together, as
kvpress's ``KVzipPress(layerwise=False)`` ranks them; each layer and head keeps its own count, the total and the
bytes those of ``budget=layer``; every cache mode, fused natively; a sliding-window family past its window."""

from __future__ import annotations

import pytest
import torch

from tests.unit.cache_helpers import runs_in_every_mode
from tqbench.engine.cache import TQCache
from tqbench.engine.cache.estimate import KVGeometry, estimate_kv
from tqbench.engine.cache.evict import scores
from tqbench.engine.cache.evict.global_budget import global_counts
from tqbench.engine.cache.evict.reconstruct import context_scores
from tqbench.engine.policy import Policy, parse_policy
from tqbench.engine.policy.keep import CONTEXT_PASS_SCORES

PROMPT = "the quick brown fox jumps over the lazy dog and keeps running far away " * 3


def kvpress_kept(score_val: torch.Tensor, ratio: float) -> torch.Tensor:
    """kvpress 0.5.5 ``KVzipPress.compress_post`` with ``layerwise=False``, written out: ``score_val``
    ``[layers, B, H, N]``; the ``int(numel * ratio)`` lowest scores of all layers and heads pruned. Returns the kept
    mask ``[layers, B, H, N]``."""
    n_layer, bsz, heads, ctx_len = score_val.shape
    n_pruned_indices = int(score_val.numel() * ratio)
    pruned_indices = torch.topk(-score_val.reshape(-1), n_pruned_indices).indices
    n_tokens_per_layer = bsz * heads * ctx_len
    n_pruned_layers = torch.bincount(pruned_indices // n_tokens_per_layer, minlength=n_layer).int()
    kept = torch.ones_like(score_val, dtype=torch.bool)
    for layer in range(n_layer):
        n_pruned = int(n_pruned_layers[layer])
        indices = torch.topk(-score_val[layer].reshape(bsz, -1), n_pruned, dim=1).indices.flatten()
        kept[layer, 0].view(-1)[indices] = False
    return kept


def test_context_pass_scores_are_the_policy_list():
    assert {n for n, c in scores.REGISTRY.items() if c.context_pass} == set(CONTEXT_PASS_SCORES)


def test_counts_rank_every_entry_together_with_a_floor_and_cost_groups():
    m = [torch.tensor([0.9, 0.8, 0.7]), torch.tensor([0.1, 0.2, 0.05]), torch.tensor([0.5, 0.6, 0.4])]
    assert global_counts(m, [1, 1, 1], [0, 0, 0]) == [1, 1, 1]  # the floor: every entry with a share keeps one
    assert global_counts(m, [2, 2, 2], [0, 0, 0]) == [3, 1, 2]
    assert global_counts(m, [2, 0, 2], [0, 0, 0]) == [3, 0, 1]  # no share: no row; its share is nobody's
    assert global_counts(m, [2, 2, 2], [0, 1, 0]) == [3, 2, 1]  # group 1 keeps its own share


def test_rows_kept_are_kvpress_kvzip_layerwise_false(tiny_engine):
    """The same KVzip scores through a cache with budget=global and through kvpress's rule written out keep the
    same rows of every layer and KV head (sink=4 as kvpress's n_sink, no protected tail: kvpress keeps none)."""
    ids = tiny_engine.encode_prompt(PROMPT, chat=False)
    n = ids.shape[1]
    rows, _ = context_scores(tiny_engine.model, tiny_engine.tokenizer, ids)
    for r in rows:  # tqbench always keeps its observation window (the last row here): scored 1 as kvpress's sinks,
        r[..., -1] = 1.0  # so kvpress's rule keeps it too
    tiny_engine.enable_fused()
    cache = TQCache("fp16,keep=0.5,score=kvzip,budget=global,sink=4,window=1,recent=0", tiny_engine.config)
    cache.set_context_scores(rows)
    with torch.inference_mode():
        tiny_engine.model(ids, cache=cache)
    layers, heads = len(rows), rows[0].shape[1]
    # kvpress's budget: int(numel * ratio) pruned of layers * heads * n; tqbench's: floor(0.5 * middle) kept per
    # head of the middle = n - 4 - 1 rows: ratio chosen so both prune the same count
    kept_total = layers * heads * (4 + 1 + (n - 5) // 2)
    ratio = (layers * heads * n - kept_total) / (layers * heads * n)
    want = kvpress_kept(torch.stack(rows), ratio + 1e-9)
    assert int(want.sum()) == kept_total
    counts = set()
    for i, la in enumerate(cache.layers):
        got = la.evictor.positions.heads()
        for h in range(heads):
            # (the last row is tqbench's observation window, kept; kvpress kept it too when it ranks high)
            expect = want[i, 0, h].nonzero().view(-1).tolist()
            assert got[h][0, 0].tolist() == expect, (i, h)
            counts.add(len(expect))
    assert len(counts) > 1  # layers and heads kept different counts


@pytest.mark.parametrize("policy", ["turbo4,keep=0.5,score=kvzip,budget=global",
                                    "k=turbo4,v=turbo3,keep=0.4,score=kvzip,chunk=4,budget=global,keep@0=0.7",
                                    "turbo4,keep=0.5,score=kvzip,budget=global,protect=last1"])
def test_every_mode_fused_natively_bytes_are_the_estimate(tiny_engine64, policy):
    ids = tiny_engine64.encode_prompt(PROMPT, chat=False)
    runs = runs_in_every_mode(tiny_engine64, ids, policy)
    rep = runs["fused"].cache_report
    n = ids.shape[1] + 7  # (the last token is generated, never fed)
    est = estimate_kv(policy, KVGeometry.from_config(tiny_engine64.model.config), n, prefill=ids.shape[1])
    uni = tiny_engine64.generate(ids, policy.replace(",budget=global", ""), "compressed", max_new_tokens=8,
                                 stop_at_eos=False).cache_report
    for r in runs.values():
        assert r.cache_report.compressed_storage_bytes == est.total_bytes == uni.compressed_storage_bytes
        assert [x.head_tokens for x in r.cache_report.layers] == [x.head_tokens for x in rep.layers]
    per_head = [t for x in rep.layers for t in x.head_tokens]
    assert len(set(per_head)) > 1
    heads = tiny_engine64.config.num_key_value_heads
    assert sum(per_head) == sum(heads * x.tokens for x in uni.layers if x.evicted_prefill)  # the same total
    assert any("budget=global" in note for note in rep.notes)


def test_fused_equals_compressed_logits_float64(tiny_engine64):
    """A prefill then single-token steps: the fused mode's logits equal the compressed mode's in float64 (the same
    rows per layer and head, the same codes), with one native call per layer per step."""
    eng = tiny_engine64
    ids = eng.encode_prompt(PROMPT, chat=False)
    rows, _ = context_scores(eng.model, eng.tokenizer, ids)
    eng.enable_fused()
    out, caches = {}, {}
    for mode in ("compressed", "fused"):
        cache = caches[mode] = TQCache("k=turbo4,v=turbo2,keep=0.4,score=kvzip,budget=global", eng.config, mode=mode)
        cache.set_context_scores(rows)
        steps, x = [], ids
        with torch.inference_mode():
            for _ in range(6):
                logits = eng.model(x, cache=cache).logits[:, -1]
                steps.append(logits)
                x = logits.argmax(-1, keepdim=True)
        out[mode] = torch.stack(steps)
    assert (out["fused"] - out["compressed"]).abs().max() < 1e-9
    rep = caches["fused"].report()
    assert rep.fused_impl == {"native-cpu": rep.fused_calls} and rep.fused_calls == 4 * 5 and not rep.fallbacks
    assert [r.head_tokens for r in rep.layers] == [r.head_tokens for r in caches["compressed"].report().layers]


def test_sliding_window_family_past_its_window():
    """tiny-gemma3_text (window 8): the full-attention layers share the budget; the sliding ones keep their window
    and take no part; every mode gives the same tokens in float64, the fused one natively; bytes are the estimate."""
    from tqbench.engine.engine import Engine

    eng = Engine.load("tiny-gemma3_text", dtype="float64", threads=1)
    ids = eng.encode_prompt(PROMPT, chat=False)
    assert ids.shape[1] > 8 * 4
    pol = "turbo4,keep=0.5,score=kvzip,budget=global"
    runs = {m: eng.generate(ids, pol, m, max_new_tokens=6, stop_at_eos=False, prefill_chunk=0)
            for m in ("simulate", "compressed", "fused")}
    assert runs["fused"].token_ids == runs["compressed"].token_ids == runs["simulate"].token_ids
    rep = runs["fused"].cache_report
    assert rep.fused_impl == {"native-cpu": rep.fused_calls} and rep.fused_calls > 0
    n = ids.shape[1] + 5
    for r in runs.values():
        assert r.cache_report.compressed_storage_bytes == estimate_kv(pol, eng.geometry, n,
                                                                      prefill=ids.shape[1]).total_bytes
    plans = parse_policy(pol).plan(eng.geometry.num_layers, list(eng.geometry.layer_types))
    for plan, row in zip(plans, rep.layers):
        assert bool(row.head_tokens) == plan.evicts  # only full-attention layers evict, each head its own rows


@pytest.mark.parametrize(("text", "msg"), [
    ("fp16,keep=0.5,budget=global", "score=snapkv scores a layer while the prefill passes it; use score=kvzip"),
    ("fp16,score=kvzip,budget=global", "evicts nothing"),
    ("fp16,keep=0.5,score=kvzip,budget=global,heads=ada", "drop heads=ada"),
    ("fp16,keep=0.5|1,score=kvzip,budget=global", "not a per-head keep list"),
    ("turbo4,keep=0.5,score=kvzip,budget=global,demote=turbo2", "drop demote="),
    ("fp16,keep=0.5,score=kvzip,budget=global,every=4", "drop every="),
    ("fp16,keep=0.5,score=kvzip,budget=all", "budget='all' is invalid: use layer"),
])
def test_bad_values_say_what_to_use(text, msg):
    with pytest.raises(ValueError, match=msg.replace("|", r"\|")):
        parse_policy(text)


def test_round_trip():
    pol = parse_policy("turbo4,keep=0.25,score=kvzip,budget=global")
    assert pol.budget == "global" and parse_policy(pol.to_string()) == pol
    assert Policy.from_dict(pol.to_dict()) == pol


def test_compress_once_with_a_global_budget_then_many_questions(tiny_engine64):
    """``Engine.compress`` (the agnostic protocol, the serve prefix cache): the context scored, evicted once over
    every layer together, in prefill chunks too; questions appended to copies leave it as compressed; bytes are the
    estimate's."""
    e = tiny_engine64
    ids = e.encode_prompt(PROMPT, chat=False)
    ctx_ids, q1, q2 = ids[:, :150], ids[:, 150:160], ids[:, 160:]
    pol = "turbo4,keep=0.5,score=kvzip,budget=global"
    ctx = e.compress(ctx_ids, pol, "fused")
    chunked = e.compress(ctx_ids, pol, "compressed", prefill_chunk=64)
    rep = ctx.report()
    est = estimate_kv(pol, KVGeometry.from_config(e.config), 150)
    assert rep.compressed_storage_bytes == est.total_bytes == chunked.report().compressed_storage_bytes
    assert len({t for r in rep.layers for t in r.head_tokens}) > 1 and ctx.context_pass_seconds > 0
    a = ctx.generate(q1, max_new_tokens=6, stop_at_eos=False)
    b = ctx.generate(q2, max_new_tokens=6, stop_at_eos=False)
    assert a.token_ids == ctx.generate(q1, max_new_tokens=6, stop_at_eos=False).token_ids != b.token_ids
    assert [r.head_tokens for r in ctx.report().layers] == [r.head_tokens for r in rep.layers]  # untouched
    assert [[t - h for t, h in zip(r.head_tokens, c.head_tokens)] for r, c in
            zip(a.cache_report.layers, rep.layers)] == [[15] * len(r.head_tokens) for r in rep.layers]
    assert a.cache_report.fused_impl == {"native-cpu": a.cache_report.fused_calls}
    # the compressed mode reads the same rows: each layer's mask fitted to its own width (the layers' spans differ)
    assert e.compress(ctx_ids, pol, "compressed").generate(q1, max_new_tokens=6, stop_at_eos=False).token_ids == \
        a.token_ids
    for la in chunked.cache.layers:  # an eviction at the end of each prefill call, each over every layer
        assert la.evictor.points == 3
