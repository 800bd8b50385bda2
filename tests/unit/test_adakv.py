"""heads=ada (AdaKV per-head budgets within a layer): the choice of rows, ragged per-head stores counted to the
byte, the per-head padding mask, modes, a sliding-window family, refusals."""

import pytest
import torch

from tests.unit.cache_helpers import prefill_then_steps
from tqbench.engine.cache import TQCache
from tqbench.engine.cache.estimate import KVGeometry, estimate_kv
from tqbench.engine.cache.evict.compact import EvictionError
from tqbench.engine.cache.evict.ragged import select_ada
from tqbench.engine.cache.fused.masks import ragged_mask
from tqbench.engine.policy import parse_policy
from tqbench.engine.policy.keep import ada_floor_rows, held_rows
from tqbench.engine.policy.spec import Policy

PROMPT = "the quick brown fox jumps over the lazy dog and keeps running far away " * 3


# -- the choice of rows ------------------------------------------------------------------------------------
def test_select_ada_ranks_heads_together_with_a_floor():
    # 3 heads of 20 rows: sinks 2, protected tail 4, uniform share 6 of the 14 middle rows per head
    g = torch.Generator().manual_seed(0)
    score = torch.rand(1, 3, 20, generator=g)
    score[0, 0, 2:16] += 10.0  # head 0's middle rows beat every other head's
    idx = select_ada(score, [20, 20, 20], target=12, head=2, tail=4, floor_frac=0.5)
    counts = [i.shape[2] for i in idx]
    assert sum(counts) == 3 * 12  # the layer keeps its total budget
    floor = ada_floor_rows(12, 2, 4, 0.5)
    assert floor == 3
    # heads 1 and 2 keep their floor (3 middle rows each), head 0 the rest of the 18: 12 of its 14
    assert counts == [2 + 4 + 18 - 2 * floor, 2 + 4 + floor, 2 + 4 + floor]
    for h, i in enumerate(idx):
        rows = i[0, 0].tolist()
        assert rows == sorted(rows) and rows[:2] == [0, 1] and rows[-4:] == [16, 17, 18, 19]
        if h:  # its floor rows are its best-scored middle rows
            mid = score[0, h, 2:16]
            assert set(rows[2:-4]) == {int(j) + 2 for j in mid.topk(floor).indices}


def test_select_ada_floor_one_is_uniform_and_ragged_input_is_read_as_held():
    score = torch.rand(1, 2, 30)
    idx = select_ada(score, [30, 30], target=10, head=0, tail=2, floor_frac=1.0)
    assert [i.shape[2] for i in idx] == [10, 10]
    for h in range(2):  # uniform: each head its own top 8 of the middle
        assert set(idx[h][0, 0, :-2].tolist()) == {int(j) for j in score[0, h, :28].topk(8).indices}
    # head 1 holds 12 rows (padding after them must never be chosen)
    score = torch.rand(1, 2, 30)
    score[0, 1, 12:] = float("-inf")
    idx = select_ada(score, [30, 12], target=14, head=1, tail=2, floor_frac=0.0)
    assert sum(i.shape[2] for i in idx) == 28 and int(idx[1].max()) < 12
    assert ada_floor_rows(14, 1, 2, 0.0) == 1  # at least one row per head (each head's store packs)


def test_select_ada_is_kvpress_adakv_on_the_rows_between_sinks_and_tail():
    """kvpress ``AdaKVPress``, written out on its own over the rows between the sinks and the protected tail:
    each head's best ``n_safe`` rows are forced in, then the ``heads * (middle - share)`` lowest scores over
    all heads together are pruned. select_ada keeps exactly the rows it keeps."""
    g = torch.Generator().manual_seed(5)
    h, held, head, tail, target, alpha = 3, 40, 2, 4, 16, 0.2
    score = torch.rand(1, h, held, generator=g) ** 4  # skewed, as attention mass is
    score[0, 1] *= 0.1  # a head whose rows score low everywhere: only its floor protects it
    idx = select_ada(score, [held] * h, target, head, tail, alpha)
    share, mid = target - head - tail, score[0, :, head : held - tail].clone()
    n_safe = ada_floor_rows(target, head, tail, alpha)
    mid.scatter_(1, mid.topk(n_safe, dim=1).indices, torch.finfo(mid.dtype).max)
    pruned = (-mid).reshape(-1).topk(h * (mid.shape[1] - share)).indices
    keep = torch.ones(h * mid.shape[1], dtype=torch.bool)
    keep[pruned] = False
    keep = keep.view(h, -1)
    for i in range(h):
        want = list(range(head)) + [int(j) + head for j in keep[i].nonzero()] + list(range(held - tail, held))
        assert idx[i][0, 0].tolist() == want
    assert idx[1].shape[2] == head + tail + n_safe  # the low head kept its floor, no more


def test_select_ada_refuses_a_batch():
    with pytest.raises(EvictionError, match="heads=ada chooses each sequence's per-head row counts"):
        select_ada(torch.rand(2, 2, 10), [10, 10], 6, 0, 2, 0.2)


def test_ragged_mask_masks_each_heads_padding_as_per_head_attention():
    g = torch.Generator().manual_seed(1)
    lengths, t, d, n_rep = [5, 2, 7], 3, 4, 2
    span = max(lengths)
    q = torch.randn(1, 3 * n_rep, t, d, generator=g)
    k = torch.randn(1, 3, span + t, d, generator=g)
    v = torch.randn(1, 3, span + t, d, generator=g)
    causal = torch.ones(t, span + t, dtype=torch.bool).tril(span).view(1, 1, t, span + t)
    for base in (causal, None):
        mask = ragged_mask(base, lengths, q, span + t, additive=False)
        out = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(n_rep, 1),
                                                               v.repeat_interleave(n_rep, 1), attn_mask=mask)
        for h, n in enumerate(lengths):  # each head over its own rows and the call's, nothing padded
            cols = list(range(n)) + list(range(span, span + t))
            ref = torch.nn.functional.scaled_dot_product_attention(
                q[:, h * n_rep : (h + 1) * n_rep], k[:, h : h + 1, cols].expand(1, n_rep, -1, d),
                v[:, h : h + 1, cols].expand(1, n_rep, -1, d), attn_mask=causal[..., cols])
            assert torch.allclose(out[:, h * n_rep : (h + 1) * n_rep], ref, atol=1e-6)
    assert ragged_mask(causal, [4, 4], q[:, :4], 7, additive=False) is causal  # equal rows: nothing to mask


# -- the cache: rows per head, bytes, modes ----------------------------------------------------------------
@pytest.mark.parametrize("mode", ["compressed", "simulate"])
@pytest.mark.parametrize("policy", [
    "turbo4,keep=0.5,heads=ada", "k=turbo4,v=turbo2,sink=2,recent=4,keep=40rows,score=keynorm,window=8,heads=ada",
    "turbo4,keep=0.3,score=snapkv,every=4,keep@0=1.0,heads=ada,ada_floor=0.5",
    "k=turbo3,v=int4,keep=0.6,score=expected,window=8,heads=ada", "turbo4,keep=0.4,score=h2o,every=3,heads=ada",
])
def test_per_head_rows_differ_sum_to_the_budget_and_bytes_are_the_estimate(tiny_engine, policy, mode):
    model = tiny_engine.model
    tiny_engine.enable_fused()  # tqbench's attention function (it reads the queries, masks each head's padding)
    cache = TQCache(policy, model.config, mode=mode)
    prefill_then_steps(model, cache, 100, steps=10)
    rep = cache.report()
    est = estimate_kv(policy, KVGeometry.from_config(model.config), 100, prefill=90)
    assert rep.compressed_storage_bytes == est.total_bytes
    assert [r.total_bytes for r in rep.layers] == est.layer_bytes
    pol = parse_policy(policy)
    heads = model.config.num_key_value_heads
    ragged = 0
    for plan, row in zip(pol.plan(4), rep.layers):
        if not plan.evicts:
            assert row.head_tokens == () and row.tokens == 100
            continue
        want = held_rows(100, 90, plan.keep, plan.sink, pol.window, plan.recent, pol.every)
        assert len(row.head_tokens) == heads and sum(row.head_tokens) == heads * want == heads * row.tokens
        share = want - plan.sink - max(pol.window, plan.recent)
        assert min(row.head_tokens) >= want - share + ada_floor_rows(want, plan.sink, max(pol.window, plan.recent),
                                                                     pol.ada_floor) - (pol.every and 10)
        ragged += len(set(row.head_tokens)) > 1
    assert ragged  # AdaKV moved rows between heads somewhere
    assert any("heads=ada" in n for n in rep.notes)


def test_the_report_and_kept_positions_agree_per_head(tiny_engine):
    from tqbench.engine.cache.evict.kept import kept_positions

    tiny_engine.enable_fused()
    cache = TQCache("turbo4,keep=0.5,heads=ada,ada_floor=0.1", tiny_engine.model.config, mode="compressed")
    prefill_then_steps(tiny_engine.model, cache, 80, steps=1)
    kept = kept_positions(cache)
    for la, row in zip(kept.layers, cache.report().layers):
        assert tuple(len(h) for h in la.heads) == row.head_tokens
        assert all(list(h) == sorted(set(h)) and h[-32:] == tuple(range(48, 80)) for h in la.heads)


def test_compressed_and_simulate_agree_and_floor_one_is_uniform(tiny_engine64):
    ids = tiny_engine64.encode_prompt(PROMPT, chat=False)
    runs = {m: tiny_engine64.generate(ids, "turbo4,keep=0.5,score=snapkv,heads=ada", m, max_new_tokens=10,
                                      stop_at_eos=False) for m in ("compressed", "simulate")}
    assert runs["compressed"].token_ids == runs["simulate"].token_ids
    assert runs["compressed"].cache_report.compressed_storage_bytes == runs["simulate"].cache_report.compressed_storage_bytes
    # ada_floor=1: every head keeps its uniform share: the same rows, tokens and bytes as heads=uniform
    uni = tiny_engine64.generate(ids, "turbo4,keep=0.5,score=snapkv", "compressed", max_new_tokens=10,
                                 stop_at_eos=False)
    one = tiny_engine64.generate(ids, "turbo4,keep=0.5,score=snapkv,heads=ada,ada_floor=1", "compressed",
                                 max_new_tokens=10, stop_at_eos=False)
    assert one.token_ids == uni.token_ids
    assert one.cache_report.compressed_storage_bytes == uni.cache_report.compressed_storage_bytes


def test_sliding_window_family_beyond_its_window():
    from tests.unit.families.short_windows import SHORT_WINDOW, short_window_model
    from tqbench.engine import Engine

    eng = Engine(short_window_model("gemma3_text", dtype=torch.float64))
    ids = torch.randint(5, 300, (1, 60), generator=torch.Generator().manual_seed(0))
    assert ids.shape[1] > 5 * SHORT_WINDOW
    pol = "turbo4,keep=0.5,window=4,recent=4,sink=2,heads=ada"
    runs = {m: eng.generate(ids, pol, m, max_new_tokens=6, stop_at_eos=False, prefill_chunk=0)
            for m in ("compressed", "simulate", "fused")}
    assert runs["compressed"].token_ids == runs["simulate"].token_ids == runs["fused"].token_ids
    assert runs["fused"].cache_report.fused_impl == {"native-cpu": runs["fused"].cache_report.fused_calls}
    rep = runs["compressed"].cache_report
    assert rep.compressed_storage_bytes == estimate_kv(pol, eng.geometry, 65, prefill=60).total_bytes
    evicting = [r for r in rep.layers if r.evicted_prefill]
    assert [r.layer for r in evicting] == [1, 3]  # full-attention layers only
    assert all(r.head_tokens == () for r in rep.layers if r.layer not in (1, 3))


# -- refusals ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,msg", [
    ("turbo4,keep=0.5,heads=some", "heads='some' is invalid: use uniform"),
    ("turbo4,keep=0.5,heads=ada,ada_floor=1.5", r"ada_floor=1.5 is invalid: use a fraction 0 <= f <= 1"),
    ("turbo4,keep=0.5,ada_floor=x", "ada_floor must be a number such as 0.2"),
    ("turbo4,heads=ada", "heads=ada shares a layer's kept rows between its KV heads, but this policy evicts nothing"),
    ("turbo4,keep=0.5|1,heads=ada", "heads=ada shares a layer's kept rows .* not a per-head keep list"),
])
def test_bad_values_say_what_to_use(text, msg):
    with pytest.raises(ValueError, match=msg):
        parse_policy(text)


def test_round_trip(tmp_path):
    pol = parse_policy("turbo4,keep=0.5,heads=ada,ada_floor=0.3")
    assert (pol.heads, pol.ada_floor) == ("ada", 0.3)
    assert parse_policy(pol.to_string()) == pol
    assert Policy.from_dict(pol.to_dict()) == pol
    path = tmp_path / "p.toml"
    path.write_text('preset = "turbo4"\nkeep = 0.5\nheads = "ada"\nada_floor = 0.3\n')
    assert parse_policy(str(path)) == pol
    assert "heads" not in parse_policy("turbo4,keep=0.5").to_string()


# -- fused: one native call per layer, each KV head a side with its own rows -------------------------------------
def _logits(engine, policy, mode, ids, steps=6):
    """Logits of a prefill of ``ids`` then ``steps`` single-token calls (the argmax fed back)."""
    engine.enable_fused()
    cache = TQCache(policy, engine.model.config, mode=mode)
    out = []
    with torch.inference_mode():
        x = ids
        for _ in range(steps + 1):
            logits = engine.model(x, cache=cache).logits[:, -1]
            out.append(logits)
            x = logits.argmax(-1, keepdim=True)
    return torch.stack(out), cache


@pytest.mark.parametrize("policy", ["turbo4,keep=0.5,score=snapkv,heads=ada",
                                    "k=turbo4,v=turbo2,keep=0.4,score=snapkv,every=2,window=4,heads=ada,ada_floor=0.1"])
def test_fused_native_is_one_call_per_layer_and_matches_compressed(tiny_engine64, policy):
    ids = torch.randint(5, 200, (1, 70), generator=torch.Generator().manual_seed(2))
    ref, c_ref = _logits(tiny_engine64, policy, "compressed", ids)
    got, c_got = _logits(tiny_engine64, policy, "fused", ids)
    assert (got - ref).abs().max() < 1e-9  # float64: the same rows, the same codes
    rep = c_got.report()
    assert rep.fused_impl == {"native-cpu": rep.fused_calls} and rep.fused_calls == 4 * 6  # one per layer per step
    assert not rep.fallbacks
    assert [r.head_tokens for r in rep.layers] == [r.head_tokens for r in c_ref.report().layers]
    assert any(len(set(r.head_tokens)) > 1 for r in rep.layers)
    est = estimate_kv(policy, KVGeometry.from_config(tiny_engine64.model.config), 76, prefill=70)
    assert rep.compressed_storage_bytes == est.total_bytes


def test_fused_elsewhere_runs_head_by_head_and_says_so(tiny_engine, monkeypatch):
    from tests.unit.cache_helpers import fused_as_reference

    ref, got = fused_as_reference(tiny_engine, "turbo4,keep=0.5,score=tova,heads=ada", monkeypatch, impl="native")
    groups = ref.cache_report.fused_groups
    assert set(groups) == {"kv head 0 (heads=ada)", "kv head 1 (heads=ada)"}
    calls = ref.cache_report.fused_calls  # every call of every layer: each head its own reference call
    assert all(ran == {"torch-reference (TQBENCH_FUSED_IMPL=torch)": calls} for ran in groups.values())
    assert got.cache_report.fused_impl == {"native-cpu": got.cache_report.fused_calls}


def test_triton_runs_head_by_head_as_the_reference(tiny_engine, monkeypatch):
    """The Triton kernels (interpreter without a GPU) read each head's own store as the torch reference does."""
    from tests.unit.cache_helpers import fused_as_reference
    from tqbench.kernels import triton_status

    if not triton_status()[0]:
        pytest.skip(triton_status()[1])
    ref, got = fused_as_reference(tiny_engine, "turbo4,keep=0.5,score=tova,heads=ada", monkeypatch)
    assert got.cache_report.fused_groups["kv head 1 (heads=ada)"] == {"triton": got.cache_report.fused_calls}
    assert got.cache_report.compressed_storage_bytes == ref.cache_report.compressed_storage_bytes


@pytest.mark.parametrize("policy,mode,msg", [
    ("k=int8,v=turbo4,keep=0.5,heads=ada", "compressed",
     r"a ragged layer \(heads=ada, or a per-head keep list\) needs a codec that packs each row on its own"),
])
def test_refusals_say_why_and_what_to_use(tiny_engine, policy, mode, msg):
    with pytest.raises(EvictionError, match=msg):
        tiny_engine.generate(tiny_engine.encode_prompt(PROMPT, chat=False), policy, mode, max_new_tokens=2)


def test_validate_fused_says_the_native_kernel_ran():
    from click.testing import CliRunner

    from tqbench.cli import main

    r = CliRunner().invoke(main, ["--headless", "validate", "--model", "tiny", "--candidate",
                                  "turbo4,keep=0.5,score=snapkv,heads=ada", "--cache-mode", "fused",
                                  "--max-new-tokens", "4", "--threads", "1"])
    assert "native-cpu:" in r.output and "heads=ada" in r.output  # (the random tiny model may fail the gate)
    bad = CliRunner().invoke(main, ["--headless", "validate", "--model", "tiny", "--candidate",
                                    "turbo4,keep=0.5,heads=adakv", "--max-new-tokens", "2"])
    assert bad.exit_code == 2 and "heads='adakv' is invalid: use uniform" in bad.output


def test_a_batch_at_an_eviction_point_is_refused_with_the_reason(tiny_engine):
    ids = torch.randint(5, 200, (1, 60), generator=torch.Generator().manual_seed(1))
    with pytest.raises(EvictionError, match="a batch of 2 sequences cannot share them"):
        tiny_engine.model.generate(ids, cache=tiny_engine.make_cache("turbo4,keep=0.5,heads=ada", "compressed"),
                                   max_new_tokens=2, do_sample=True, num_return_sequences=2)
