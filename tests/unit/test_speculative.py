"""Speculative decoding with a compressed cache: ``crop`` leaves every store byte for byte as if the cropped
tokens had never been appended; a verification call gives every draft token the logits of one-at-a-time
decoding; prompt-lookup and assisted generation give plain greedy's tokens in float64 in every mode; beam
search and ``num_return_sequences`` run on the same cache operations."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from tests.unit.cache_helpers import store_bytes_snapshot
from tqbench.engine.cache.store import KVStore
from tqbench.engine.cache.tqcache import TQCache, TQLayer
from tqbench.engine.engine import Engine
from tqbench.engine.policy import parse_policy

MODES = ("dense-shadow", "simulate", "compressed", "fused")
# policies whose stores pack inside a 5-token verification call: turbo (per-token), KIVI int4 keys (blocks of 8
# tokens here) with int2 values, a tiny recent window with sinks
POLICIES = ("turbo4", "k=int4,v=int2,kblock=8,sink=2,recent=3", "k=turbo3,v=turbo2,sink=2,recent=3")


@pytest.fixture(scope="module")
def fit(tiny_engine, tmp_path_factory):
    from tqbench.engine.calibrate import fit_transforms
    from tqbench.engine.codecs.transforms_file import save_transforms

    tr = fit_transforms(tiny_engine, ["prose", "code"], max_tokens=96)
    return str(save_transforms(tr, tmp_path_factory.mktemp("fit") / "tiny.safetensors"))


def _rows(n, seed=0, dtype=torch.float32):
    return torch.randn(1, 2, n, 16, generator=torch.Generator().manual_seed(seed)).to(dtype)



CODECS = [  # (policy, role, window)
    ("k=turbo4,v=turbo4,sink=4,recent=16", "k", None),
    ("k=turbo4,v=turbo4,sink=2,recent=3", "v", None),
    ("k=int4,v=int2,kblock=8,sink=2,recent=3", "k", None),  # KIVI blocks of 8 tokens
    ("k=int4,v=int2,kblock=8,sink=0,recent=0", "k", None),
    ("k=int4,v=int2,sink=2,recent=3", "v", None),
    ("k=turbo3,v=turbo2,recent=3", "k", 12),  # a sliding-window layer's store: evicts whole units
    ("k=int4,v=int4,kblock=4,recent=2", "k", 9),
]


@pytest.mark.parametrize("policy,role,window", CODECS)
@pytest.mark.parametrize("prompt,drafts,keep", [(30, 5, 2), (30, 5, 0), (30, 5, 5), (3, 9, 6), (0, 12, 7)])
def test_crop_leaves_the_store_as_if_the_tokens_were_never_appended(policy, role, window, prompt, drafts, keep):
    pol = parse_policy(policy)
    codec = pol.build_codec(pol.k if role == "k" else pol.v, role, layer=0)
    x = _rows(prompt + drafts)

    def store():
        return KVStore(codec, pol.sink, pol.recent, window, align=codec.tokens_per_unit)

    spec = store()
    if prompt:
        spec.append(x[:, :, :prompt])  # the prefill: one point
    spec.mark()
    spec.append_points(x[:, :, prompt:], list(range(1, drafts + 1)))  # verification: a point per draft token
    spec.crop(prompt + keep)

    ref = store()  # the prefill, then only the kept tokens, one at a time
    if prompt:
        ref.append(x[:, :, :prompt])
    for i in range(prompt, prompt + keep):
        ref.append(x[:, :, i : i + 1])
    assert store_bytes_snapshot(spec) == store_bytes_snapshot(ref)
    assert spec.bytes_breakdown() == ref.bytes_breakdown()
    # and it goes on as the reference does
    more = _rows(6, seed=1)
    spec.append(more)
    ref.append(more)
    assert store_bytes_snapshot(spec) == store_bytes_snapshot(ref)


def test_crop_of_a_calibrated_codec_restores_its_packed_rows_byte_for_byte(fit):
    pol = parse_policy(f"k=pcaq3,v=turbo2,sink=2,recent=3,calib={fit}")
    codec = pol.build_codec(pol.k, "k", layer=1)
    x = _rows(20, dtype=torch.float32)
    spec, ref = (KVStore(codec, 2, 3) for _ in range(2))
    spec.append(x[:, :, :12])
    ref.append(x[:, :, :12])
    spec.mark()
    spec.append_points(x[:, :, 12:], list(range(1, 9)))
    assert spec.n_packed == 20 - 2 - 3
    spec.crop(15)
    for i in range(12, 15):
        ref.append(x[:, :, i : i + 1])
    assert spec.n_packed == ref.n_packed == 15 - 2 - 3
    assert store_bytes_snapshot(spec) == store_bytes_snapshot(ref)


def test_a_crop_into_rows_packed_before_the_mark_is_refused_and_says_why():
    pol = parse_policy("k=int4,v=int4,kblock=8,recent=4")
    store = KVStore(pol.build_codec("int4", "k", layer=0), 0, 4)
    store.append(_rows(40))  # one call, no mark: 32 rows packed in blocks of 8, 8 exact in the tail
    store.crop(38)  # still exact tail rows, the same packed blocks: fine
    assert (store.seen, store.n_packed, store.tail.n) == (38, 32, 6)
    with pytest.raises(ValueError, match="already packed .* Crop right after the forward call"):
        store.crop(30)  # a block of 8 would have to come back exact


def _feed(model, cache, ids):
    with torch.inference_mode():
        return model(input_ids=ids, cache=cache, use_cache=True).logits[0]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", POLICIES)
def test_a_verification_call_gives_each_draft_token_the_logits_of_decoding_one_at_a_time(tiny_engine64, mode, policy):
    """Five tokens verified in one call read every key as five one-token calls would: the logits agree to
    summation order (float64), and after cropping two the cache holds what three one-token calls left."""
    eng = tiny_engine64
    ids = torch.randint(4, 260, (1, 37), generator=torch.Generator().manual_seed(3))
    prompt, drafts = ids[:, :30], ids[:, 30:35]
    one = eng.make_cache(policy, mode)
    spec = eng.make_cache(policy, mode)
    eng.enable_fused()
    _feed(eng.model, one, prompt)
    _feed(eng.model, spec, prompt)
    want = torch.stack([_feed(eng.model, one, drafts[:, i : i + 1])[-1] for i in range(5)])
    spec.activate_past_recording()
    got = _feed(eng.model, spec, drafts)
    assert (got - want).abs().max() < 1e-9
    if mode != "dense-shadow":
        assert sum(la.verify_calls for la in spec.layers) > 0  # the call needed per-query precision
    spec.crop(-2)
    ref = eng.make_cache(policy, mode)
    _feed(eng.model, ref, prompt)
    for i in range(3):
        _feed(eng.model, ref, drafts[:, i : i + 1])
    assert spec.get_seq_length() == ref.get_seq_length() == 33
    for a, b in zip(spec.layers, ref.layers):
        for sa, sb in ((a.k_store, b.k_store), (a.v_store, b.v_store)):
            assert (sa.n_packed, sa.tail.n, sa.head.n) == (sb.n_packed, sb.tail.n, sb.head.n)
            for name, t in sa.packed_view().items():  # the same codes (the rows agree to summation order)
                if t.dtype == torch.uint8:
                    assert torch.equal(t, sb.packed_view()[name])
            torch.testing.assert_close(sa.tail.view(), sb.tail.view(), rtol=0, atol=1e-10)
    assert spec.report().compressed_storage_bytes == ref.report().compressed_storage_bytes
    # and the next token reads the cropped cache as the reference
    nxt = drafts[:, 3:4]
    torch.testing.assert_close(_feed(eng.model, spec, nxt), _feed(eng.model, ref, nxt), rtol=0, atol=1e-9)


def _repetitive(seed, n=12):
    base = torch.randint(4, 260, (1, n), generator=torch.Generator().manual_seed(seed))
    return torch.cat([base, base, base[:, : n // 2]], 1)  # prompt lookup finds drafts in it


def _greedy(model, ids, cache, **kw):
    return model.generate(ids, max_new_tokens=32, do_sample=False, cache=cache, **kw)[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", POLICIES)
def test_prompt_lookup_and_assisted_generation_give_greedy_tokens_in_float64(tiny_engine64, mode, policy):
    eng = tiny_engine64
    eng.enable_fused()
    assistant = Engine.tiny(dtype=torch.float64, seed=7).model
    for seed in (0, 1):
        ids = _repetitive(seed)
        plain = _greedy(eng.model, ids, eng.make_cache(policy, mode))
        cache = eng.make_cache(policy, mode)
        assert _greedy(eng.model, ids, cache, prompt_lookup_num_tokens=4) == plain
        assert cache.is_croppable and cache.get_seq_length() == ids.shape[1] + len(plain) - 1
        # the prompt was found in transformers' first assisted call (it feeds the prompt and the first draft together)
        assert {la.prefill_end for la in cache.layers} == {ids.shape[1]}
        assert _greedy(eng.model, ids, eng.make_cache(policy, mode), assistant_model=assistant) == plain


@pytest.fixture(scope="module")
def sliding64():
    return Engine.tiny(dtype=torch.float64, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=10)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sliding", ["compress", "auto", "bypass"])  # bypass: transformers' own dense windows
def test_sliding_window_family_model_prompt_lookup_gives_greedy_tokens(sliding64, mode, sliding):
    eng = sliding64
    eng.enable_fused()
    policy = f"k=turbo3,v=turbo2,sink=2,recent=3,sliding={sliding}"
    ids = _repetitive(4)
    plain = _greedy(eng.model, ids, eng.make_cache(policy, mode))
    cache = eng.make_cache(policy, mode)
    assert _greedy(eng.model, ids, cache, prompt_lookup_num_tokens=3) == plain
    windowed = [la for la in cache.layers if isinstance(la, TQLayer) and la.window is not None]
    if sliding in ("compress", "auto"):  # window-bounded stores: about the window, never the whole context
        assert len(windowed) == 2 and all(la.k_store.n_tokens < 10 + 4 for la in windowed)
    else:
        assert not windowed


def test_beam_search_and_num_return_sequences_in_every_mode(tiny_engine64):
    """dense-shadow reads exact K/V: its beams equal DynamicCache's; the other modes read the same stored
    values (float64): their beams agree with each other. Sampled ``num_return_sequences`` likewise."""
    eng = tiny_engine64
    eng.enable_fused()
    ids = torch.randint(4, 260, (1, 24), generator=torch.Generator().manual_seed(5))
    beam = dict(max_new_tokens=12, num_beams=3, num_return_sequences=2, do_sample=False)
    sample = dict(max_new_tokens=12, do_sample=True, num_return_sequences=3, temperature=1.0)

    def run(cache, **kw):
        torch.manual_seed(0)
        return eng.model.generate(ids, cache=cache, **kw).tolist()

    for kw in (beam, sample):
        assert run(eng.make_cache("turbo3", "dense-shadow"), **kw) == run(DynamicCache(config=eng.config), **kw)
        outs = {mode: run(eng.make_cache("k=turbo3,v=turbo2,sink=2,recent=3", mode), **kw)
                for mode in ("simulate", "compressed", "fused")}
        assert outs["simulate"] == outs["compressed"] == outs["fused"]


def test_batch_repeat_interleave_and_select_keep_each_sequence_store(tiny_engine):
    cache = tiny_engine.make_cache("k=int4,v=turbo3,kblock=8,recent=2", "compressed")
    ids = torch.randint(4, 260, (2, 20), generator=torch.Generator().manual_seed(0))
    _feed(tiny_engine.model, cache, ids)
    layer = cache.layers[0]
    before = {k: v.clone() for k, v in layer.k_store.packed_view().items()}
    cache.batch_repeat_interleave(2)
    assert all(torch.equal(layer.k_store.packed_view()[k], v.repeat_interleave(2, 0)) for k, v in before.items())
    cache.batch_select_indices(torch.tensor([2, 0]))
    assert all(torch.equal(layer.k_store.packed_view()[k], v.flip(0)) for k, v in before.items())


def test_compressed_mode_speculation_without_tqbench_attention_says_what_to_do():
    eng = Engine.tiny()
    cache = TQCache("turbo4", eng.model.config, mode="compressed")
    ids = _repetitive(0)
    with pytest.raises(ValueError, match="needs tqbench's attention function .*install_fused_attention"):
        eng.model.generate(ids, max_new_tokens=4, do_sample=False, cache=cache, prompt_lookup_num_tokens=3)
    # dense-shadow needs nothing more
    out = eng.model.generate(ids, max_new_tokens=4, do_sample=False,
                             cache=TQCache("turbo4", eng.model.config, mode="dense-shadow"), prompt_lookup_num_tokens=3)
    assert out.shape[1] == ids.shape[1] + 4


@pytest.mark.parametrize("mode", MODES)
def test_engine_prompt_lookup_gives_greedy_tokens_and_the_same_cache(tiny_engine64, mode):
    eng = tiny_engine64
    ids = _repetitive(2)
    policy = "k=turbo3,v=turbo2,sink=2,recent=3"
    plain = eng.generate(ids, policy, mode, max_new_tokens=30, stop_at_eos=False)
    spec = eng.generate(ids, policy, mode, max_new_tokens=30, stop_at_eos=False, prompt_lookup=4)
    assert spec.token_ids == plain.token_ids and len(plain.token_ids) == 30
    # every token after the first was fed once: by a verification call or as an accepted draft
    stats = spec.speculation
    assert stats.drafted > 0 and stats.verify_calls + stats.accepted == 29
    assert spec.to_dict()["speculation"] == stats.to_dict() and "speculation" not in plain.to_dict()
    # the report is the one of the cache greedy decoding leaves (unverified drafts cropped at the end)
    assert spec.cache_report.tokens == plain.cache_report.tokens == ids.shape[1] + 29
    assert spec.cache_report.compressed_storage_bytes == plain.cache_report.compressed_storage_bytes


def test_engine_prompt_lookup_on_the_fp16_baseline_and_its_errors(tiny_engine64):
    eng = tiny_engine64
    ids = _repetitive(3)
    plain = eng.generate(ids, None, max_new_tokens=20, stop_at_eos=False)
    assert eng.generate(ids, None, max_new_tokens=20, stop_at_eos=False, prompt_lookup=3).token_ids == plain.token_ids
    from tqbench.engine.generate import Sampling

    with pytest.raises(ValueError, match="prompt_lookup needs greedy decoding"):
        eng.generate(ids, "turbo4", max_new_tokens=4, prompt_lookup=3, sampling=Sampling(temperature=0.7))


@pytest.mark.parametrize("impl", ["native", "torch"])
def test_fused_verification_is_exact_on_the_native_kernel_and_the_torch_reference(tiny_engine64, monkeypatch, impl):
    from tqbench.kernels.cpu import native_status

    if impl == "native" and not native_status()[0]:
        pytest.skip(f"no native kernel here: {native_status()[1]}")
    monkeypatch.setenv("TQBENCH_FUSED_IMPL", impl)
    eng = tiny_engine64
    eng.enable_fused()
    ids = torch.randint(4, 260, (1, 37), generator=torch.Generator().manual_seed(3))
    one, spec = eng.make_cache("turbo4", "fused"), eng.make_cache("turbo4", "fused")
    _feed(eng.model, one, ids[:, :30])
    _feed(eng.model, spec, ids[:, :30])
    want = torch.stack([_feed(eng.model, one, ids[:, 30 + i : 31 + i])[-1] for i in range(5)])
    spec.activate_past_recording()
    got = _feed(eng.model, spec, ids[:, 30:35])
    assert (got - want).abs().max() < 1e-9
    rep = spec.report()
    label = "native-cpu" if impl == "native" else "torch-reference (TQBENCH_FUSED_IMPL=torch)"
    assert rep.fused_impl == {label: 4} and rep.fallbacks == {}


def test_fused_verification_through_the_triton_kernels_matches_the_reference(tiny_engine, monkeypatch):
    """The Triton path (interpreter here) reads a verification call's column sets too: same logits as the
    torch reference (fp32, to summation order)."""
    from tqbench.kernels import triton_status

    if not triton_status()[0]:
        pytest.skip(triton_status()[1])
    ids = torch.randint(4, 260, (1, 35), generator=torch.Generator().manual_seed(3))
    logits = {}
    for impl in ("torch", "triton"):
        monkeypatch.setenv("TQBENCH_FUSED_IMPL", impl)
        cache = tiny_engine.make_cache("turbo4", "fused")
        _feed(tiny_engine.model, cache, ids[:, :30])
        cache.activate_past_recording()
        logits[impl] = _feed(tiny_engine.model, cache, ids[:, 30:35])
        assert sum(la.verify_calls for la in cache.layers) == 4
    assert list(cache.report().fused_impl) == ["triton"]
    torch.testing.assert_close(logits["triton"], logits["torch"], rtol=0, atol=1e-4)


def test_the_speculative_benchmark_runs_on_the_tiny_model(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "spec.json"
    cmd = [sys.executable, str(root / "benchmarks" / "speculative.py"), "--model", "tiny", "--new-tokens", "6",
           "--policies", "turbo4", "--modes", "fused", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["model"] == "tiny-random" and data["threads"] == 1 and len(data["load_average"]) == 3
    assert [(r["policy"], r["mode"], r["prompt"]) for r in data["rows"]] == [
        ("turbo4", "fused", p) for p in ("code", "list", "quote")]
    for row in data["rows"]:  # fp32 on the tiny model: agreement is measured, not assumed
        assert 0 <= row["token_match"] <= 1 and row["exact"] == (row["first_divergence"] is None)
        assert row["verify_calls"] + row["accepted"] == 5 and row["decode_time_ratio"] > 0
