"""Token eviction (policy keep=): the policy keys, the kept-row rule, exact bytes, known evicted sets, modes."""

import json

import pytest
import torch

from tests.unit.cache_helpers import prefill_then_steps
from tqbench.engine.cache import TQCache
from tqbench.engine.cache.estimate import KVGeometry, estimate_kv
from tqbench.engine.cache.evict.compact import EvictionError
from tqbench.engine.cache.layer import TQLayer
from tqbench.engine.policy import parse_policy
from tqbench.engine.policy.keep import Rows, held_rows, kept_rows
from tqbench.engine.policy.spec import Policy

PROMPT = "the quick brown fox jumps over the lazy dog and keeps running far away " * 3


def _ids(engine):
    return engine.encode_prompt(PROMPT, chat=False)


# -- the policy language ------------------------------------------------------------------------------------
def test_keys_round_trip_in_every_form(tmp_path):
    text = "turbo4,keep=0.5,score=tova,window=16,every=64,keep@0-1=1.0,keep@last1=300rows"
    pol = parse_policy(text)
    assert (pol.keep, pol.score, pol.window, pol.every) == (0.5, "tova", 16, 64)
    assert parse_policy(pol.to_string()) == pol
    assert Policy.from_dict(pol.to_dict()) == pol
    path = tmp_path / "p.toml"
    path.write_text('preset = "turbo4"\nkeep = 0.5\nscore = "tova"\nwindow = 16\nevery = 64\n'
                    'overrides = [{role = "keep", layers = "0-1", codec = 1.0}, {role = "keep", layers = "last1", codec = "300rows"}]\n')
    assert parse_policy(str(path)) == pol
    plans = pol.plan(4)
    assert [p.keep for p in plans] == [None, None, 0.5, Rows(300)]  # keep=1.0: evicts nothing
    assert isinstance(parse_policy("turbo4,keep=1024rows").keep, Rows)


@pytest.mark.parametrize("text,msg", [
    ("turbo4,keep=0", "keep=0 is invalid: use a fraction 0 < f <= 1"),
    ("turbo4,keep=1.5", "keep=1.5 is invalid"),
    ("turbo4,keep=half", "keep='half' is invalid"),
    ("turbo4,keep@0=2.5", "keep=2.5 is invalid"),
    ("turbo4,score=l2", "score='l2' is invalid: valid scores are snapkv, keynorm, expected, h2o, tova"),
    ("turbo4,window=0", "window=0 is invalid"),
    ("turbo4,every=-1", "every=-1 is invalid"),
])
def test_bad_values_say_what_to_use(text, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace("+", r"\+")):
        parse_policy(text)


def test_kept_rows_rule():
    # sinks 4 and the last max(window 32, recent 16) are kept; half of the 8192 - 36 between them
    assert kept_rows(8192, 0.5, 4, 32, 16) == 4 + 32 + (8192 - 36) // 2
    assert kept_rows(8192, Rows(1000), 4, 32, 16) == 1000
    assert kept_rows(20, Rows(10), 4, 32, 16) == 20  # everything is protected
    assert kept_rows(100, 1.0, 4, 32, 16) == 100
    # decode rows add up until the next eviction point
    assert held_rows(110, 100, 0.5, 4, 32, 16, 0) == kept_rows(100, 0.5, 4, 32, 16) + 10
    assert held_rows(110, 100, 0.5, 4, 32, 16, 4) == kept_rows(108, 0.5, 4, 32, 16) + 2


def test_estimate_is_about_half_at_8k():
    from tqbench.engine.cache.geometry import model_geometry

    geo = model_geometry("default").geometry
    full = estimate_kv("turbo4", geo, 8192)
    half = estimate_kv("turbo4,keep=0.5", geo, 8192)
    # half the rows, plus each held row's int32 position per KV head (counted: evict.bookkeeping)
    assert 0.52 < half.total_bytes / full.total_bytes < 0.55
    assert half.dense_fp16_bytes == full.dense_fp16_bytes  # bits/element against every token in fp16


# -- bytes: the cache report is the estimate, to the byte ---------------------------------------------------------
@pytest.mark.parametrize("mode", ["compressed", "simulate", "fused"])
@pytest.mark.parametrize("policy", [
    "turbo4,keep=0.5", "k=turbo4,v=turbo2,sink=2,recent=4,keep=40rows,score=keynorm,window=8",
    "turbo4,keep=0.3,score=tova,every=4,keep@0=1.0", "k=int8,v=turbo3,keep=0.6,score=expected,window=8",
    "fp16,keep=0.5,sink=4,window=8,every=3",
])
def test_report_matches_estimate_to_the_byte(tiny_engine, policy, mode):
    model = tiny_engine.model
    tiny_engine.enable_fused()
    cache = TQCache(policy, model.config, mode=mode)
    prefill_then_steps(model, cache, 100, steps=10)
    rep = cache.report()
    est = estimate_kv(policy, KVGeometry.from_config(model.config), 100, prefill=90)
    assert rep.compressed_storage_bytes == est.total_bytes
    assert [r.total_bytes for r in rep.layers] == est.layer_bytes
    assert rep.dense_fp16_bytes == est.dense_fp16_bytes and rep.tokens == 100
    pol = parse_policy(policy)
    for plan, row in zip(pol.plan(4), rep.layers):
        want = held_rows(100, 90, plan.keep, plan.sink, pol.window, plan.recent, pol.every) if plan.evicts else 100
        assert row.tokens == want and row.tokens + row.evicted_prefill + row.evicted_decode == 100
    assert any("token eviction" in n for n in rep.notes)


# -- known evicted sets ---------------------------------------------------------------------------------------
def _layer(policy: str, mode: str = "compressed") -> TQLayer:
    pol = parse_policy(policy)
    return TQLayer(pol.plan(1)[0], mode, pol, kv_heads=2)


def test_keynorm_keeps_the_lowest_norm_rows_of_each_head():
    layer = _layer("fp16,sink=2,keep=0.5,score=keynorm,window=4")
    g = torch.Generator().manual_seed(0)
    norms = torch.stack([torch.randperm(20, generator=g) + 1.0 for _ in range(2)])  # [H, T], distinct
    k = torch.randn(1, 2, 20, 8, generator=g)
    k = k / k.norm(dim=-1, keepdim=True) * norms[None, :, :, None]
    v = torch.randn(1, 2, 20, 8, generator=g)
    layer.update(k, v)
    layer.after_attention(torch.randn(1, 4, 20, 8), 1.0, True)
    # 2 sinks + the last 4 + 7 of the 14 between (floor(0.5 * 14))
    for h in range(2):
        middle = norms[h, 2:16]
        want = sorted((middle.argsort()[:7] + 2).tolist())
        kept = layer.evictor.positions.view()[0, h].tolist()
        assert kept == [0, 1, *want, 16, 17, 18, 19]
        assert torch.equal(layer.k_store.dense(torch.float32)[0, h], k[0, h, kept])
        assert torch.equal(layer.v_store.dense(torch.float32)[0, h], v[0, h, kept])
    assert layer.evictor.positions.view()[0, 0].tolist() != layer.evictor.positions.view()[0, 1].tolist()
    assert layer.evictor.evicted_prefill == 7 and layer.get_mask_sizes(1) == (14, 7)


def test_tova_keeps_the_rows_the_last_query_reads_averaged_over_the_layers_heads():
    """kvpress ``TOVAPress``: the last query's attention averaged over every query head of the layer, so each KV
    head keeps the same rows (not each head the rows its own query heads read)."""
    layer = _layer("fp16,sink=1,keep=3rows,score=tova,window=2")
    k = torch.zeros(1, 2, 10, 8)
    for t in range(10):
        k[0, :, t, t % 8] = 1.0
    q = torch.zeros(1, 4, 10, 8)  # query heads 0,1 read KV head 0; 2,3 read KV head 1
    q[0, :2, -1, 3], q[0, :2, -1, 5] = 20.0, 19.0  # heads 0,1: row 3 (0.73), row 5 (0.27)
    q[0, 2:, -1, 6] = 20.0  # heads 2,3: row 6 alone
    layer.update(k, k.clone())
    layer.after_attention(q, 1.0, True)
    # 1 sink + the last 2 are protected; a budget of 3 rows leaves 0 ... so: keep=3rows < protected -> protected only
    assert layer.evictor.positions.view()[0, 0].tolist() == [0, 8, 9]
    layer = _layer("fp16,sink=1,keep=5rows,score=tova,window=2")
    layer.update(k, k.clone())
    layer.after_attention(q, 1.0, True)
    # layer means: row 6 0.5, row 3 0.37, row 5 0.13: both heads keep 3 and 6 (per head, head 0 kept 3 and 5)
    assert layer.evictor.positions.view()[0, 0].tolist() == [0, 3, 6, 8, 9]
    assert layer.evictor.positions.view()[0, 1].tolist() == [0, 3, 6, 8, 9]


def test_tova_is_kvpress_tova_press():
    """kvpress ``TOVAPress.score``, written out on its own: the softmax attention of the last query over every key,
    ``attn[..., -1:, :-1]``, averaged over all query heads (``mean(1)``) and repeated for each KV head. Ours equals
    it on every row but the last (kvpress pads the last row with max + 1; ours protects it by the window)."""
    from tqbench.engine.cache.evict import scores

    g = torch.Generator().manual_seed(5)
    t, d, n_rep, kv = 30, 8, 3, 2
    q = torch.randn(1, kv * n_rep, 4, d, generator=g) * 2
    k = torch.randn(1, kv, t, d, generator=g)
    got = scores.tova(q, k, 0.3)
    attn = torch.softmax(q[:, :, -1:] @ k.repeat_interleave(n_rep, 1).transpose(2, 3) * 0.3, dim=-1)
    want = attn[..., -1:, :-1].mean(1).repeat(1, kv, 1)  # [1, kv, t - 1]
    assert torch.allclose(got[..., :-1], want, atol=1e-6)
    # a ragged layer whose heads hold the same rows gives the same scores
    pos = torch.arange(t).expand(1, kv, t)
    assert torch.allclose(scores.tova(q, k, 0.3, pos), got, atol=1e-6)


def test_snapkv_keeps_the_pooled_cluster_the_window_reads():
    layer = _layer("fp16,sink=0,recent=0,keep=7rows,score=snapkv,window=2")
    k = torch.eye(32)[:30].view(1, 1, 30, 32).expand(1, 2, 30, 32).clone()
    q = torch.zeros(1, 4, 30, 32)
    q[0, :2, -2:, 5] = 20.0  # KV head 0's window reads position 5; head 1's reads 20
    q[0, 2:, -2:, 20] = 20.0
    layer.update(k, k.clone())
    layer.after_attention(q, 1.0, True)
    pos = layer.evictor.positions.view()[0]
    assert pos[0].tolist() == [3, 4, 5, 6, 7, 28, 29]  # average pooling over 5 rows keeps the spike's neighbours
    assert pos[1].tolist() == [18, 19, 20, 21, 22, 28, 29]


def test_snapkv_is_the_published_score_on_the_rows_it_ranks():
    """SnapKV as published (Li et al. 2024; kvpress ``SnapKVPress``), written out here on its own: the last
    ``window`` queries (causal among themselves) attend over every key, the softmax rows are averaged over the
    window, average-pooled over 5 rows, then averaged over the query heads that share a KV head (GQA). Ours
    equals it on every row it ranks away from the pooling edges (kvpress pools the rows before the window with
    zero padding, ours over the protected sinks and window: only the 2 rows beside each edge differ)."""
    from tqbench.engine.cache.evict import scores

    g = torch.Generator().manual_seed(3)
    t, w, d, n_rep, kv = 40, 6, 8, 3, 2
    q = torch.randn(1, kv * n_rep, w, d, generator=g) * 2
    k = torch.randn(1, kv, t, d, generator=g)
    got = scores.snapkv(q, k, 0.125, torch.arange(t - w, t), torch.arange(t).expand(1, kv, t))
    logits = q @ k.repeat_interleave(n_rep, 1).transpose(2, 3) * 0.125  # [1, Hq, w, t]
    future = torch.ones(w, w, dtype=torch.bool).triu(1)  # window query i does not read window key j > i
    logits[..., t - w :] = logits[..., t - w :].masked_fill(future, float("-inf"))
    probs = torch.softmax(logits, dim=-1)[..., : t - w].mean(dim=2)  # [1, Hq, t - w]
    pooled = torch.nn.functional.avg_pool1d(probs, 5, stride=1, padding=2)
    want = pooled.view(1, kv, n_rep, t - w).mean(dim=2)
    assert torch.allclose(got[..., 2 : t - w - 2], want[..., 2:-2], atol=1e-6)


def test_expected_attention_score_by_hand():
    from tqbench.engine.cache.evict import scores

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 6, 4, generator=g)  # one KV head, 2 query heads
    k, v = torch.randn(1, 1, 9, 4, generator=g), torch.randn(1, 1, 9, 4, generator=g)
    got = scores.expected(q, k, v, 0.5)
    want = []
    for h in range(2):
        mu, cov = q[0, h].mean(0), torch.cov(q[0, h].T)
        logits = 0.5 * k[0, 0] @ mu + 0.125 * torch.einsum("td,de,te->t", k[0, 0], cov, k[0, 0])
        want.append(torch.softmax(logits, -1))
    assert torch.allclose(got[0, 0], torch.stack(want).mean(0) * v[0, 0].norm(dim=-1), atol=1e-6)


def test_decode_eviction_gathers_packed_codes_never_requantizes(tiny_engine):
    model = tiny_engine.model
    tiny_engine.enable_fused()
    cache = TQCache("k=turbo4,v=turbo4,sink=2,recent=2,keep=0.5,score=tova,window=2,every=5", model.config)
    ids = torch.randint(3, 200, (1, 60), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        model(ids[:, :50], cache=cache)
        layer = cache.layers[1]
        before = {name: t.clone() for name, t in layer.k_store.packed_view().items()}
        pos_before = layer.evictor.positions.view()[0].clone()
        npk = layer.k_store.n_packed
        for t in range(50, 55):
            model(ids[:, t : t + 1], cache=cache)
    assert layer.evictor.evicted_decode > 0
    pos = layer.evictor.positions.view()[0]
    for h in range(pos.shape[0]):
        for j, p in enumerate(pos[h, 2 : 2 + layer.k_store.n_packed].tolist()):
            i = (pos_before[h] == p).nonzero()
            if i.numel() and int(i) - 2 < npk:  # a row packed before: its codes, as they were
                for name, t in layer.k_store.packed_view().items():
                    assert torch.equal(t[0, h, j], before[name][0, h, int(i) - 2])


def test_block_codec_refuses_cutting_packed_rows(tiny_engine):
    model = tiny_engine.model
    tiny_engine.enable_fused()
    cache = TQCache("k=int4,v=turbo4,sink=0,recent=0,keep=0.5,score=keynorm,every=2", model.config)
    with pytest.raises(EvictionError, match="packs 32 tokens per unit: an eviction cannot cut rows already packed"):
        prefill_then_steps(model, cache, 80, steps=4)


# -- generation ---------------------------------------------------------------------------------------------------
def test_keep_one_is_the_policy_without_keep(tiny_engine):
    ids = _ids(tiny_engine)
    ref = tiny_engine.generate(ids, "turbo4", max_new_tokens=12, stop_at_eos=False)
    got = tiny_engine.generate(ids, "turbo4,keep=1.0,score=tova,every=2", max_new_tokens=12, stop_at_eos=False)
    assert got.token_ids == ref.token_ids


@pytest.mark.parametrize("policy", ["turbo4,keep=0.5", "k=turbo4,v=turbo3,keep=0.4,score=tova,every=3,window=4",
                                    "turbo4,keep=30rows,score=expected,window=8,every=4"])
def test_modes_agree_exactly_in_float64(tiny_engine64, policy):
    ids = _ids(tiny_engine64)
    runs = {m: tiny_engine64.generate(ids, policy, m, max_new_tokens=12, stop_at_eos=False)
            for m in ("simulate", "compressed", "fused")}
    assert runs["fused"].token_ids == runs["compressed"].token_ids == runs["simulate"].token_ids
    assert runs["fused"].cache_report.fused_impl == {"native-cpu": runs["fused"].cache_report.fused_calls}
    plain = tiny_engine64.generate(ids, policy.split(",keep")[0] if "keep" in policy else "turbo4", "compressed",
                                   max_new_tokens=12, stop_at_eos=False)
    assert plain.cache_report.compressed_storage_bytes > runs["fused"].cache_report.compressed_storage_bytes


def test_speculative_decoding_refuses_with_the_reason(tiny_engine):
    with pytest.raises(ValueError, match="speculative decoding cannot run with token eviction"):
        tiny_engine.generate(_ids(tiny_engine), "turbo4,keep=0.5", max_new_tokens=4, prompt_lookup=2)


def test_h2o_with_every_is_refused_in_fused_mode_with_the_reason(tiny_engine):
    with pytest.raises(EvictionError, match="score=h2o with every= accumulates"):
        tiny_engine.generate(_ids(tiny_engine), "turbo4,keep=0.5,score=h2o,every=4", "fused", max_new_tokens=2)


def test_left_padded_batch_is_refused_and_serving_decodes_alone(tiny_engine):
    from tqbench.engine.batch import why_not_batched

    tok, model = tiny_engine.tokenizer, tiny_engine.model
    tok.padding_side = "left"
    batch = tok([PROMPT, "a short one"], return_tensors="pt", padding=True)
    with pytest.raises(EvictionError, match="cannot run on a left-padded batch"):
        model.generate(**batch, cache=tiny_engine.make_cache("turbo4,keep=0.5", "compressed"), max_new_tokens=2,
                       do_sample=False, pad_token_id=tok.pad_token_id)
    assert "evicts tokens" in why_not_batched(tiny_engine.make_cache("turbo4,keep=0.5", "fused"))
    assert why_not_batched(tiny_engine.make_cache("turbo4,keep=1.0", "fused")) is None


@pytest.mark.parametrize("family,evicting", [("gemma3_text", [1, 3]), ("mistral", []), ("gpt_oss", [1, 3])])
def test_families_evict_full_attention_layers_only(family, evicting):
    from tqbench.engine import Engine
    from tqbench.engine.models.families import family_model

    eng = Engine(family_model(family, dtype=torch.float64))
    ids = torch.randint(5, 300, (1, 40), generator=torch.Generator().manual_seed(0))
    pol = "turbo4,keep=0.5,window=4,recent=4,sink=2"
    runs = {m: eng.generate(ids, pol, m, max_new_tokens=4, stop_at_eos=False, prefill_chunk=0)
            for m in ("compressed", "fused")}
    assert runs["compressed"].token_ids == runs["fused"].token_ids
    rep = runs["fused"].cache_report
    assert rep.compressed_storage_bytes == estimate_kv(pol, eng.geometry, 43, prefill=40).total_bytes
    assert [r.layer for r in rep.layers if r.evicted_prefill] == evicting
    assert any("keep= does not apply to the" in n for n in rep.notes)


def test_triton_kernels_read_each_heads_kept_rows_as_the_reference(tiny_engine, monkeypatch):
    """The Triton kernels (interpreter without a GPU) read the evicted stores as the torch reference does."""
    from tests.unit.cache_helpers import fused_as_reference
    from tqbench.kernels import triton_status

    if not triton_status()[0]:
        pytest.skip(triton_status()[1])
    ref, got = fused_as_reference(tiny_engine, "turbo4,keep=0.5,score=tova,every=2,window=4", monkeypatch)
    assert got.cache_report.fused_impl == {"triton": got.cache_report.fused_calls}
    assert got.cache_report.compressed_storage_bytes == ref.cache_report.compressed_storage_bytes
    assert sum(r.evicted_decode for r in got.cache_report.layers) > 0


# -- the command line ---------------------------------------------------------------------------------------------
def _cli(*args):
    from click.testing import CliRunner

    from tqbench.cli import main

    return CliRunner().invoke(main, ["--headless", *args])


def test_validate_fused_says_the_native_kernel_ran_and_what_was_evicted():
    r = _cli("validate", "--model", "tiny", "--candidate", "turbo4,keep=0.5,score=snapkv", "--cache-mode", "fused",
             "--max-new-tokens", "4", "--threads", "1")
    assert "fused kernels" in r.output and "native-cpu:" in r.output
    assert "token eviction (keep=0.5, score=snapkv" in r.output


def test_bench_bytes_are_the_estimate_with_its_decoded_tokens():
    r = _cli("bench", "--model", "tiny", "--kv-policy", "turbo4,keep=0.5", "--max-new-tokens", "6", "--no-chat",
             "--prompt", PROMPT, "--json", "--threads", "1")
    d = json.loads(r.output[r.output.index("{"):])
    n_in, n_out = d["input_tokens"], d["output_tokens"]
    tiny = ("--layers", "4", "--kv-heads", "2", "--head-dim", "16")  # the tiny model's geometry
    e = _cli("kv-estimate", *tiny, "--kv-policy", "turbo4,keep=0.5", "--seq-len", str(n_in + n_out - 1),
             "--decoded", str(n_out - 1), "--json")
    assert json.loads(e.output[e.output.index("{"):])["rows"][0]["total_bytes"] == d["cache_report"]["compressed_storage_bytes"]
    bad = _cli("kv-estimate", *tiny, "--kv-policy", "turbo4", "--seq-len", "10", "--decoded", "10")
    assert bad.exit_code == 2 and "decoded=10 is invalid: use 0 to 9" in bad.output


def test_chunked_prefill_never_ends_in_a_one_row_call(tiny_engine):
    """A prompt of 2 chunks + 1 token: the last row joins the last chunk, so the bytes are the estimate's."""
    ids = torch.randint(5, 200, (1, 41), generator=torch.Generator().manual_seed(2))
    pol = "turbo4,keep=0.5,window=4"
    r = tiny_engine.generate(ids, pol, max_new_tokens=3, stop_at_eos=False, prefill_chunk=20)
    est = estimate_kv(pol, tiny_engine.geometry, 43, prefill=41)
    assert r.cache_report.compressed_storage_bytes == est.total_bytes


def test_a_sweep_takes_keep_policies(tmp_path, tiny_engine):
    from tqbench.engine.sweep import parse_spec, run_sweep

    pol = "turbo4,keep=0.5,score=tova,every=4,keep@0=1.0"
    spec = parse_spec({"models": ["tiny"], "policies": ["turbo4", pol], "texts": [{"name": "a", "prompt": "hello"}],
                       "measure": ["validate", "bytes"], "validate": {"max_new_tokens": 4}, "bytes": {"tokens": [4096]},
                       "threads": 1})
    report = run_sweep(spec, tmp_path / "out")
    rows = {r["policy_string"]: r for r in report.models[0]["rows"]}
    want = parse_policy(pol).to_string()
    assert set(rows) == {want, "k=turbo4,v=turbo4,sink=4,recent=16"}
    assert rows[want]["failed_cells"] == 0
    geo = tiny_engine.geometry
    assert rows[want]["estimated_bytes"][0]["total_bytes"] == estimate_kv(pol, geo, 4096).total_bytes
    assert rows[want]["est_bits_per_element"] < rows["k=turbo4,v=turbo4,sink=4,recent=16"]["est_bits_per_element"]


# -- demote: evicted rows kept at a cheaper codec ----------------------------------------------------------------
@pytest.mark.parametrize("mode", ["compressed", "simulate", "fused"])
@pytest.mark.parametrize("policy", ["turbo4,keep=0.5,demote=turbo2", "turbo4,keep=0.3,score=tova,every=4,demote=int2",
                                    "fp16,keep=20rows,window=4,demote=turbo1"])
def test_demoted_rows_are_counted_to_the_byte(tiny_engine, policy, mode):
    model = tiny_engine.model
    tiny_engine.enable_fused()
    cache = TQCache(policy, model.config, mode=mode)
    prefill_then_steps(model, cache, 100, steps=10)
    rep = cache.report()
    est = estimate_kv(policy, KVGeometry.from_config(model.config), 100, prefill=90)
    assert rep.compressed_storage_bytes == est.total_bytes and [r.total_bytes for r in rep.layers] == est.layer_bytes
    assert all(r.demoted_tokens == r.evicted_prefill + r.evicted_decode > 0 for r in rep.layers)
    dropped = estimate_kv(policy.split(",demote")[0], KVGeometry.from_config(model.config), 100, prefill=90)
    assert dropped.total_bytes < est.total_bytes


def test_demote_is_read_by_attention_and_modes_agree(tiny_engine64):
    ids = _ids(tiny_engine64)
    pol = "turbo4,keep=0.3,score=tova,every=3,window=4,demote=turbo2"
    runs = {m: tiny_engine64.generate(ids, pol, m, max_new_tokens=12, stop_at_eos=False).token_ids
            for m in ("compressed", "simulate")}
    assert runs["compressed"] == runs["simulate"]
    model = tiny_engine64.model
    logits = {}
    for p in (pol, pol.replace(",demote=turbo2", "")):  # the demoted rows are attended: the next logits differ
        cache = tiny_engine64.make_cache(p, "compressed")
        with torch.inference_mode():
            model(ids, cache=cache)
            logits[p] = model(torch.tensor([[7]]), cache=cache).logits
        assert cache.layers[0].get_mask_sizes(1)[0] == cache.layers[0].k_store.n_tokens + 1 + (
            cache.layers[0].evictor.n_demoted)
    assert not torch.allclose(*logits.values())


def test_demote_refusals():
    with pytest.raises(ValueError, match="demote=turbo2 keeps the evicted rows at a cheaper codec, but this policy "
                                         "evicts nothing: set keep below 1"):
        parse_policy("turbo4,demote=turbo2")
    with pytest.raises(ValueError, match="demote='turbo9' is invalid: unknown V codec"):
        parse_policy("turbo4,keep=0.5,demote=turbo9")
    parse_policy("turbo4,keep@0=0.5,demote=turbo2")  # a per-layer keep is enough


def test_export_says_the_engine_setting_cannot_evict(tiny_engine):
    from tqbench.engine.deploy.mapping import map_policy

    s = map_policy("turbo4,keep=0.5", "llamacpp", tiny_engine.geometry)
    assert any("token eviction (keep=0.5, score=snapkv): llama.cpp's KV cache type keeps every token" in u
               for u in s.unmapped)


@pytest.mark.parametrize("mode", ["compressed", "fused"])
def test_per_head_codecs_re_evict_while_decoding_to_the_byte(tiny_engine, mode):
    """A per-head codec list keeps each group's packed codes over its own heads: a decode-time eviction (every=)
    cuts every group's packed rows with that group's kept rows, and the bytes stay the estimate's."""
    model = tiny_engine.model
    tiny_engine.enable_fused()
    policy = "k=turbo4|turbo2,v=turbo3,sink=2,recent=2,keep=0.5,score=tova,window=2,every=4"
    cache = TQCache(policy, model.config, mode=mode)
    prefill_then_steps(model, cache, 60, steps=12)
    rep = cache.report()
    est = estimate_kv(policy, KVGeometry.from_config(model.config), 60, prefill=48)
    assert sum(r.evicted_decode for r in rep.layers) > 0
    assert rep.compressed_storage_bytes == est.total_bytes
