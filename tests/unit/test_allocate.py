"""Auto-policy (engine/allocate): sensitivity, the exact-bytes solver, verification, resume, the artifact, the CLI."""

from __future__ import annotations

import itertools
import json
import warnings

import pytest
import torch
from click.testing import CliRunner

from tqbench.engine.allocate import (
    SensitivityTable,
    allocate_policy,
    frontier,
    measure_sensitivity,
    rank_correlation,
    solve_allocation,
)
from tqbench.engine.cache.estimate import KVGeometry, estimate_kv, store_bytes
from tqbench.engine.events import Cancelled, SensitivityMeasured
from tqbench.engine.policy import load_policy_artifact, parse_policy, save_policy_artifact

SMALL = dict(calibration="bread", calib_prefill=48, calib_steps=8, verify_prefill=48, verify_steps=6, context=96,
             base="sink=2,recent=4", protections=[], max_measurements=0, unseen_text=None)
CODECS = ["turbo1", "turbo2", "turbo4"]


def _table(layers: int, kl: dict[tuple[int, str], list[float]], codecs=CODECS) -> SensitivityTable:
    t = SensitivityTable(list(range(layers)), list(codecs))
    for key, vals in kl.items():
        t.kl[key] = dict(zip(codecs, vals))
    return t


def test_solver_matches_brute_force_and_fits_the_exact_bytes():
    geo = KVGeometry(2, 2, 64)
    base = parse_policy("sink=4,recent=16")
    table = _table(2, {(0, "k"): [0.5, 0.1, 0.01], (0, "v"): [0.05, 0.02, 0.001],
                       (1, "k"): [0.9, 0.3, 0.02], (1, "v"): [0.02, 0.01, 0.005]})
    budget, context = 2.9, 2048  # at 512 tokens the shared rotations of this tiny geometry cost a bit
    alloc = solve_allocation(table, geo, budget, context, base, "mine")
    est = estimate_kv(alloc.policy, geo, context)
    assert est.total_bytes == alloc.estimate.total_bytes and est.bits_per_element <= budget
    best = None  # every one of the 81 choices, priced by estimate_kv itself
    for combo in itertools.product(CODECS, repeat=4):
        k, v = [combo[0], combo[2]], [combo[1], combo[3]]
        pol = parse_policy(f"k={k[0]},v={v[0]},sink=4,recent=16,k@1={k[1]},v@1={v[1]}")
        if estimate_kv(pol, geo, context).bits_per_element <= budget:
            kl = sum(table.get(j // 2, "kv"[j % 2], c) for j, c in enumerate(combo))
            best = kl if best is None else min(best, kl)
    assert alloc.predicted_kl == pytest.approx(best)
    assert alloc.predicted_kl == pytest.approx(sum(table.get(i, r, c) for r, cs in (("k", alloc.k), ("v", alloc.v))
                                                   for i, c in enumerate(cs)))
    assert alloc.policy.label == "mine" and alloc.k[1] == "turbo4"  # the most sensitive cell gets the most bits
    assert alloc.bits_grid()[1][0] == 4.0


def test_solver_bytes_count_every_row_and_the_shared_objects():
    geo = KVGeometry(3, 2, 64)
    base = parse_policy("sink=4,recent=16")
    table = _table(3, {(i, r): [1.0, 0.5, 0.1] for i in range(3) for r in "kv"})
    alloc = solve_allocation(table, geo, 2.5, 2048, base)
    est = alloc.estimate
    per_layer = sum(store_bytes(base.build_codec(c, r), 4, 16, 2048, 1, 2, 64)[0]
                    for c, r in [*zip(alloc.k, "k" * 3), *zip(alloc.v, "v" * 3)])
    assert est.total_bytes == per_layer + est.shared_bytes and est.shared_bytes > 0
    assert est.bits_per_element <= 2.5


def test_budget_below_the_cheapest_choice_says_what_fits():
    table = _table(2, {(i, r): [1.0, 0.5, 0.1] for i in range(2) for r in "kv"})
    geo, base = KVGeometry(2, 2, 64), parse_policy("sink=4,recent=16")
    with pytest.raises(ValueError, match=r"budget 1.0 bits/element does not fit at 256 tokens: the cheapest choice "
                                         r"of turbo1, turbo2, turbo4 with sink=4, recent=16 needs about ([0-9.]+) "
                                         "bits/element; raise the budget") as exc:
        solve_allocation(table, geo, 1.0, 256, base)
    floor = float(str(exc.value).split("needs about ")[1].split()[0])
    assert solve_allocation(table, geo, floor + 0.001, 256, base).k == ("turbo1", "turbo1")  # the stated floor fits
    with pytest.raises(ValueError, match="does not fit"):
        solve_allocation(table, geo, floor - 0.002, 256, base)


def test_rank_correlation():
    assert rank_correlation([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert rank_correlation([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert rank_correlation([1, 1, 2], [5, 5, 7]) == pytest.approx(1.0)


def test_sensitivity_is_zero_for_a_lossless_codec_and_falls_with_bits(tiny_engine):
    ids = torch.randint(3, 200, (1, 56), generator=torch.Generator().manual_seed(0))
    events = []
    table = measure_sensitivity(tiny_engine, ids, 48, ["fp16", "turbo1", "turbo4"], parse_policy("sink=2,recent=4"),
                                on_event=events.append)
    assert len(events) == 4 * 2 * 3 and all(isinstance(e, SensitivityMeasured) for e in events)
    assert events[-1].done == events[-1].total == 24
    for key, row in table.kl.items():
        assert row["fp16"] == 0.0, key  # the rebuilt dense cache is the baseline's, bit for bit
    assert sum(r["turbo4"] for r in table.kl.values()) < sum(r["turbo1"] for r in table.kl.values())


def test_allocate_cancels_and_resumes_from_its_partial_file(tiny_engine, tmp_path):
    partial = tmp_path / "p.json"
    seen = []

    def cancel_after_five() -> bool:
        return len(seen) >= 5

    with pytest.raises(Cancelled, match="allocate cancelled"):
        allocate_policy(tiny_engine, 4.0, codecs=CODECS, partial_path=str(partial), verify_text=None,
                        on_event=lambda e: seen.append(e) if isinstance(e, SensitivityMeasured) else None,
                        cancel=cancel_after_five, **{k: v for k, v in SMALL.items() if "verify" not in k})
    assert len(json.loads(partial.read_text())["cells"]) == 5
    resumed = allocate_policy(tiny_engine, 4.0, codecs=CODECS, partial_path=str(partial), **SMALL)
    assert (resumed.resumed_cells, resumed.measured_cells) == (5, 4 * 2 * 3 - 5)
    fresh = allocate_policy(tiny_engine, 4.0, codecs=CODECS, **SMALL)
    assert fresh.table.kl == resumed.table.kl and fresh.allocation.policy == resumed.allocation.policy
    assert fresh.verified.kl_mean == resumed.verified.kl_mean
    other = allocate_policy(tiny_engine, 4.0, codecs=["turbo1", "turbo3"], partial_path=str(partial), **SMALL)
    assert (other.resumed_cells, other.measured_cells) == (8, 8)  # the turbo1 cells are reused
    assert other.table.kl[(2, "v")]["turbo1"] == fresh.table.kl[(2, "v")]["turbo1"]
    with pytest.raises(ValueError, match=r"measured with another setup \(codec_options, recent differ\)"):
        allocate_policy(tiny_engine, 4.0, codecs=CODECS, partial_path=str(partial),
                        **{**SMALL, "base": "sink=2,recent=8"})


def test_allocation_is_verified_and_its_cache_report_is_within_budget(tiny_engine):
    rep = allocate_policy(tiny_engine, 4.5, codecs=CODECS, **SMALL)
    v = rep.verified
    assert v.text == "corpus:rivers" and v.steps == 6 and v.context_tokens == 96
    assert v.report_bits_per_element == pytest.approx(rep.allocation.bits_per_element, abs=1e-4)
    assert v.report_bits_per_element <= 4.5 and rep.allocation.bits_per_element <= 4.5
    (again,) = frontier(tiny_engine, [rep.allocation.policy], text="rivers", prefill=48, steps=6, context=96)
    assert again.kl_mean == v.kl_mean  # one definition: the same teacher-forced run
    with pytest.raises(ValueError, match="verify_text='corpus:bread' is invalid: it is also used for calibration"):
        allocate_policy(tiny_engine, 4.5, **{**SMALL, "verify_text": "bread"})


def test_artifact_round_trips_and_warns_on_another_model(tiny_engine, tmp_path):
    from tqbench.engine.cache import TQCache
    from tqbench.engine.engine import Engine

    rep = allocate_policy(tiny_engine, 4.5, codecs=CODECS, name="tiny-3bit", **SMALL)
    path = save_policy_artifact(rep.to_artifact(tiny_engine.geometry), tmp_path / "tiny-3bit.toml")
    assert (tmp_path / "tiny-3bit.safetensors").is_file()
    art = load_policy_artifact(path)
    assert art.policy == rep.allocation.policy and art.policy.label == "tiny-3bit"
    assert art.model["fingerprint"] == tiny_engine.loaded.fingerprint
    assert torch.equal(art.tensors["sensitivity"], rep.table.as_tensor())
    assert art.allocation["total_bytes"] == rep.allocation.estimate.total_bytes
    assert art.verified["kl_mean"] == rep.verified.kl_mean
    assert parse_policy(str(path)) == rep.allocation.policy
    assert tiny_engine.policy_warning(str(path)) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TQCache(policy=str(path), config=tiny_engine.config)  # same model: no warning
    other = Engine.tiny(num_layers=6)
    with pytest.warns(UserWarning, match=r"fitted on tiny-random .* with 4 layers x 2 KV heads x head_dim 16, but "
                                          r"this model has 6 x 2 x 16"):
        TQCache(policy=str(path), config=other.config)
    reseeded = Engine.tiny(seed=1)
    assert "not on this model" in reseeded.policy_warning(str(path))
    with pytest.warns(UserWarning, match="not on this model"):
        reseeded.make_cache(str(path))


def _cli(*args):
    from tqbench.cli.group import main

    return CliRunner().invoke(main, ["--headless", "allocate", "--model", "tiny", *args])


TINY_CLI = ["--calibration", "bread", "--calib-prefill", "48", "--calib-steps", "8", "--verify-prefill", "48",
            "--verify-steps", "6", "--context", "96", "--sink", "2", "--recent", "4", "--codecs", "turbo1,turbo2,turbo4",
            "--sinks", "2,4", "--recents", "4", "--max-measurements", "3", "--min-speed", "none",  # (speed: own tests)
            "--no-fit-transforms"]  # (the fit: test_allocate_operating)


def test_cli_allocate_json_and_out(tmp_path):
    out = tmp_path / "p.toml"
    res = _cli("--budget", "4.5", "--json", "--out", str(out), *TINY_CLI)
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["allocation"]["bits_per_element"] <= 4.5
    assert data["verified"]["report_bits_per_element"] <= 4.5 and data["verified"]["text"] == "corpus:rivers"
    assert len(data["bits_grid"]) == 4 and data["out"] == str(out)
    assert [s["kind"] for s in data["steps"]] == ["protection", "protection", "exchange"]
    assert data["unseen"]["text"] == "heldout:technical" and data["fitted_vs_unseen"]["unseen_kl"] is not None
    assert {"calibrate", "setup", "sensitivity", "solve_and_measure", "verify"} <= set(data["seconds"])
    assert data["context_tokens"] == 96 and "context 96 tokens" in res.stderr and "phases: calibrate" in res.stderr
    uniform = data["uniform"]["corpus:rivers"]  # the uniform policy of no more bytes, verified beside it
    assert uniform["kv_policy"].startswith("uniform-turbo") and uniform["bits_per_element"] <= \
        data["allocation"]["bits_per_element"]
    for phase in ("setup", "sensitivity", "solve", "measure", "baseline", "candidate", "verify"):
        assert f"allocate: {phase} " in res.stderr, phase  # progress lines on stderr in every phase, --json too
    assert load_policy_artifact(out).policy.label == "p"
    assert json.loads((tmp_path / "p.partial.json").read_text())["setup"]["calibration"] == "corpus:bread"
    assert "nothing is saved" not in res.stderr and "policy is not saved" not in res.stderr
    partial = tmp_path / "p.partial.json"
    again = _cli("--budget", "4.0", "--json", "--resume", str(partial), *TINY_CLI)
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["measured_cells"] == 0  # another budget reuses every measured cell
    said = (f"allocate: no --out, so the policy is not saved (the measured cells are kept in {partial}): add --out "
            "FILE.toml to write it")
    assert again.stderr.count(said) == 2  # before the job and after it
    gated = _cli("--budget", "4.0", "--resume", str(tmp_path / "p.partial.json"), "--max-kl", "0", *TINY_CLI)
    assert gated.exit_code == 1, gated.output  # the worse of the two verified texts is above 0
    assert "gate failed: verified KL" in gated.stderr and "> --max-kl 0" in gated.stderr


@pytest.mark.parametrize("args, message", [
    (["--budget", "1.5", "--codecs", "turbo2,turbo4"], "budget 1.5 bits/element is out of range: give a number above 2"),
    (["--budget", "3", "--granularity", "rows"], "'rows' is not one of 'layer', 'head'"),
    (["--budget", "3", "--verify-text", "bread"], "--verify-text='corpus:bread' is invalid: it is also used for "
                                                 "calibration"),
    (["--budget", "3", "--sinks", "4,x"], "--sinks '4,x' / --recents '4' must be comma-separated token counts"),
    (["--budget", "3", "--out", "p.json"], "must end in .toml"),
    (["--budget", "3", "--codecs", "turbo9"], "unknown codec 'turbo9'"),
    (["--budget", "3", "--calibration", "soup"], "neither a text file nor a shipped text"),
])
def test_cli_allocate_bad_input_is_one_clear_line(args, message):
    res = _cli(*TINY_CLI, *args)
    assert res.exit_code == 2, res.output
    assert message in res.stderr and "Traceback" not in res.output
