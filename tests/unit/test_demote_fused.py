"""The demote tier (``keep=... ,demote=CODEC``) in the fused mode: the native kernel attends the evicted rows at
their own codec in the same call and softmax as the held rows (``merge_into``), the torch reference reads them
too, and every mode gives the same logits; bytes are the estimate's; the kernel's tier contract."""

import pytest
import torch

from tests.unit.cache_helpers import prefill_then_steps
from tests.unit.families.short_windows import SHORT_WINDOW, short_window_model
from tqbench.engine.cache import TQCache
from tqbench.engine.cache.estimate import KVGeometry, estimate_kv
from tqbench.kernels.cpu import native_module
from tqbench.kernels.cpu.attention import kernel_side, native_attention_batch

PROMPT = "the quick brown fox jumps over the lazy dog and keeps running far away " * 3


def _logits(engine, ids, policy: str, mode: str, steps: int = 6) -> tuple[torch.Tensor, object]:
    """Prefill ``ids``, then ``steps`` single-token calls: the logits of every decode step and the cache."""
    engine.enable_fused()
    cache = engine.make_cache(policy, mode)
    with torch.inference_mode():
        engine.model(ids, cache=cache)
        out = torch.cat([engine.model(torch.tensor([[7 + i]]), cache=cache).logits for i in range(steps)])
    return out, cache


@pytest.mark.parametrize("policy", ["turbo4,keep=0.3,score=tova,every=3,window=4,demote=turbo2",
                                    "k=turbo4,v=turbo3,keep=0.4,window=4,every=4,demote=turbo1",
                                    "k=turbo3,v=turbo4,keep=20rows,window=4,demote=turbo2"])
def test_fused_reads_the_tier_natively_and_matches_compressed(tiny_engine, policy):
    ids = tiny_engine.encode_prompt(PROMPT, chat=False)
    want, _ = _logits(tiny_engine, ids, policy, "compressed")
    got, cache = _logits(tiny_engine, ids, policy, "fused")
    assert (got - want).abs().max() < 2e-5  # float32: the same softmax, summed in another order
    assert all(la.evictor.n_demoted > 0 and la.fused_impl == {"native-cpu": 6} for la in cache.layers)
    dropped, _ = _logits(tiny_engine, ids, policy.split(",demote")[0], "fused")
    assert (dropped - want).abs().max() > 1e-2  # (the tier is read: without it the logits move)


def test_float64_tokens_agree_in_every_mode(tiny_engine64):
    ids = tiny_engine64.encode_prompt(PROMPT, chat=False)
    pol = "turbo4,keep=0.3,score=snapkv,every=3,window=4,demote=turbo2"
    runs = {m: tiny_engine64.generate(ids, pol, m, max_new_tokens=12, stop_at_eos=False)
            for m in ("compressed", "simulate", "fused")}
    assert runs["fused"].token_ids == runs["compressed"].token_ids == runs["simulate"].token_ids
    rep = runs["fused"].cache_report
    assert rep.fused_impl == {"native-cpu": rep.fused_calls}
    assert rep.compressed_storage_bytes == runs["compressed"].cache_report.compressed_storage_bytes
    assert all(r.demoted_tokens == r.evicted_prefill + r.evicted_decode > 0 for r in rep.layers)


def test_torch_reference_reads_the_tier(tiny_engine, monkeypatch):
    ids = tiny_engine.encode_prompt(PROMPT, chat=False)
    pol = "turbo4,keep=0.5,score=tova,every=2,window=4,demote=turbo2"
    native, _ = _logits(tiny_engine, ids, pol, "fused")
    monkeypatch.setenv("TQBENCH_FUSED_IMPL", "torch")
    ref, cache = _logits(tiny_engine, ids, pol, "fused")
    assert (ref - native).abs().max() < 2e-5
    assert all(la.fused_impl == {"torch-reference (TQBENCH_FUSED_IMPL=torch)": 6} for la in cache.layers)


def test_fused_bytes_are_the_estimate(tiny_engine):
    pol = "turbo4,keep=0.3,score=tova,every=4,window=4,demote=turbo2"
    cache = TQCache(pol, tiny_engine.model.config, mode="fused")
    tiny_engine.enable_fused()
    prefill_then_steps(tiny_engine.model, cache, 100, steps=10)
    rep = cache.report()
    est = estimate_kv(pol, KVGeometry.from_config(tiny_engine.model.config), 100, prefill=90)
    assert rep.compressed_storage_bytes == est.total_bytes and [r.total_bytes for r in rep.layers] == est.layer_bytes
    assert all(r.demoted_tokens == r.evicted_prefill + r.evicted_decode > 0 for r in rep.layers)


@pytest.mark.parametrize("family,evicting", [("gemma3_text", [1, 3]), ("gpt_oss", [1, 3])])
def test_sliding_families_past_their_window(family, evicting):
    """Mixed sliding/full models (gpt-oss: sink logits in the softmax) at 40 + 6 tokens, windows of 8: the full
    layers evict and demote, the sliding layers slide; fused gives compressed's tokens, natively, to the byte."""
    from tqbench.engine import Engine

    eng = Engine(short_window_model(family, dtype=torch.float64))
    ids = torch.randint(5, 300, (1, 40), generator=torch.Generator().manual_seed(0))
    assert ids.shape[1] > 4 * SHORT_WINDOW
    pol = "turbo4,keep=0.5,window=4,recent=4,sink=2,every=3,demote=turbo2"
    runs = {m: eng.generate(ids, pol, m, max_new_tokens=6, stop_at_eos=False, prefill_chunk=0)
            for m in ("compressed", "fused")}
    assert runs["compressed"].token_ids == runs["fused"].token_ids
    rep = runs["fused"].cache_report
    assert set(rep.fused_impl) == {"native-cpu"}
    assert [r.layer for r in rep.layers if r.demoted_tokens] == evicting
    assert rep.compressed_storage_bytes == estimate_kv(pol, eng.geometry, 45, prefill=40).total_bytes
    drop = eng.generate(ids, pol.split(",demote")[0], "fused", max_new_tokens=6, stop_at_eos=False, prefill_chunk=0)
    assert drop.cache_report.compressed_storage_bytes < rep.compressed_storage_bytes


# -- the kernel's tier contract ----------------------------------------------------------------------------------
def _rows(*shape):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(sum(shape)))


@pytest.mark.parametrize("L,masked", [(1, False), (3, False), (3, True)])
def test_a_tier_is_one_softmax_with_its_store(L, masked):
    """Store A (20 rows) with tier T (7 rows) attended by the same queries == one store of T's rows then A's: the
    tier's rows precede the causal rows (no mask: all visible), and a mask's columns split the same way."""
    dt, B, H, Hq, D = torch.float64, 2, 2, 4, 16
    q = _rows(B, Hq, L, D)
    ka, va, kt, vt = _rows(B, H, 20, D), _rows(B, H, 20, D + 1)[..., :D].contiguous(), _rows(B, H, 7, D), \
        _rows(B, H, 7, D + 2)[..., :D].contiguous()
    mask = None
    if masked:
        mask = torch.rand(B, L, 27, generator=torch.Generator().manual_seed(3)) > 0.3
        mask[..., -1] = True

    def side(rows):
        return kernel_side(None, [rows], 0, D, dt)[0]

    want, _ = native_attention_batch(q, [side(torch.cat([kt, ka], 2))], [side(torch.cat([vt, va], 2))], 0.25,
                                     masks=[mask])
    masks = [None, None] if mask is None else [mask[..., 7:], mask[..., :7]]
    got, call = native_attention_batch(q, [side(ka), side(kt)], [side(va), side(vt)], 0.25, masks=masks,
                                       merge_into=[-1, 0])
    assert torch.allclose(got, want, atol=1e-12, rtol=0)
    assert len(call.weighted_per_sequence) == B  # (per query row: a tier's rows count with its owner's)


def test_tier_arguments_are_checked_by_name():
    dt, D = torch.float64, 16
    q = _rows(1, 2, 1, D)

    def side(n, b=1):
        return kernel_side(None, [_rows(b, 2, n, D)], 0, D, dt)[0]

    mod = native_module()
    with pytest.raises(RuntimeError, match=r"merge_into has 1 entries: give one per store \(2 here"):
        mod.attend(q, 0.1, [side(5), side(3)], [side(5), side(3)], [], 0.0, None, 0.0, [-1])
    with pytest.raises(RuntimeError, match=r"merge_into\[0\] names store 1, itself a tier of store 0"):
        mod.attend(q, 0.1, [side(5), side(3)], [side(5), side(3)], [], 0.0, None, 0.0, [1, 0])
    with pytest.raises(RuntimeError, match=r"merge_into\[1\]: store 1 has batch 2, store 0 has 1"):
        mod.attend(q, 0.1, [side(5), side(3, 2)], [side(5), side(3, 2)], [], 0.0, None, 0.0, [-1, 0])
    with pytest.raises(RuntimeError, match=r"merge_into\[2\] names store 0, which store 1 is already a tier of"):
        mod.attend(q, 0.1, [side(5), side(3), side(2)], [side(5), side(3), side(2)], [], 0.0, None, 0.0, [-1, 0, 0])


def test_validate_fused_says_the_tier_ran_natively():
    from click.testing import CliRunner

    from tqbench.cli import main

    r = CliRunner().invoke(main, ["--headless", "validate", "--model", "tiny", "--candidate",
                                  "turbo4,keep=0.5,score=snapkv,demote=turbo2", "--cache-mode", "fused",
                                  "--max-new-tokens", "4", "--threads", "1"])
    assert r.exit_code in (0, 1), r.output  # (1: the random model fails the gate)
    assert "native-cpu:" in r.output and "torch-reference" not in r.output
    assert "the evicted rows kept at turbo2 (demote)" in r.output


def test_per_head_layer_with_a_tier_is_one_native_call(tiny_engine, monkeypatch):
    from tqbench.engine.cache.evict.compact import EvictionError

    ids = tiny_engine.encode_prompt(PROMPT, chat=False)
    pol = "k=turbo4|turbo2,v=turbo3|turbo2,keep=0.4,score=tova,window=4,demote=turbo1"
    want, _ = _logits(tiny_engine, ids, pol, "compressed")
    got, cache = _logits(tiny_engine, ids, pol, "fused")
    assert (got - want).abs().max() < 2e-5
    la = cache.layers[0]
    assert la.fused_impl == {"native-cpu": 6} and all(g == {"native-cpu": 6} for g in la.fused_groups.values())
    monkeypatch.setenv("TQBENCH_FUSED_IMPL", "torch")
    with pytest.raises(EvictionError, match="demote=turbo1 on a layer with per-head codecs runs only in the native "
                                            "CPU kernel .*here: TQBENCH_FUSED_IMPL=torch: use cache mode compressed"):
        _logits(tiny_engine, ids, pol, "fused")
