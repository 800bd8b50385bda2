"""One budget over tokens and bits (issue 32, part 4): the tokens axis of ``allocate`` (a keep fraction per layer
beside the codecs), measured as the cache evicts, solved within exact bytes, refused when asked wrongly."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from tqbench.engine.allocate import allocate_policy
from tqbench.engine.allocate.chunk import ChunkRunner
from tqbench.engine.allocate.keeps import KeepCells, _through, parse_axes, parse_keeps
from tqbench.engine.cache import TQCache
from tqbench.engine.cache.estimate import KVGeometry, estimate_kv
from tqbench.engine.policy import parse_policy
from tqbench.engine.request import RequestError

SMALL = dict(calib_prefill=48, calib_steps=8, verify_prefill=48, verify_steps=6, context=96,
             base="sink=2,recent=4,window=4", protections=[], max_measurements=2)


def test_keep_cell_is_what_the_evicting_cache_reads(tiny_engine64):
    """The masked chunk forward equals a real compressed cache that evicted at the end of its prefill (SnapKV,
    per KV head) and then decoded the chunk one token at a time, in float64."""
    eng = tiny_engine64
    ids = torch.randint(3, 200, (1, 56), generator=torch.Generator().manual_seed(1))
    runner = ChunkRunner(eng, ids, 48)
    cells = KeepCells(runner, "snapkv", 4)
    policy = "fp16,sink=2,recent=4,window=4,keep@1=0.5"
    idx = cells.index(1, 0.5, 2, 4)
    assert idx.shape[2] == 2 + 4 + 21  # sinks + protected tail + floor(0.5 * 42)
    with torch.inference_mode():
        with _through(runner.model, masks={1: cells.mask(idx)}):
            masked = runner.logprobs(list(runner.keys), list(runner.values), start=1)
        eng.enable_fused()
        cache = TQCache(policy, eng.model.config, mode="compressed")
        eng.model(ids[:, :48], cache=cache)
        real = []
        for t in range(48, 56):
            out = eng.model(ids[:, t:t + 1], cache=cache)
            real.append(torch.log_softmax(out.logits[:, -1].double(), -1))
    real = torch.stack(real, dim=1)
    assert cache.report().layers[1].tokens == 27 + 8
    assert (masked - real).abs().max().item() < 1e-9
    assert cells.cell(1, 0.5, 2, 4) > 1e-6  # eviction changes the output: a real cost


def test_a_budget_only_eviction_reaches_picks_keep_below_one(tiny_engine):
    """turbo4 alone needs > 4 bits/element: 3.5 is reachable only by keeping fewer rows."""
    rep = allocate_policy(tiny_engine, 3.5, axes="bits,tokens", codecs=["turbo4"], k_codecs=["turbo4"], **SMALL)
    pol = rep.allocation.policy
    g = KVGeometry.from_config(tiny_engine.model.config)
    keeps = [p.keep for p in pol.plan(g.num_layers) if p.evicts]
    assert keeps and all(0 < k < 1 for k in keeps)
    assert rep.allocation.bits_per_element <= 3.5
    n_units = 4 * 2  # tiny: 4 layers x K/V, one codec each; + 3 keep cells per layer
    assert (rep.measured_cells, rep.resumed_cells) == (n_units + 4 * 3, 0)
    assert rep.axes["saved_by_eviction"] > 0 and rep.axes["saved_by_codecs"] > 0
    assert sum(r["saved_by_eviction"] for r in rep.axes["per_layer"]) == rep.axes["saved_by_eviction"]
    # the exact bytes: the estimate is the cache report after a real prefill of the stated context, to the byte
    est = estimate_kv(pol, g, 96)
    assert est.total_bytes == rep.allocation.estimate.total_bytes
    tiny_engine.enable_fused()
    cache = TQCache(pol, tiny_engine.model.config, mode="compressed")
    with torch.inference_mode():
        tiny_engine.model(torch.randint(3, 200, (1, 96)), cache=cache)
    report = cache.report()
    assert report.compressed_storage_bytes == est.total_bytes
    assert [r.total_bytes for r in report.layers] == est.layer_bytes
    assert rep.verified.bits_per_element == pytest.approx(est.bits_per_element)
    with pytest.raises(ValueError, match="out of range"):
        allocate_policy(tiny_engine, 3.5, axes="bits", codecs=["turbo4"], k_codecs=["turbo4"], **SMALL)


def test_tokens_alone_keeps_fp16_rows_and_bits_alone_never_evicts(tiny_engine):
    rep = allocate_policy(tiny_engine, 8.0, axes="tokens", **SMALL)
    pol = rep.allocation.policy
    assert set(rep.allocation.k) == set(rep.allocation.v) == {"fp16"} and pol.evicts
    assert rep.axes["saved_by_codecs"] == 0 and rep.allocation.bits_per_element <= 8.0
    plain = allocate_policy(tiny_engine, 4.5, codecs=["turbo1", "turbo4"], **SMALL)
    assert not plain.allocation.policy.evicts and plain.axes is None


@pytest.mark.parametrize("value, msg", [("bits,heads", "unknown axis 'heads'"), ("", "no axis")])
def test_bad_axes_are_refused(value, msg):
    with pytest.raises(RequestError, match=msg):
        parse_axes(value)


def test_bad_keeps_and_a_keep_in_the_base_are_refused(tiny_engine):
    assert parse_keeps("0.5,0.25") == (1.0, 0.5, 0.25)
    with pytest.raises(RequestError, match="not a fraction"):
        parse_keeps("1.5")
    with pytest.raises(RequestError, match="keep values are the allocation's"):
        allocate_policy(tiny_engine, 3.0, axes="bits,tokens", **(SMALL | {"base": "keep=0.5"}))
    with pytest.raises(RequestError, match="h2o"):
        allocate_policy(tiny_engine, 3.0, axes="bits,tokens", **(SMALL | {"base": "score=h2o"}))
    with pytest.raises(RequestError, match="no term for evicted rows"):
        allocate_policy(tiny_engine, 3.0, axes="tokens", min_speed=1.1, **SMALL)


def test_cli_refuses_a_bad_axis_before_loading_a_model():
    from tqbench.cli import main

    res = CliRunner().invoke(main, ["--headless", "allocate", "--budget", "3", "--axes", "bits,heads"])
    assert res.exit_code == 2
    assert "--axes='bits,heads' is invalid: unknown axis 'heads'" in res.output
    assert parse_policy("turbo4,keep@1=0.5").evicts
