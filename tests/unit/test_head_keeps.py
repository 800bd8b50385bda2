"""Ragged per-head layers beyond heads=ada: per-head keep lists (``keep=0.5|1``, ``keep@L=...``), per-head codec
lists and calibrated keys in per-head stores, the demote tier per head; bytes are the estimate's to the byte (the
report's per-head rows too), compressed/simulate/fused agree, fused runs natively in one call per layer."""

import functools

import pytest
import torch

from tests.unit.cache_helpers import prefill_then_steps
from tqbench.engine.cache import TQCache
from tqbench.engine.cache.estimate import KVGeometry, estimate_kv
from tqbench.engine.cache.evict.kept import kept_positions
from tqbench.engine.engine import Engine
from tqbench.engine.models.families import family_model
from tqbench.engine.policy import parse_policy
from tqbench.engine.policy.keep import head_keeps, held_rows, parse_keep
from tqbench.engine.policy.spec import Policy


# -- the policy language --------------------------------------------------------------------------------------
def test_head_lists_parse_round_trip_and_collapse(tmp_path):
    pol = parse_policy("turbo4,keep=0.5|1|0.25,keep@3-5=0.75|0.5|1")
    assert pol.keep == (0.5, 1.0, 0.25)
    assert pol.to_string() == "k=turbo4,v=turbo4,sink=4,recent=16,keep=0.5|1|0.25,keep@3-5=0.75|0.5|1"
    assert parse_policy(pol.to_string()) == pol and Policy.from_dict(pol.to_dict()) == pol
    plans = pol.plan(6)
    assert [p.keep for p in plans] == [(0.5, 1.0, 0.25)] * 3 + [(0.75, 0.5, 1.0)] * 3
    assert all(pol.ragged(p) for p in plans)
    path = tmp_path / "p.toml"
    path.write_text('preset = "turbo4"\nkeep = [0.5, 1, 0.25]\n')
    assert parse_policy(str(path)).keep == (0.5, 1.0, 0.25)
    path.write_text('preset = "turbo4"\noverrides = [{role = "keep", layers = "3-5", codec = [0.75, 0.5, 1]}]\n')
    assert parse_policy(str(path)).overrides == (("keep", "3-5", "0.75|0.5|1"),)
    # every head the same fraction: that fraction, a uniform (non-ragged) layer
    same = parse_policy("turbo4,keep=0.5|0.5|0.5,keep@0=1|1|1")
    assert same.keep == 0.5 and same.to_string() == "k=turbo4,v=turbo4,sink=4,recent=16,keep=0.5,keep@0=1"
    assert [same.ragged(p) for p in same.plan(2)] == [False, False]
    assert parse_keep("1|0.5") == (1.0, 0.5) and parse_keep(0.5) == 0.5


@pytest.mark.parametrize("text,msg", [
    ("turbo4,keep=0.5|2", r"keep='0.5\|2' is invalid: entry '2' is not a fraction: a per-head keep list is one "
                          r"fraction 0 < f <= 1 per KV head"),
    ("turbo4,keep=0.5|", "entry '' is not a fraction"),
    ("turbo4,keep@1=0|0.5", "entry '0' is not a fraction"),
    ("turbo4,keep=0.5|1,heads=ada", "heads=ada .* takes one keep value per layer, not a per-head keep list"),
])
def test_bad_lists_say_what_to_use(text, msg):
    with pytest.raises(ValueError, match=msg):
        parse_policy(text)


def test_a_list_of_the_wrong_length_names_the_layer_and_its_kv_heads():
    geo = KVGeometry(num_layers=4, kv_heads=3, head_dim=64)
    with pytest.raises(ValueError, match=r"keep=0.5\|1 lists 2 fractions but layer 2 has 3 KV heads: give one "
                                         r"fraction per KV head, in head order \(F0\|...\|F2\)"):
        estimate_kv("turbo4,keep@2=0.5|1", geo, 512)
    assert head_keeps(0.5, 3) == (0.5, 0.5, 0.5)


def test_kv_estimate_cli_exits_2_on_a_wrong_count():
    from click.testing import CliRunner

    from tqbench.cli import main

    r = CliRunner().invoke(main, ["--headless", "kv-estimate", "--model", "SmolLM2-135M", "--seq-len", "1024",
                                  "--kv-policy", "turbo4,keep=0.5|1"])
    assert r.exit_code == 2 and "lists 2 fractions but layer 0 has 3 KV heads" in r.output
    ok = CliRunner().invoke(main, ["--headless", "kv-estimate", "--model", "SmolLM2-135M", "--seq-len", "1024",
                                   "--kv-policy", "turbo4,keep=0.5|1|0.25", "--json"])
    assert ok.exit_code == 0, ok.output
    import json

    row = json.loads(ok.output)["rows"][0]
    # 4 sinks + 32 protected (window) + floor(f * 988) per head, every layer of 30; the report gives the same
    assert row["head_rows"] == [[530, 1024, 283]] * 30


# -- the cache: rows per head, bytes, modes ----------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["compressed", "simulate"])
@pytest.mark.parametrize("policy", [
    "turbo4,keep=0.5|1", "k=turbo4|turbo2,v=turbo3|turbo4,keep=0.25|0.75,score=tova,every=3",
    "turbo4,keep=0.5|0.25,demote=turbo2,window=8", "turbo4,keep@1-2=0.3|0.6,score=h2o,every=4",
    "k=turbo3,v=int4,keep=0.9|0.5,score=expected,window=8",
    "turbo4,keep=0.4,score=tova,every=3,heads=ada,demote=turbo3,ada_floor=0",
])
def test_each_head_holds_its_own_rule_and_bytes_are_the_estimate(tiny_engine, policy, mode):
    model = tiny_engine.model
    tiny_engine.enable_fused()
    cache = TQCache(policy, model.config, mode=mode)
    prefill_then_steps(model, cache, 100, steps=10)
    rep = cache.report()
    est = estimate_kv(policy, KVGeometry.from_config(model.config), 100, prefill=90)
    assert rep.compressed_storage_bytes == est.total_bytes
    assert [r.total_bytes for r in rep.layers] == est.layer_bytes
    assert rep.shared_objects and sum(rep.shared_objects.values()) == est.shared_bytes
    pol = parse_policy(policy)
    for plan, row in zip(pol.plan(4), rep.layers):
        if not plan.evicts:
            assert row.head_tokens == () and row.tokens == 100
            continue
        want = [held_rows(100, 90, k, plan.sink, pol.window, plan.recent, pol.every) for k in head_keeps(plan.keep, 2)]
        if pol.heads == "ada":  # the layer's budget, shared by the heads' scores
            assert sum(row.head_tokens) == sum(want)
            assert est.head_rows[plan.layer] == ()
        else:  # each head its own keep fraction, the same rule as a uniform layer's; the estimate says so too
            assert list(row.head_tokens) == want == list(est.head_rows[plan.layer])
        assert row.tokens == sum(want) // 2
        if pol.demote:
            assert row.demoted_tokens == 100 - row.tokens


def test_a_head_list_keeps_what_each_uniform_keep_would(tiny_engine64):
    """keep=1|0.5: head 0 keeps every position, head 1 exactly the rows keep=0.5 gives it (the same scores)."""
    ids = torch.randint(5, 200, (1, 80), generator=torch.Generator().manual_seed(3))
    kept = {}
    for pol in ("turbo4,keep=1|0.5,score=snapkv", "turbo4,keep=0.5,score=snapkv"):
        tiny_engine64.enable_fused()
        cache = TQCache(pol, tiny_engine64.model.config, mode="compressed")
        with torch.inference_mode():
            tiny_engine64.model(ids, cache=cache)
        kept[pol] = kept_positions(cache)
    same = TQCache("turbo4,keep=0.5|0.5,score=snapkv", tiny_engine64.model.config, mode="compressed")
    with torch.inference_mode():
        tiny_engine64.model(ids, cache=same)
    assert not any(la.ragged for la in same.layers)  # every head the same fraction: the uniform path
    assert kept_positions(same) == kept["turbo4,keep=0.5,score=snapkv"]
    per_head, uniform = kept.values()
    for a, b in zip(per_head.layers, uniform.layers):
        assert a.heads[0] == tuple(range(80))
        assert a.heads[1] == b.heads[1] and len(a.heads[1]) < 80
        assert a.evicted_prefill == (80 - len(a.heads[1])) // 2  # the mean over the heads


def test_a_batch_evicts_each_sequence_to_the_same_per_head_counts(tiny_engine64):
    """Per-head keeps fix each head's count by the policy (not by the scores): a batch evicts at once."""
    ids = torch.randint(5, 200, (1, 60), generator=torch.Generator().manual_seed(1))
    pol = "turbo4,keep=0.5|0.25,every=3,score=tova"
    for mode in ("compressed", "fused"):
        tiny_engine64.enable_fused()
        one = tiny_engine64.make_cache(pol, mode)
        two = tiny_engine64.make_cache(pol, mode)
        with torch.inference_mode():
            a = tiny_engine64.model.generate(ids, cache=one, max_new_tokens=6, do_sample=False)
            b = tiny_engine64.model.generate(ids.repeat(2, 1), cache=two, max_new_tokens=6, do_sample=False)
        assert b[0].tolist() == b[1].tolist() == a[0].tolist()
        rep = two.report()
        assert rep.compressed_storage_bytes == estimate_kv(pol, KVGeometry.from_config(tiny_engine64.model.config), 65,
                                                           batch=2, prefill=60).total_bytes
        assert [r.head_tokens for r in rep.layers] == [r.head_tokens for r in one.report().layers]
        if mode == "fused":
            assert rep.fused_impl == {"native-cpu": rep.fused_calls} and not rep.fallbacks


# -- fused: one native call per layer, every head a side, its tier merged in ------------------------------------------
def _logits(engine, policy, mode, ids, steps=6):
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


@pytest.mark.parametrize("policy", [
    "k=turbo4|turbo2,v=turbo3|turbo4,keep=0.3|0.6,score=tova,every=2,window=4,demote=turbo2",
    "turbo4,keep=0.5,score=snapkv,heads=ada,demote=turbo2,window=4",
    "turbo4,keep@0-1=1|0.4,keep@3=0.5|0.2,score=keynorm,window=4,demote=turbo3",
])
def test_fused_native_one_call_per_layer_matches_compressed(tiny_engine64, policy):
    ids = torch.randint(5, 200, (1, 70), generator=torch.Generator().manual_seed(2))
    ref, c_ref = _logits(tiny_engine64, policy, "compressed", ids)
    got, c_got = _logits(tiny_engine64, policy, "fused", ids)
    assert (got - ref).abs().max() < 1e-9  # float64: the same rows, the same codes, each tier in its head's softmax
    rep = c_got.report()
    assert rep.fused_impl == {"native-cpu": rep.fused_calls} and rep.fused_calls == 4 * 6  # one per layer per step
    assert not rep.fallbacks
    assert [r.head_tokens for r in rep.layers] == [r.head_tokens for r in c_ref.report().layers]
    assert all(r.demoted_tokens > 0 for r in rep.layers if r.head_tokens)
    est = estimate_kv(policy, KVGeometry.from_config(tiny_engine64.model.config), 76, prefill=70)
    assert rep.compressed_storage_bytes == c_ref.report().compressed_storage_bytes == est.total_bytes
    dropped, _ = _logits(tiny_engine64, policy.replace(",demote=turbo2", "").replace(",demote=turbo3", ""),
                         "fused", ids)
    assert (dropped - ref).abs().max() > 1e-3  # (each head's tier is read)


def test_torch_reference_reads_each_heads_tier(tiny_engine, monkeypatch):
    from tests.unit.cache_helpers import fused_as_reference

    ref, got = fused_as_reference(tiny_engine, "turbo4,keep=0.5|0.25,score=tova,window=4,demote=turbo2", monkeypatch,
                                  impl="native")
    assert set(ref.cache_report.fused_groups) == {"kv head 0 (per-head keep)", "kv head 1 (per-head keep)"}
    assert got.cache_report.fused_impl == {"native-cpu": got.cache_report.fused_calls}
    assert got.cache_report.compressed_storage_bytes == ref.cache_report.compressed_storage_bytes


# -- heads=ada over a per-head codec list: rows move only between heads whose rows cost the same -------------------
@functools.cache
def _four_heads() -> Engine:
    return Engine(family_model("llama", dtype=torch.float64, num_key_value_heads=4, num_attention_heads=8))


def test_ada_shares_rows_within_heads_of_equal_cost_only():
    eng = _four_heads()
    pol = "k=turbo4|turbo2|turbo4|turbo2,v=turbo4,keep=0.4,score=snapkv,heads=ada,ada_floor=0,window=4"
    ids = torch.randint(5, 200, (1, 80), generator=torch.Generator().manual_seed(4))
    ref, c_ref = _logits(eng, pol, "compressed", ids, steps=3)
    got, c_got = _logits(eng, pol, "fused", ids, steps=3)
    assert (got - ref).abs().max() < 1e-9
    rep = c_got.report()
    assert rep.fused_impl == {"native-cpu": rep.fused_calls} and not rep.fallbacks
    est = estimate_kv(pol, KVGeometry.from_config(eng.model.config), 83, prefill=80)
    assert rep.compressed_storage_bytes == est.total_bytes
    plan = parse_policy(pol).plan(4)[0]
    want = held_rows(83, 80, plan.keep, plan.sink, 4, plan.recent, 0)
    moved = 0
    for r in rep.layers:
        h = r.head_tokens
        assert h[0] + h[2] == h[1] + h[3] == 2 * want  # each cost group keeps its own share
        moved += h[0] != h[2] or h[1] != h[3]
    assert moved  # AdaKV moved rows within a group somewhere


# -- calibrated keys: each head's store its own head's table -------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_fit(tiny_engine64, tmp_path_factory):
    from tqbench.engine.calibrate import fit_transforms
    from tqbench.engine.codecs.transforms_file import save_transforms

    tr = fit_transforms(tiny_engine64, ["prose", "code"], max_tokens=96)
    return str(save_transforms(tr, tmp_path_factory.mktemp("fit") / "tiny.safetensors"))


@pytest.mark.parametrize("k,extra", [("pcaq2.5", "keep=0.5|0.75"), ("pcaq3|pcaq2", "keep=0.5,heads=ada,demote=turbo1")])
def test_calibrated_keys_in_per_head_stores(tiny_engine64, tiny_fit, k, extra):
    pol = f"k={k},v=turbo2,calib={tiny_fit},window=4,{extra}"
    ids = torch.randint(5, 200, (1, 60), generator=torch.Generator().manual_seed(5))
    ref, c_ref = _logits(tiny_engine64, pol, "compressed", ids, steps=3)
    got, c_got = _logits(tiny_engine64, pol, "fused", ids, steps=3)
    assert (got - ref).abs().max() < 1e-9
    rep = c_got.report()
    assert rep.fused_impl == {"native-cpu": rep.fused_calls} and not rep.fallbacks
    est = estimate_kv(pol, KVGeometry.from_config(tiny_engine64.model.config), 63, prefill=60)
    assert rep.compressed_storage_bytes == c_ref.report().compressed_storage_bytes == est.total_bytes
    assert rep.shared_objects == c_ref.report().shared_objects
    # each head's store names its own table (basis, bit map and levels), counted once per layer and head
    assert {k.split(":", 2)[-1] for k in rep.shared_objects if ":L0:" in k} >= {"L0:k:h0:basis", "L0:k:h1:basis"}
    if "heads=ada" not in extra:  # one head's table each: the bytes of the layer-wide table, split by head
        whole = TQCache(f"k=pcaq2.5,v=turbo2,calib={tiny_fit}", tiny_engine64.model.config, mode="compressed")
        prefill_then_steps(tiny_engine64.model, whole, 63)
        assert sum(rep.shared_objects.values()) == sum(whole.report().shared_objects.values())


# -- a Gemma-3-shaped model: one KV head, head_dim 256, sliding layers, prefill past the window ---------------------
def test_one_kv_head_head_dim_256_past_the_window():
    from tests.unit.families.test_family_allocate import gemma3_shaped

    eng = gemma3_shaped()
    ids = torch.randint(5, 300, (1, 48), generator=torch.Generator().manual_seed(0))
    pol = "turbo4,keep=0.5,window=4,recent=4,sink=2,heads=ada,demote=turbo2"
    runs = {m: eng.generate(ids, pol, m, max_new_tokens=5, stop_at_eos=False, prefill_chunk=0)
            for m in ("compressed", "simulate", "fused")}
    assert runs["compressed"].token_ids == runs["simulate"].token_ids == runs["fused"].token_ids
    fused = runs["fused"].cache_report
    assert fused.fused_impl == {"native-cpu": fused.fused_calls} and not fused.fallbacks
    rep = runs["compressed"].cache_report
    assert rep.compressed_storage_bytes == fused.compressed_storage_bytes == estimate_kv(
        pol, eng.geometry, 52, prefill=48).total_bytes
    assert [r.layer for r in rep.layers if r.head_tokens] == [5]  # the one full-attention layer
    assert rep.layers[5].demoted_tokens + rep.layers[5].tokens == 52
    with pytest.raises(ValueError, match=r"keep=0.5\|1 lists 2 fractions but layer 5 has 1 KV heads"):
        eng.generate(ids, "turbo4,keep=0.5|1", "compressed", max_new_tokens=1)


# -- the family matrix: every family's tiny model, per-head keeps + per-head codecs + demote --------------------
_FRACTIONS = ("0.5", "1", "0.25", "0.75")
_CODECS = ("turbo4", "turbo3", "turbo2", "turbo4")


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3", "gpt_oss",
                                    "granite", "cohere", "starcoder2", "gpt_neox", "olmo2", "falcon", "deepseek_v3"])
def test_family_matrix(family):
    from tests.unit.families.short_windows import short_window_model
    from tests.unit.families.test_family_matrix import NO_FUSED

    eng = Engine(short_window_model(family, dtype=torch.float64))
    heads = eng.geometry.kv_heads
    pol = (f"k={'|'.join(_CODECS[h % 4] for h in range(heads))},v=turbo4,sink=2,recent=4,window=4,score=snapkv,"
           f"keep={'|'.join(_FRACTIONS[h % 4] for h in range(heads))},demote=turbo2")
    ids = torch.randint(5, 200, (1, 40), generator=torch.Generator().manual_seed(6))
    if family in NO_FUSED:  # eviction reads the queries in tqbench's attention function, which these cannot run
        from tqbench.engine.cache.fused.support import FusedUnsupportedError

        with pytest.raises(FusedUnsupportedError, match=f"^{type(eng.model).__name__} cannot evict tokens \\(keep=\\) in "
                           "any cache mode: eviction ranks rows by the queries tqbench's attention function records"):
            eng.generate(ids, pol, "compressed", max_new_tokens=1)
        return
    modes = ("compressed", "simulate", "fused")
    runs = {m: eng.generate(ids, pol, m, max_new_tokens=4, stop_at_eos=False, prefill_chunk=0) for m in modes}
    assert len({tuple(r.token_ids) for r in runs.values()}) == 1  # float64: every mode the same tokens
    est = estimate_kv(pol, eng.geometry, 43, prefill=40)
    for r in runs.values():
        assert r.cache_report.compressed_storage_bytes == est.total_bytes
        assert [row.head_tokens for row in r.cache_report.layers] == [tuple(h) for h in est.head_rows]
    full = [p.layer for p in parse_policy(pol).plan(eng.geometry.num_layers, list(eng.geometry.layer_types or []) or
                                                     None) if p.evicts]
    # every full-attention layer evicts per head (one KV head, as multi-query Falcon: a one-entry list is uniform)
    assert [i for i, h in enumerate(est.head_rows) if h] == (full if heads > 1 else [])
    assert full or family in ("mistral", "phi3")  # (these two slide on every layer: they hold their window)
    if "fused" in runs:
        rep = runs["fused"].cache_report
        if family == "gpt_oss":  # sink logits per query head: head by head, and the report says why
            assert any("sink logits differ per query head" in case for case in rep.fallbacks)
        else:
            assert rep.fused_impl == {"native-cpu": rep.fused_calls} and not rep.fallbacks
