"""Per-KV-head widths: a head list ``SPEC0|SPEC1|...`` gives each KV head of a layer its own codec, in the policy
language, the codecs, the store, the byte accounting (report == estimate to the byte) and every cache mode."""

from __future__ import annotations

import json

import pytest
import torch

from tests.unit.cache_helpers import store_bytes_snapshot
from tqbench.engine.cache import KVGeometry, TQCache, estimate_kv
from tqbench.engine.cache.store import KVStore
from tqbench.engine.codecs import HeadSplitCodec, canonical_spec, codec_from_spec, nominal_bits
from tqbench.engine.policy import Policy, parse_policy
from tqbench.engine.policy.files import load_policy_file

MIXED = [
    "k=turbo4|int4,v=turbo2,sink=2,recent=3",  # per-channel KIVI keys (32-token blocks) beside a per-token head
    "k=turbo2|turbo4,v=int4|turbo3,recent=5",
    "kv=turbo3|fp16,sink=1",
    "k=turbo3.5|turbo2-qjl,v=fp8_e4m3-prefill|turbo2",
]


def _rows(b, h, t, d=16, seed=0, dtype=torch.float32):
    return torch.randn(b, h, t, d, generator=torch.Generator().manual_seed(seed)).to(dtype)


# -- the policy language ---------------------------------------------------------------------------------
def test_a_head_list_of_equal_entries_is_that_one_spec():
    a, b = parse_policy("k=turbo2|TURBO2|turbo2,v=int4|q4,recent=4"), parse_policy("k=turbo2,v=int4,recent=4")
    assert a == b and a.to_string() == b.to_string() == "k=turbo2,v=int4,recent=4"
    assert not a.per_head
    assert canonical_spec("q4|int4") == "int4" and canonical_spec("Turbo2| q4") == "turbo2|int4"
    assert parse_policy("turbo4,v@last1=turbo2|turbo2").overrides[-1] == ("v", "last1", "turbo2")


def test_head_lists_round_trip_through_every_policy_form(tmp_path):
    pol = parse_policy("k=turbo4|turbo2|turbo3,v=turbo2,k@0-1=int4|turbo2|fp16,sink=2")
    assert pol.per_head and pol.k == "turbo4|turbo2|turbo3"
    assert parse_policy(pol.to_string()) == pol
    assert Policy.from_dict(json.loads(json.dumps(pol.to_dict()))) == pol
    path = tmp_path / "heads.toml"
    path.write_text('[policy]\nk = ["turbo4", "turbo2", "turbo3"]\nv = "turbo2"\nsink = 2\n'
                    '[[policy.overrides]]\nrole = "k"\nlayers = "0-1"\ncodec = "int4|turbo2|fp16"\n')
    assert load_policy_file(str(path)) == pol
    plan = pol.plan(4)
    assert [p.k for p in plan] == ["int4|turbo2|fp16"] * 2 + ["turbo4|turbo2|turbo3"] * 2
    assert nominal_bits("turbo4|turbo2|turbo3") == 3.0


@pytest.mark.parametrize("text,message", [
    ("k=turbo2||turbo4", r"head list 'turbo2\|\|turbo4': entry 1 is empty: give one codec per KV head"),
    ("k=turbo2|turbo9", r"K head list 'turbo2\|turbo9': unknown K codec 'turbo9'"),
    ("v=turbo2|pcaq2", r"V head list 'turbo2\|pcaq2': pcaq2 is a key codec"),
    ("kv@0=pcaq2|turbo2", r"KV head list 'pcaq2\|turbo2': pcaq2 is a key codec"),
    ("k=turbo2|(turbo3|turbo4)", r"is not a codec name: a head list is one flat list"),
])
def test_bad_head_lists_are_refused_with_what_to_do(text, message):
    with pytest.raises(ValueError, match=message):
        parse_policy(text)


def test_nested_lists_in_a_policy_file_are_refused():
    with pytest.raises(ValueError, match="lists cannot nest"):
        Policy.from_dict({"k": [["turbo2", "turbo4"], "turbo2"]})
    with pytest.raises(ValueError, match="lists cannot nest"):
        Policy.from_dict({"v": ["turbo2|turbo3", "turbo2"]})


def test_a_wrong_head_count_names_the_layer_the_role_and_both_counts(tiny_engine):
    cfg = tiny_engine.model.config  # 2 KV heads
    msg = r"layer 2: the V head list 'turbo2\|turbo3\|turbo4' has 3 entries but the model has 2 KV heads"
    with pytest.raises(ValueError, match=msg):
        TQCache("k=turbo4,v@2=turbo2|turbo3|turbo4", cfg)
    with pytest.raises(ValueError, match=msg):
        estimate_kv("k=turbo4,v@2=turbo2|turbo3|turbo4", KVGeometry.from_config(cfg), 10)


# -- the codec: each head is its own codec -----------------------------------------------------------------
@pytest.mark.parametrize("k,v", [("turbo4|int4|turbo2", "turbo2"), ("turbo2|turbo4|turbo2", "int2|turbo3|int2"),
                                 ("fp16|turbo3.5|turbo1", "turbo2-qjl|int8|fp16")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_each_heads_rows_are_its_own_codec_on_its_own_rows(k, v, dtype):
    pol = parse_policy(f"k={k},v={v}")
    plan = pol.plan(1)[0]
    kc, vc = pol.layer_codecs(plan, 3)
    assert isinstance(kc, HeadSplitCodec) and isinstance(vc, HeadSplitCodec) and kc.groups == vc.groups
    assert kc.tokens_per_unit == (32 if "int" in k else 1)
    x = _rows(2, 3, 64, dtype=dtype)
    for codec, spec, role in ((kc, k, "k"), (vc, v, "v")):
        state = codec.calibrate(x)
        dec = codec.decode(codec.encode(x, state), state, dtype)
        for h in range(3):
            entry = spec.split("|")[h] if "|" in spec else spec
            solo = pol.build_codec(entry, role, layer=0, heads=(h,))
            st = solo.calibrate(x[:, h : h + 1])
            want = solo.decode(solo.encode(x[:, h : h + 1], st), st, dtype)
            assert torch.equal(dec[:, h : h + 1], want), (role, h, entry)


def test_per_head_bytes_are_the_sum_of_each_heads_bytes():
    kc = codec_from_spec("turbo4|int4|turbo2", "k")
    # one 32-token unit: turbo4 head 32 x (8 + 2), int4 head one KIVI block (32 x 16 / 2 + 2 x 16 x 2),
    # turbo2 head 32 x (4 + 2)
    assert kc.tokens_per_unit == 32
    assert kc.units_bytes(16, 3) == 32 * 10 + (256 + 64) + 32 * 6
    assert kc.bits_per_element(16) == (32 * 10 + 320 + 32 * 6) * 8 / (32 * 16 * 3)
    with pytest.raises(ValueError, match="units_bytes"):
        kc.unit_bytes(16)
    with pytest.raises(ValueError, match="got rows of 2 KV heads"):
        kc.encode(_rows(1, 2, 32), {})


# -- the store and the byte accounting ---------------------------------------------------------------------
def _run(engine, policy, tokens, batch=1, mode="compressed"):
    cache = TQCache(policy, engine.model.config, mode=mode)
    ids = torch.randint(3, 200, (batch, tokens), generator=torch.Generator().manual_seed(tokens))
    if mode == "fused":
        engine.enable_fused()
    with torch.inference_mode():
        engine.model(ids[:, : max(tokens - 3, 1)], cache=cache)  # prefill, then single-token steps
        for t in range(max(tokens - 3, 1), tokens):
            engine.model(ids[:, t : t + 1], cache=cache)
    return cache


@pytest.mark.parametrize("policy", MIXED)
@pytest.mark.parametrize("tokens,batch", [(1, 1), (7, 1), (40, 2), (77, 1), (70, 2)])
def test_report_bytes_match_the_estimate_to_the_byte(tiny_engine, policy, tokens, batch):
    cache = _run(tiny_engine, policy, tokens, batch)
    rep = cache.report()
    est = estimate_kv(policy, KVGeometry.from_config(tiny_engine.model.config), tokens, batch)
    assert rep.compressed_storage_bytes == est.total_bytes
    assert [r.total_bytes for r in rep.layers] == est.layer_bytes
    assert rep.dense_fp16_bytes == est.dense_fp16_bytes


def test_hand_computed_bytes_of_a_per_head_layer(tiny_engine):
    """1 layer's K: turbo4 head + KIVI int4 head (32-token blocks), 77 tokens, sink 2, recent 3: 64 rows packed
    (two whole 32-token units of both heads), 13 full precision; state: head 0's centering mean (fp16)."""
    cache = _run(tiny_engine, "k=turbo4|int4,v=fp16,sink=2,recent=3", 77)
    k = cache.layers[0].k_store
    assert (k.head.n, k.n_packed, k.tail.n) == (2, 64, 11)
    assert k.bytes_breakdown() == {"full_precision": 13 * 2 * 16 * 2, "packed": 2 * (32 * 10 + 320),
                                   "state": 16 * 2}


def test_a_list_of_equal_entries_gives_the_same_tokens_and_bytes(tiny_engine):
    ids = tiny_engine.encode_prompt("the quick brown fox jumps over the lazy dog " * 3, chat=False)
    a = tiny_engine.generate(ids, "k=turbo3|turbo3,v=int4|int4,recent=4", "compressed", max_new_tokens=12,
                             stop_at_eos=False)
    b = tiny_engine.generate(ids, "k=turbo3,v=int4,recent=4", "compressed", max_new_tokens=12, stop_at_eos=False)
    assert a.token_ids == b.token_ids
    assert a.cache_report.compressed_storage_bytes == b.cache_report.compressed_storage_bytes


@pytest.mark.parametrize("policy", MIXED[:3])
def test_simulate_and_compressed_agree_exactly_in_float64(tiny_engine64, policy):
    ids = tiny_engine64.encode_prompt("the quick brown fox jumps over the lazy dog " * 3, chat=False)
    runs = {m: tiny_engine64.generate(ids, policy, m, max_new_tokens=16, stop_at_eos=False).token_ids
            for m in ("simulate", "compressed")}
    assert runs["simulate"] == runs["compressed"]


def test_dense_shadow_reads_exact_rows_with_a_per_head_store(tiny_engine):
    ids = tiny_engine.encode_prompt("the quick brown fox jumps over the lazy dog " * 3, chat=False)
    ref = tiny_engine.generate(ids, None, max_new_tokens=12, stop_at_eos=False)
    got = tiny_engine.generate(ids, MIXED[0], "dense-shadow", max_new_tokens=12, stop_at_eos=False)
    assert got.token_ids == ref.token_ids
    assert got.cache_report.compressed_storage_bytes == _run(tiny_engine, MIXED[0], ids.shape[1] + 11) \
        .report().compressed_storage_bytes



@pytest.mark.parametrize("spec,window", [("turbo4|int4", None), ("turbo2|turbo4", None), ("int4|turbo3", 40)])
@pytest.mark.parametrize("prompt,drafts,keep", [(30, 5, 2), (30, 5, 0), (3, 9, 6), (0, 40, 37)])
def test_crop_leaves_a_per_head_store_as_if_the_tokens_were_never_appended(spec, window, prompt, drafts, keep):
    pol = parse_policy(f"k={spec},v=turbo2,sink=2,recent=3,kblock=8")
    codec = pol.layer_codecs(pol.plan(1)[0], 2)[0]
    x = _rows(1, 2, prompt + drafts)

    def store():
        return KVStore(codec, pol.sink, pol.recent, window, align=codec.tokens_per_unit)

    spec_store, ref = store(), store()
    if prompt:
        spec_store.append(x[:, :, :prompt])
        ref.append(x[:, :, :prompt])
    spec_store.mark()
    spec_store.append_points(x[:, :, prompt:], list(range(1, drafts + 1)))
    spec_store.crop(prompt + keep)
    for i in range(prompt, prompt + keep):
        ref.append(x[:, :, i : i + 1])
    assert store_bytes_snapshot(spec_store) == store_bytes_snapshot(ref)
    assert spec_store.bytes_breakdown() == ref.bytes_breakdown()


def test_batch_select_and_repeat_keep_each_sequences_per_head_store(tiny_engine):
    cache = _run(tiny_engine, MIXED[1], 40, batch=2)
    one = _run(tiny_engine, MIXED[1], 40, batch=2)
    cache.batch_select_indices(torch.tensor([1]))
    for a, b in zip(cache.layers, one.layers):
        for sa, sb in ((a.k_store, b.k_store), (a.v_store, b.v_store)):
            for name, t in sa.packed_view().items():
                assert torch.equal(t, sb.packed_view()[name][1:2])


# -- calibrated (pcaq) heads: each head's fitted tables ------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_fit(tiny_engine, tmp_path_factory):
    from tqbench.engine.calibrate import fit_transforms
    from tqbench.engine.codecs.transforms_file import save_transforms

    tr = fit_transforms(tiny_engine, ["prose", "code"], max_tokens=96)
    return str(save_transforms(tr, tmp_path_factory.mktemp("fit") / "tiny.safetensors"))


def test_a_pcaq_codec_built_for_one_head_is_that_head_of_the_layers_codec(tiny_fit):
    pol = parse_policy(f"k=pcaq3,v=turbo2,calib={tiny_fit}")
    full = pol.build_codec("pcaq3", "k", layer=1)
    x = _rows(2, 2, 24)
    st = full.calibrate(x)
    dec = full.decode(full.encode(x, st), st, torch.float32)
    for h in range(2):
        one = pol.build_codec("pcaq3", "k", layer=1, heads=(h,))
        s1 = one.calibrate(x[:, h : h + 1])
        enc = one.encode(x[:, h : h + 1], s1)
        assert torch.equal(enc["idx"], full.encode(x, st)["idx"][:, h : h + 1])
        assert torch.equal(one.decode(enc, s1, torch.float32), dec[:, h : h + 1])
    # per-head shared tables add up to the layer's
    both = {**pol.build_codec("pcaq3", "k", layer=1, heads=(0,)).shared_items(16),
            **pol.build_codec("pcaq3", "k", layer=1, heads=(1,)).shared_items(16)}
    assert sum(both.values()) == sum(full.shared_items(16).values())
    with pytest.raises(ValueError, match=r"built for heads \[1\], got rows of 2 heads"):
        pol.build_codec("pcaq3", "k", layer=1, heads=(1,)).calibrate(x)


@pytest.mark.parametrize("tokens", [9, 40])
def test_a_pcaq_head_list_counts_its_bytes_exactly(tiny_engine, tiny_fit, tokens):
    policy = f"k=pcaq3|turbo2,v=turbo2|turbo3,sink=1,recent=2,calib={tiny_fit}"
    cache = _run(tiny_engine, policy, tokens)
    rep = cache.report()
    est = estimate_kv(policy, KVGeometry.from_config(tiny_engine.model.config), tokens)
    assert rep.compressed_storage_bytes == est.total_bytes and est.shared_bytes == rep.shared_bytes
    assert any(":h0:basis" in name for name in rep.shared_objects)
    assert not any(":h1:basis" in name for name in rep.shared_objects)  # head 1 is turbo2: no basis counted


def test_protect_and_sliding_rules_replace_a_head_list_and_the_bits_grid_shows_its_mean():
    from tqbench.engine.allocate.solver import Allocation

    pol = parse_policy("k=turbo4|turbo2,v=turbo2|int4,protect=last1")
    plans = pol.plan(3, ["full_attention", "sliding_attention", "full_attention"])
    assert [(p.k, p.v) for p in plans] == [("turbo4|turbo2", "turbo2|int4"), ("turbo4|turbo2", "turbo2|int4"),
                                           ("fp16", "fp16")]
    assert plans[1].sliding  # a mixed model's sliding layer is compressed in a window-bounded store (sliding=auto)
    geo = KVGeometry(num_layers=3, kv_heads=2, head_dim=16)
    est = estimate_kv(pol, geo, 50)
    alloc = Allocation(pol, tuple(p.k for p in plans), tuple(p.v for p in plans), 0.0, 3.0, est)
    assert alloc.bits_grid() == [[3.0, 3.0], [3.0, 3.0], [16.0, 16.0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k,v", [("pcaq3|turbo2", "turbo4|turbo1"), ("turbo3|pcaq2", "turbo2|turbo2")])
def test_a_per_head_layer_encodes_all_its_groups_in_one_native_call(tiny_fit, k, v, dtype):
    """The append path of a per-head layer: one native ``heads_encode`` for every group (turbo and calibrated keys,
    centred), each group's heads read from the layer's rows by index; the codes are each group's own encode's."""
    pol = parse_policy(f"k={k},v={v},calib={tiny_fit}")
    kc, vc = pol.layer_codecs(pol.plan(2)[1], 2)
    x = _rows(2, 2, 24, dtype=dtype)
    new = _rows(2, 2, 3, seed=1, dtype=dtype)
    for codec in (kc, vc):
        st = codec.calibrate(x)
        fast = codec.encode(new, st)
        assert codec._plan is not None and codec._plan[2] is not None  # the one native call ran
        for g, sub in enumerate(codec.subs):
            own = sub.encode(codec.take(new, g), HeadSplitCodec.sub_fields(st, g))
            for name, t in own.items():
                assert torch.equal(fast[f"g{g}.{name}"], t), (codec.spec, g, name)
        assert set(fast) == {f"g{g}.{n}" for g, sub in enumerate(codec.subs)
                             for n in sub.encode(codec.take(new, g), HeadSplitCodec.sub_fields(st, g))}
    # a group codec without a one-call form (int4): each group encodes on its own
    mp = parse_policy("k=int4|turbo2,v=turbo2")
    mixed = mp.layer_codecs(mp.plan(2)[1], 2)[0]
    rows = torch.cat([x, x], 2)[:, :, :32]
    st = mixed.calibrate(rows)
    enc = mixed.encode(rows, st)
    assert mixed._plan[2] is None
    own = mixed.subs[1].encode(mixed.take(rows, 1), HeadSplitCodec.sub_fields(st, 1))
    assert all(torch.equal(enc[f"g1.{n}"], t) for n, t in own.items())
