"""The demote tier on allocate's tokens axis: per layer, evicted rows dropped or kept at a cheaper codec
(``demote@LAYERS=codec``), the cell measured as the cache attends the tier, solved within exact bytes."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from tests.unit.cache_helpers import prefill_then_steps
from tqbench.engine.allocate import allocate_policy
from tqbench.engine.allocate.chunk import ChunkRunner
from tqbench.engine.allocate.demote import DemoteTier, parse_demote_codecs, tier_options
from tqbench.engine.allocate.exchange import JointMeasure
from tqbench.engine.allocate.joint import axis_split, solve_joint
from tqbench.engine.allocate.keeps import KeepCells
from tqbench.engine.cache import TQCache
from tqbench.engine.cache.estimate import KVGeometry, estimate_kv
from tqbench.engine.policy import parse_policy
from tqbench.engine.policy.artifact import load_policy_artifact, save_policy_artifact
from tqbench.engine.policy.files import policy_from_dict
from tqbench.engine.request import RequestError

SMALL = dict(calib_prefill=48, calib_steps=8, verify_prefill=48, verify_steps=6, context=96,
             base="sink=2,recent=4,window=4", protections=[], max_measurements=2)


def test_demote_override_per_layer_plans_and_counts_to_the_byte(tiny_engine):
    pol = parse_policy("turbo4,keep=0.5,demote=turbo2,demote@1=none,demote@2-3=turbo1")
    assert [(p.keep, p.demote) for p in pol.plan(4)] == [(0.5, "turbo2"), (0.5, ""), (0.5, "turbo1"),
                                                         (0.5, "turbo1")]
    assert parse_policy(pol.to_string()) == pol and policy_from_dict(pol.to_dict()) == pol
    assert parse_policy("turbo4,keep@0=0.5,demote@0-1=turbo2").plan(2)[1].demote == ""  # layer 1 evicts nothing
    model = tiny_engine.model
    tiny_engine.enable_fused()
    cache = TQCache(pol, model.config, mode="compressed")
    prefill_then_steps(model, cache, 100, steps=4)
    rep = cache.report()
    est = estimate_kv(pol, KVGeometry.from_config(model.config), 100, prefill=96)
    assert [r.total_bytes for r in rep.layers] == est.layer_bytes and rep.compressed_storage_bytes == est.total_bytes
    assert [r.demoted_tokens > 0 for r in rep.layers] == [True, False, True, True]
    assert "the evicted rows kept at turbo1 (demote, 2 layers)" in " ".join(rep.notes)
    g = KVGeometry.from_config(model.config)
    split = axis_split(pol, g, 100)  # the tier's bytes: the estimate with it less without, per layer
    dropped = estimate_kv(parse_policy("turbo4,keep=0.5"), g, 100)
    assert [r["demoted_bytes"] for r in split["per_layer"]] == [
        a - b for a, b in zip(estimate_kv(pol, g, 100).layer_bytes, dropped.layer_bytes)]
    assert [r["demote"] for r in split["per_layer"]] == ["turbo2", None, "turbo1", "turbo1"]


@pytest.mark.parametrize("text, msg", [
    ("turbo4,demote@1=turbo2", "demote@1=turbo2 keeps the evicted rows at a cheaper codec, but this policy evicts"),
    ("turbo4,keep=0.5,demote@1=pcaq2", "demote@1='pcaq2' is invalid: use one codec for K and V"),
])
def test_bad_demote_overrides_are_refused(text, msg):
    with pytest.raises(ValueError, match=msg):
        parse_policy(text)


def test_demote_cell_is_what_the_demoting_cache_reads(tiny_engine64):
    """The evicted rows quantized at the demote codec and attended (no mask) equal a real compressed cache that
    evicted at the end of its prefill, kept those rows at turbo2, then decoded the chunk token by token (float64)."""
    eng = tiny_engine64
    ids = torch.randint(3, 200, (1, 56), generator=torch.Generator().manual_seed(1))
    runner = ChunkRunner(eng, ids, 48)
    cells = KeepCells(runner, "snapkv", 4)
    tier = DemoteTier(cells)
    base = parse_policy("fp16,sink=2,recent=4,window=4")
    ks, vs = list(runner.keys), list(runner.values)
    ks[1] = tier.rows(base, "k", 1, 0.5, "turbo2", ks[1])
    vs[1] = tier.rows(base, "v", 1, 0.5, "turbo2", vs[1])
    demoted = runner.logprobs(ks, vs, start=1)
    with torch.inference_mode():
        eng.enable_fused()
        cache = TQCache("fp16,sink=2,recent=4,window=4,keep@1=0.5,demote@1=turbo2", eng.model.config,
                        mode="compressed")
        eng.model(ids[:, :48], cache=cache)
        real = []
        for t in range(48, 56):
            out = eng.model(ids[:, t:t + 1], cache=cache)
            real.append(torch.log_softmax(out.logits[:, -1].double(), -1))
    real = torch.stack(real, dim=1)
    assert cache.report().layers[1].demoted_tokens == 48 - 27
    assert (demoted - real).abs().max().item() < 1e-9
    cell, dropped = tier.cell(base, 1, 0.5, "turbo2"), cells.cell(1, 0.5, 2, 4)
    assert cell > 1e-9 and abs(cell - dropped) > 1e-6  # measured, not the dropped cell's KL nor zero
    # a joint measurement of the same policy reads the same tier (the kept rows at fp16: exact)
    joint = JointMeasure(runner, keeps=cells, tier=tier)
    pol = parse_policy("fp16,sink=2,recent=4,window=4,keep@1=0.5,demote@1=turbo2")
    assert joint({(1, "k"): "fp16", (1, "v"): "fp16"}, pol) == pytest.approx(cell, rel=1e-9)


@pytest.fixture(scope="module")
def demoted(tiny_engine, tmp_path_factory):
    """turbo4 alone at 3.8 bits/element: evicting is needed; the tier turbo2/turbo1 is offered."""
    return allocate_policy(tiny_engine, 3.8, axes="bits,tokens", codecs=["turbo4"], k_codecs=["turbo4"],
                           demote_codecs="turbo2,turbo1", **SMALL,
                           partial_path=str(tmp_path_factory.mktemp("demote") / "p.partial.json"))


def test_allocate_demotes_where_it_costs_less_and_the_bytes_are_exact(tiny_engine, demoted, tmp_path):
    rep = demoted
    pol = rep.allocation.policy
    g = KVGeometry.from_config(tiny_engine.model.config)
    tiers = {p.layer: p.demote for p in pol.plan(g.num_layers) if p.demote}
    assert tiers and set(tiers.values()) <= {"turbo2", "turbo1"} and "demote@" in pol.to_string()
    n_keep = 4 * 3
    assert rep.measured_cells == 4 * 2 + n_keep + n_keep * 2 and len(rep.axes["demote_cells"]) == n_keep * 2
    split = axis_split(pol, g, 96)
    assert rep.axes["demoted_bytes"] == split["demoted_bytes"] > 0
    assert {r["layer"] for r in rep.axes["per_layer"] if r["demoted_bytes"]} == set(tiers)
    # the policy round-trips (text, dict, the saved artifact) and its estimate is a real cache's report, to the byte
    assert parse_policy(pol.to_string()) == pol and policy_from_dict(pol.to_dict()) == pol
    path = save_policy_artifact(rep.to_artifact(g), tmp_path / "d.toml")
    assert load_policy_artifact(path).policy == pol and load_policy_artifact(path).allocation["axes"]["demotes"] == [
        "turbo2", "turbo1"]
    est = estimate_kv(pol, g, 96)
    assert est.total_bytes == rep.allocation.estimate.total_bytes and rep.allocation.bits_per_element <= 3.8
    tiny_engine.enable_fused()
    cache = TQCache(pol, tiny_engine.model.config, mode="compressed")
    with torch.inference_mode():
        tiny_engine.model(torch.randint(3, 200, (1, 96)), cache=cache)
    report = cache.report()
    assert [r.total_bytes for r in report.layers] == est.layer_bytes
    assert report.compressed_storage_bytes == est.total_bytes
    assert [r.demoted_tokens > 0 for r in report.layers] == [layer in tiers for layer in range(g.num_layers)]
    assert rep.verified.bits_per_element == pytest.approx(est.bits_per_element)


def test_the_solve_picks_the_tier_only_when_it_costs_less_kl(tiny_engine, demoted):
    """Same table and bytes: a tier that measures no better than dropping is never bought; one that measures
    far better is, wherever it fits."""
    rep, g = demoted, tiny_engine.geometry
    keep_kl = {(int(k.split("/")[0]), float(k.split("/")[1])): v for k, v in rep.axes["keep_cells"].items()}
    base = parse_policy(SMALL["base"])
    keeps = (1.0, 0.75, 0.5, 0.25)

    def solve(demote_kl):
        tiers = tier_options(keep_kl, demote_kl, ("turbo2",), g, 96)
        return solve_joint(rep.table, keep_kl, keeps, g, 3.8, 96, base, tiers=tiers,
                           tier_specs={("k", "turbo2"), ("v", "turbo2")}).policy

    worse = solve({(layer, f, "turbo2"): kl for (layer, f), kl in keep_kl.items()})
    assert not any(p.demote for p in worse.plan(g.num_layers))
    better = solve({(layer, f, "turbo2"): 0.0 for (layer, f) in keep_kl})
    assert any(p.demote == "turbo2" for p in better.plan(g.num_layers))
    assert estimate_kv(better, g, 96).bits_per_element <= 3.8


def test_bad_demote_codecs_are_refused(tiny_engine):
    assert parse_demote_codecs("none") == () and parse_demote_codecs("turbo2, turbo1") == ("turbo2", "turbo1")
    for value, msg in [("turbo9", "unknown V codec 'turbo9'"), ("pcaq2", "use one codec for K and V"),
                       ("none,turbo2", "none means no demote tier")]:
        with pytest.raises(RequestError, match=msg):
            parse_demote_codecs(value)
    with pytest.raises(RequestError, match="search the tokens axis too"):
        allocate_policy(tiny_engine, 3.0, axes="bits", demote_codecs="turbo2", **SMALL)


@pytest.mark.parametrize("args, msg", [
    (["--axes", "bits,tokens", "--demote-codecs", "turbo9"], "--demote-codecs='turbo9' is invalid: demote='turbo9' "
                                                             "is invalid: unknown V codec 'turbo9'"),
    (["--demote-codecs", "turbo2"], "--demote-codecs='turbo2' is invalid: the demote tier keeps a layer's evicted "
                                    "rows: search the tokens axis too"),
    # a tier not cheaper than the rows it replaces (issue 42: fp32 measured and emitted): the policy's own rule
    (["--axes", "bits,tokens", "--demote-codecs", "fp32"], "demote=fp32 is not cheaper than the rows it replaces"),
    (["--axes", "bits,tokens", "--codecs", "turbo2,turbo4", "--demote-codecs", "turbo1,turbo2"],
     "demote=turbo2 is not cheaper than the rows it replaces (kv=turbo2: 2 bits per element)"),
])
def test_cli_refuses_bad_demote_codecs_before_loading_a_model(args, msg):
    from tqbench.cli import main

    res = CliRunner().invoke(main, ["--headless", "allocate", "--budget", "3", *args])
    assert res.exit_code == 2
    assert msg in res.output and len(res.output.strip().splitlines()) == 1


def test_the_tier_with_per_head_keeps_is_refused_before_a_model_loads():
    from tqbench.engine.allocate.demote import check_demote_codecs

    with pytest.raises(RequestError, match="the demote tier is searched per layer"):
        check_demote_codecs("turbo2", ("bits", "tokens"), "head")
    assert check_demote_codecs("turbo2,turbo1", ("bits", "tokens")) == ("turbo2", "turbo1")
    assert check_demote_codecs("none", ("bits",), "head") == ()
    kept = (["turbo3", "turbo4"], ["turbo2", "turbo4"])  # the cheapest row the search can keep: 3 + 2 bits
    assert check_demote_codecs("turbo2", ("bits", "tokens"), kept=kept) == ("turbo2",)
    with pytest.raises(RequestError, match="demote=turbo3 is not cheaper .* the search keeps rows at turbo3, turbo4, "
                                           "turbo2"):
        check_demote_codecs("turbo3", ("bits", "tokens"), kept=kept)
