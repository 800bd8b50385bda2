"""The allocator that knows decode speed (engine/allocate/speed.py): the cost table, the predicted speed, the
min_speed constraint in the solve and the exchange steps, the report, the CLI flag. Fixed cost tables throughout
(nothing here depends on how fast this machine is), except where a test only checks a measured table's shape."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tqbench.engine.allocate import SensitivityTable, allocate_policy, solve_allocation
from tqbench.engine.allocate.budget import resolve_min_speed
from tqbench.engine.allocate.exchange import improve
from tqbench.engine.allocate.speed import (
    DecodeCosts,
    SpeedConstraint,
    SpeedModel,
    SpeedUnreachable,
    cached_costs,
    measure_costs,
    speed_constraint,
)
from tqbench.engine.cache.estimate import KVGeometry
from tqbench.engine.policy import parse_policy
from tqbench.engine.request import RequestError

CODECS = ["turbo1", "turbo2", "turbo4"]
GEO = KVGeometry(4, 2, 64)
BASE = parse_policy("sink=4,recent=16")
CONTEXT = 2048


def _costs(kv_heads: int = 2, mixed: float = 0.0) -> DecodeCosts:
    """turbo4 the slowest to attend, turbo1 the fastest; a 4-layer model whose dense step is 10 ms."""
    row = {"turbo1": 0.4e-3, "turbo2": 0.6e-3, "turbo4": 1.0e-3, "fp16": 0.5e-3}
    return DecodeCosts(CONTEXT, kv_heads, {"k": dict(row), "v": dict(row)}, mixed, dense_step=10e-3,
                       reference_step=11e-3)


def _table(heads: bool = False) -> SensitivityTable:
    """KL that rewards bits everywhere (turbo4 is always the least-KL choice)."""
    t = SensitivityTable(list(range(GEO.num_layers)), list(CODECS), heads=[0, 1] if heads else None)
    for u in t.units():
        scale = 1.0 + u[0] + (0.5 if u[1] == "k" else 0.0)
        t.kl[u] = {"turbo1": 0.5 * scale, "turbo2": 0.1 * scale, "turbo4": 0.01 * scale}
    return t


def _all(table: SensitivityTable, codec: str) -> dict:
    return {u: codec for u in table.units()}


def test_cost_table_has_one_positive_entry_per_choice(tiny_engine):
    choices = {"k": ["turbo1", "turbo2", "turbo4"], "v": ["turbo2", "turbo4"]}
    costs = measure_costs(tiny_engine, 64, parse_policy("sink=2,recent=4"), choices, 0, repeats=2, steps=1)
    for role, cs in choices.items():
        assert set(costs.layer[role]) == {*cs, "fp16"}  # each choice, the reference and fp16, once
        assert all(t > 0 for t in costs.layer[role].values())
    assert costs.dense_step > 0 and costs.reference_step > 0 and costs.mixed >= 0
    assert set(costs.per_row()["k"]) == set(costs.layer["k"]) and costs.kv_heads == tiny_engine.geometry.kv_heads


def test_prediction_of_the_reference_is_its_measured_ratio_and_cheaper_codecs_are_faster():
    table = _table()
    model = SpeedModel(_costs(), table.layers)
    assert model.ratio(_all(table, "turbo4")) == pytest.approx(10 / 11)
    assert model.reference_ratio() == pytest.approx(10 / 11)
    # all turbo1: 4 layers x 2 roles x 0.6 ms less than turbo4
    assert model.step_seconds(_all(table, "turbo1")) == pytest.approx(11e-3 - 8 * 0.6e-3)
    assert model.ratio(_all(table, "turbo1")) > model.ratio(_all(table, "turbo2")) > model.ratio(_all(table, "turbo4"))


def test_a_layer_whose_heads_mix_codecs_pays_the_mixed_overhead():
    table = _table(heads=True)
    model = SpeedModel(_costs(mixed=0.3e-3), table.layers)
    uniform = _all(table, "turbo4")
    mixed = {**uniform, (0, "k", 0): "turbo2"}  # layer 0's K heads differ
    assert model.step_seconds(mixed) == pytest.approx(11e-3 - 0.4e-3 / 2 + 0.3e-3)
    both = {**mixed, (0, "k", 1): "turbo2"}  # uniform again: no overhead
    assert model.step_seconds(both) == pytest.approx(11e-3 - 0.4e-3)
    crossed = {**mixed, (0, "v", 1): "turbo2"}  # (turbo2, turbo4) and (turbo4, turbo2): still two groups
    assert model.step_seconds(crossed) == pytest.approx(11e-3 - 0.4e-3 + 0.3e-3)


def test_every_group_past_two_costs_its_own_overhead():
    costs = DecodeCosts(CONTEXT, 3, _costs().layer, 0.3e-3, 10e-3, 11e-3, mixed_extra_group=0.1e-3)
    model = SpeedModel(costs, [0])
    base = {(0, r, h): "turbo4" for r in "kv" for h in range(3)}
    three = {**base, (0, "k", 0): "turbo1", (0, "k", 1): "turbo2"}
    assert model.step_seconds(three) - model.step_seconds(base) == pytest.approx(
        (0.4e-3 - 1.0e-3 + 0.6e-3 - 1.0e-3) / 3 + 0.3e-3 + 0.1e-3)
    assert costs.group_overhead(1) == 0 and DecodeCosts.from_dict(costs.to_dict()) == costs


def test_default_min_speed_is_uniform_turbo4s_predicted_ratio(tiny_engine):
    assert resolve_min_speed(None) == (None, "none")
    assert resolve_min_speed("turbo4") == (None, "reference")
    assert resolve_min_speed("0.8") == (0.8, "given")
    table = SensitivityTable([0, 1], list(CODECS))
    constraint, cached = speed_constraint(tiny_engine, table, BASE, CONTEXT, "turbo4", _costs())
    assert not cached and constraint.source == "reference"
    assert constraint.min_ratio == pytest.approx(constraint.model.ratio({(layer, r): "turbo4" for layer in (0, 1)
                                                                         for r in "kv"}))
    assert constraint.min_ratio == pytest.approx(10 / 11)


@pytest.mark.parametrize("value", [0, -1, "0", "fast", float("nan"), float("inf")])
def test_min_speed_must_be_a_positive_ratio(value):
    with pytest.raises(RequestError, match="min_speed=.* is invalid: give a ratio of decode tokens/s to a dense cache "
                                           "above 0") as exc:
        resolve_min_speed(value)
    assert exc.value.field == "min_speed"


@pytest.mark.parametrize("heads", [False, True])
def test_a_tight_min_speed_forces_cheaper_to_attend_choices(heads):
    table = _table(heads)
    free = solve_allocation(table, GEO, 4.5, CONTEXT, BASE, "free")
    assert set(free.choice.values()) == {"turbo4"}  # least KL, within 4.5 bits
    model = SpeedModel(_costs(mixed=0.05e-3), table.layers)
    slow = model.ratio(free.choice)
    for want in (slow, 1.0, 1.1):
        c = SpeedConstraint(model, want)
        alloc = c.solve(table, GEO, 4.5, CONTEXT, BASE, "fast")
        assert model.ratio(alloc.choice) >= want - 1e-12
        assert alloc.bits_per_element <= 4.5
        assert alloc.predicted_kl == pytest.approx(sum(table.kl[u][s] for u, s in alloc.choice.items()))
        if want > slow:
            assert set(alloc.choice.values()) != {"turbo4"}
            assert c.unconstrained[(BASE.sink, BASE.recent, -1)] == (pytest.approx(slow), True)
    # the tighter the minimum, the more KL it costs
    kls = [SpeedConstraint(model, w).solve(table, GEO, 4.5, CONTEXT, BASE).predicted_kl for w in (1.0, 1.2)]
    assert kls[0] <= kls[1]


def test_an_unreachable_min_speed_names_the_best_reachable_ratio():
    table = _table()
    model = SpeedModel(_costs(), table.layers)
    best = model.ratio(_all(table, "turbo1"))  # the fastest choice everywhere (within 4.5 bits)
    with pytest.raises(SpeedUnreachable, match=rf"predicted at {best:.3f}x dense tokens/s .*ask for at most "
                                               rf"{best:.3f}") as exc:
        SpeedConstraint(model, best + 0.05).solve(table, GEO, 4.5, CONTEXT, BASE)
    assert exc.value.field == "min_speed" and exc.value.best_ratio == pytest.approx(best)
    assert "--" not in str(exc.value)  # the engine names fields, not flags


def test_the_default_rule_gives_way_to_the_best_reachable_ratio():
    table = _table()
    for u in table.units():  # near-flat KL: the fastest choice costs little quality, so the rule holds
        table.kl[u] = {"turbo1": 0.0105, "turbo2": 0.0102, "turbo4": 0.01}
    model = SpeedModel(_costs(), table.layers)
    best = model.ratio(_all(table, "turbo1"))
    c = SpeedConstraint(model, best + 0.05, source="reference")  # (a reference out of reach within this budget)
    alloc = c.solve(table, GEO, 4.5, CONTEXT, BASE)
    assert model.ratio(alloc.choice) == pytest.approx(best) and c.relaxed == {(4, 16, -1): pytest.approx(best)}
    rep = c.report(alloc, CONTEXT)
    assert rep.relaxed_to == pytest.approx(best) and rep.min_ratio == pytest.approx(best)
    assert rep.to_dict()["relaxed_to"] == pytest.approx(best)


def test_the_default_rule_gives_way_where_it_would_cost_more_than_its_kl_limit():
    """The default rule is a preference: where keeping turbo4's speed would raise the additive KL over
    DEFAULT_RULE_KL x the least-KL solution's, the least-KL solution stands (no slower than itself from then on);
    a given minimum never gives way."""
    from tqbench.engine.allocate.speed import DEFAULT_RULE_KL

    table = _table()  # KL falls 50x from turbo1 to turbo4, turbo4 is the slowest
    model = SpeedModel(_costs(), table.layers)
    free = solve_allocation(table, GEO, 4.5, CONTEXT, BASE)
    r0 = model.ratio(free.choice)
    c = SpeedConstraint(model, r0 + 0.02, source="reference")
    alloc = c.solve(table, GEO, 4.5, CONTEXT, BASE)
    assert alloc.choice == free.choice and c.relaxed == {(4, 16, -1): pytest.approx(r0)}
    kept, least = c.gave_way[(4, 16, -1)]
    assert least == pytest.approx(free.predicted_kl) and kept > DEFAULT_RULE_KL * least
    assert c.admits(free.choice, BASE) and c.report(alloc, CONTEXT).relaxed_to == pytest.approx(r0)
    given = SpeedConstraint(model, r0 + 0.02).solve(table, GEO, 4.5, CONTEXT, BASE)
    assert model.ratio(given.choice) >= r0 + 0.02 - 1e-12 and given.predicted_kl > DEFAULT_RULE_KL * free.predicted_kl


def test_exchange_steps_admit_only_moves_that_keep_the_speed():
    table = _table()
    model = SpeedModel(_costs(), table.layers)
    c = SpeedConstraint(model, 1.05)
    seen = []

    def measure(choice, policy):  # a joint measure: the additive KL, recording every choice it was asked about
        seen.append(dict(choice))
        return sum(table.kl[u][s] for u, s in choice.items())

    alloc, _, steps = improve(table, GEO, 4.5, CONTEXT, BASE, measure, max_measurements=6, speed=c)
    assert seen and all(model.ratio(ch) >= 1.05 - 1e-12 for ch in seen)
    assert model.ratio(alloc.choice) >= 1.05 - 1e-12
    with pytest.raises(SpeedUnreachable):
        improve(table, GEO, 4.5, CONTEXT, BASE, measure, protections=[(4, 16), (16, 64)],
                speed=SpeedConstraint(model, 5.0))


SMALL = dict(calibration="bread", calib_prefill=48, calib_steps=8, verify_prefill=48, verify_steps=6, context=96,
             base="sink=2,recent=4", protections=[], max_measurements=2, unseen_text=None, codecs=CODECS)


def test_report_gives_the_predicted_speed_in_json_and_artifact(tiny_engine, tmp_path):
    from tqbench.engine.policy import load_policy_artifact, save_policy_artifact

    g = tiny_engine.geometry
    costs = DecodeCosts(96, g.kv_heads, _costs().layer, 0.0, 10e-3, 11e-3)
    rep = allocate_policy(tiny_engine, 4.5, min_speed="turbo4", decode_costs=costs, **SMALL)
    d = json.loads(json.dumps(rep.to_dict()))["speed"]
    for key in ("predicted_ratio", "min_ratio", "min_source", "reference_ratio", "unconstrained_ratio",
                "constrained", "measured_ratio", "cost_ns_per_row", "mixed_layer_seconds", "dense_step_seconds"):
        assert key in d
    assert d["min_source"] == "reference" and d["min_ratio"] == pytest.approx(10 / 11)
    assert d["predicted_ratio"] >= d["min_ratio"] - 1e-12 and d["measured_ratio"] is None
    assert set(d["cost_ns_per_row"]["k"]) == {"turbo1", "turbo2", "turbo4", "fp16"}
    path = save_policy_artifact(rep.to_artifact(g), tmp_path / "p.toml")
    art = load_policy_artifact(path)
    assert art.allocation["speed"]["predicted_ratio"] == pytest.approx(d["predicted_ratio"])
    off = allocate_policy(tiny_engine, 4.5, **SMALL)
    assert off.speed is None and off.to_dict()["speed"] is None


def test_verify_speed_measures_the_chosen_policy_against_dense(tiny_engine):
    costs = DecodeCosts(96, tiny_engine.geometry.kv_heads, _costs().layer, 0.0, 10e-3, 11e-3)
    rep = allocate_policy(tiny_engine, 4.5, min_speed=0.5, verify_speed=True, decode_costs=costs, **SMALL)
    m = rep.speed.measured
    assert m["dense_tok_s"] > 0 and m["policy_tok_s"] > 0 and m["ratio"] == pytest.approx(
        m["policy_tok_s"] / m["dense_tok_s"])
    assert rep.speed.min_source == "given" and rep.speed.min_ratio == 0.5


def test_cost_table_is_measured_once_per_setup(tiny_engine, tmp_path, monkeypatch):
    import tqbench.engine.allocate.speed as speed

    calls = []

    def fake(engine, context, base, choices, layer, **kw):
        calls.append(context)
        return DecodeCosts(context, 2, {r: {c: 1e-3 for c in [*cs, "turbo4"]} for r, cs in choices.items()}, 0.0,
                           1e-2, 1e-2)

    monkeypatch.setattr(speed, "measure_costs", fake)
    path = tmp_path / "costs.json"
    choices = {"k": ["turbo2", "turbo4"], "v": ["turbo4"]}
    first, read = cached_costs(tiny_engine, 96, BASE, choices, 0, path)
    again, read2 = cached_costs(tiny_engine, 96, BASE, choices, 0, path)
    assert (read, read2) == (False, True) and calls == [96]
    assert again.layer == first.layer and again.machine["threads"] >= 1
    cached_costs(tiny_engine, 128, BASE, choices, 0, path)  # another context: measured
    cached_costs(tiny_engine, 96, BASE, {"k": ["turbo1", "turbo4"], "v": ["turbo4"]}, 0, path)  # a new choice
    assert calls == [96, 128, 96]


def _cli(*args):
    from tqbench.cli.group import main

    return CliRunner().invoke(main, ["--headless", "allocate", "--model", "tiny", *args])


TINY_CLI = ["--calibration", "bread", "--calib-prefill", "48", "--calib-steps", "8", "--verify-prefill", "48",
            "--verify-steps", "6", "--context", "96", "--sink", "2", "--recent", "4", "--codecs",
            "turbo1,turbo2,turbo4", "--sinks", "", "--max-measurements", "0", "--unseen-text", "none",
            "--verify-text", "none"]


@pytest.mark.parametrize("value", ["0", "-0.5", "fast"])
def test_cli_min_speed_bad_value_is_one_clear_line(value):
    res = _cli("--budget", "4.5", *TINY_CLI, "--min-speed", value)
    assert res.exit_code == 2, res.output
    assert "--min-speed=" in res.stderr and "is invalid: give a ratio of decode tokens/s" in res.stderr
    assert "Traceback" not in res.output


def test_cli_min_speed_reports_speed_in_json(tmp_path):
    res = _cli("--budget", "4.5", *TINY_CLI, "--min-speed", "0.001", "--json", "--resume",
               str(tmp_path / "x.partial.json"))
    assert res.exit_code == 0, res.output
    sp = json.loads(res.stdout)["speed"]
    assert sp["min_ratio"] == 0.001 and sp["predicted_ratio"] > 0 and sp["min_source"] == "given"
    assert (tmp_path / "x.partial.json.decode-costs.json").is_file()  # measured once, beside the partial file
