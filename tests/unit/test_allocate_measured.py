"""Allocation that measures (issue 21): layer-skipping chunk cells, head cells, the calibration mix and the unseen
texts, protection options and exchange steps scored by a joint measure, resume across granularities."""

from __future__ import annotations

import json

import pytest
import torch

from tqbench.engine.allocate import SensitivityTable, allocate_policy, measure_sensitivity
from tqbench.engine.allocate.chunk import ChunkRunner, quantized_rows
from tqbench.engine.allocate.exchange import ExchangeStep, improve
from tqbench.engine.allocate.texts import MIX_KINDS, calibration_set, check_unseen
from tqbench.engine.cache.estimate import KVGeometry, estimate_kv
from tqbench.engine.events import SensitivityMeasured
from tqbench.engine.policy import parse_policy

SMALL = dict(calib_prefill=48, calib_steps=8, verify_prefill=48, verify_steps=6, context=96, base="sink=2,recent=4",
             codecs=["turbo1", "turbo2", "turbo4"], protections=[], max_measurements=0)
STEP_KEYS = {"step", "kind", "move", "predicted_kl", "measured_kl", "bits_per_element", "total_bytes", "sink",
             "recent", "accepted", "srecent"}


def _ids(batch=2, n=56, seed=0):
    return torch.randint(3, 200, (batch, n), generator=torch.Generator().manual_seed(seed))


def test_layer_skipping_cell_equals_the_full_forward_cell(tiny_engine64):
    runner = ChunkRunner(tiny_engine64, _ids(), 48)
    assert runner.layer_skipping and runner.skip_note is None
    pol = parse_policy("sink=2,recent=4")
    for layer, role in ((1, "k"), (3, "v"), (2, "k")):
        ks, vs = list(runner.keys), list(runner.values)
        target = ks if role == "k" else vs
        target[layer] = quantized_rows(pol, "turbo2", role, target[layer], layer)
        skipped = runner.logprobs(ks, vs, start=layer)
        full = runner.logprobs(ks, vs, start=0)
        assert (skipped - full).abs().max().item() <= 1e-12, (layer, role)
        assert runner.kl(ks, vs, start=layer) > 1e-6  # a real change, measured the same both ways
    assert runner.kl(runner.keys, runner.values, start=2) == 0.0  # exact K/V: the baseline, bit for bit


def test_head_cells_of_a_one_head_model_equal_its_layer_cells():
    from tqbench.engine.engine import Engine

    eng = Engine.tiny(num_heads=2, num_kv_heads=1)
    ids, pol = _ids(), parse_policy("sink=2,recent=4")
    runner = ChunkRunner(eng, ids, 48)
    layer = measure_sensitivity(eng, ids, 48, ["turbo1", "turbo3"], pol, runner=runner)
    head = measure_sensitivity(eng, ids, 48, ["turbo1", "turbo3"], pol, runner=runner, granularity="head")
    assert head.heads == [0] and layer.heads is None
    for (la, role), row in layer.kl.items():
        assert head.kl[(la, role, 0)] == row


def test_head_cells_quantize_only_their_head(tiny_engine):
    ids, pol = _ids(), parse_policy("sink=2,recent=4")
    events = []
    table = measure_sensitivity(tiny_engine, ids, 48, ["turbo1", "turbo4"], pol, granularity="head",
                                on_event=events.append)
    assert len(events) == 4 * 2 * 2 * 2 and {e.head for e in events} == {0, 1}
    assert all(isinstance(e, SensitivityMeasured) for e in events)
    layer = measure_sensitivity(tiny_engine, ids, 48, ["turbo1"], pol)
    for la in range(4):  # one head alone costs less than the whole layer at the same width
        for role in "kv":
            assert max(table.get(la, role, "turbo1", h) for h in (0, 1)) < layer.get(la, role, "turbo1")


def test_the_mix_is_one_sequence_per_kind_ending_in_its_kind(tiny_engine):
    from tqbench.engine.allocate.texts import CALIBRATION_DIR

    cs = calibration_set(tiny_engine.tokenizer, "mix", 300, 16)
    assert cs.ids.shape == (4, 316) and cs.label == "mix:prose+code+legal+chat" and cs.steps == 16
    for i, kind in enumerate(MIX_KINDS):
        own = tiny_engine.tokenizer((CALIBRATION_DIR / f"{kind}.txt").read_text(encoding="utf-8"),
                                    return_tensors="pt")["input_ids"][0]
        assert torch.equal(cs.ids[i, -own.shape[0]:] if own.shape[0] <= 316 else cs.ids[i], own[-316:])
    one = calibration_set(tiny_engine.tokenizer, "heldout:code", 40, 8)
    assert one.ids.shape == (1, 48) and one.label == "heldout:code"


@pytest.mark.parametrize("calibration, verify, unseen, message", [
    ("corpus:rivers", "rivers", None, "verify_text='corpus:rivers' is invalid: it is also used for calibration "
                                      "(corpus:rivers)"),
    ("mix", "rivers", "calibration:prose", "unseen_text='calibration:prose' is invalid: it is also used for "
                                           "calibration (mix:prose+code+legal+chat)"),
    ("mix", "heldout:code+technical", "heldout:code+technical", "unseen_text='heldout:code+technical' is invalid: it "
                                                      "is also used for verification (verify_text heldout:code+technical)"),
])
def test_verification_texts_must_be_unseen(tiny_engine, calibration, verify, unseen, message):
    cs = calibration_set(tiny_engine.tokenizer, calibration, 40, 8)
    with pytest.raises(ValueError, match="no text used for choosing") as exc:
        check_unseen(cs, [verify, unseen])
    assert message in str(exc.value)
    with pytest.raises(ValueError, match="is also used for"):
        allocate_policy(tiny_engine, 4.5, **{**SMALL, "calibration": calibration, "verify_text": verify,
                                             "unseen_text": unseen})


def _table(layers=3, codecs=("turbo1", "turbo2", "turbo4")) -> SensitivityTable:
    t = SensitivityTable(list(range(layers)), list(codecs))
    for la in range(layers):
        for r, scale in (("k", 2.0), ("v", 1.0)):
            t.kl[(la, r)] = {c: scale * (la + 1) * 0.1 / (2 ** (i * 2)) for i, c in enumerate(codecs)}
    return t


def test_a_move_that_raises_the_measured_kl_is_rejected():
    geo, base, table = KVGeometry(3, 2, 64), parse_policy("sink=4,recent=16"), _table()
    calls = []

    def worse(choice, pol):  # the solver's own solution measures best: every move makes it worse
        calls.append(dict(choice))
        return 1.0 if len(calls) == 1 else 1.0 + len(calls)

    alloc, measured, steps = improve(table, geo, 3.0, 2048, base, worse, max_measurements=5)
    assert len(calls) == 5 and measured == 1.0 and alloc.choice == calls[0]
    assert [s.accepted for s in steps] == [True, False, False, False, False]
    assert [s.kind for s in steps] == ["protection"] + ["exchange"] * 4
    assert all(s.measured_kl > 1.0 for s in steps[1:])

    def second_move_wins(choice, pol):
        calls.append(dict(choice))
        return 0.5 if len(calls) == 3 else 1.0

    calls.clear()
    alloc, measured, steps = improve(table, geo, 3.0, 2048, base, second_move_wins, max_measurements=4)
    assert measured == 0.5 and alloc.choice == calls[2] and [s.accepted for s in steps] == [True, False, True, False]
    for s in steps:  # every candidate priced by estimate_kv: never over the budget
        assert s.bits_per_element <= 3.0
    assert estimate_kv(alloc.policy, geo, 2048).bits_per_element <= 3.0


def test_protection_options_cost_bytes_inside_the_budget():
    geo, base, table = KVGeometry(3, 2, 64), parse_policy("sink=4,recent=16"), _table()
    seen = []

    def measure(choice, pol):
        seen.append((pol.sink, pol.recent))
        return 1.0 / (1 + pol.recent)  # more window measures better here

    opts = [(4, 16), (16, 64), (64, 128), (512, 1024)]
    alloc, measured, steps = improve(table, geo, 3.0, 2048, base, measure, protections=opts, max_measurements=3)
    assert seen == [(4, 16), (16, 64), (64, 128)]  # 512 + 1024 fp16 tokens cannot fit in 3 bits at 2048
    assert steps[3].move == "sink=512,recent=1024: does not fit the budget" and steps[3].measured_kl is None
    assert (alloc.policy.sink, alloc.policy.recent) == (64, 128) and measured == pytest.approx(1 / 129)
    assert estimate_kv(alloc.policy, geo, 2048).bits_per_element <= 3.0
    assert all(s.bits_per_element is None or s.bits_per_element <= 3.0 for s in steps)


def test_report_json_has_every_step_and_fitted_vs_unseen(tiny_engine, tmp_path):
    rep = allocate_policy(tiny_engine, 4.5, **{**SMALL, "protections": [(2, 4), (4, 8)], "max_measurements": 4})
    data = json.loads(json.dumps(rep.to_dict()))  # valid JSON (no NaN)
    assert all(set(s) == STEP_KEYS for s in data["steps"]) and [s["step"] for s in data["steps"]] == [0, 1, 2, 3, 4]
    assert sum(s["measured_kl"] is not None for s in data["steps"]) == 4  # (4, 8) does not fit: not measured
    assert data["steps"][1]["move"] == "sink=4,recent=8: does not fit the budget"
    assert all(isinstance(s, ExchangeStep) for s in rep.steps)
    best = min((s for s in data["steps"] if s["measured_kl"] is not None), key=lambda s: s["measured_kl"])
    fv = data["fitted_vs_unseen"]
    assert fv["predicted_kl"] == best["measured_kl"] == rep.measured_kl
    assert fv["verification_text"] == "corpus:rivers" and fv["unseen_text"] == "heldout:technical"
    assert fv["unseen_over_verification"] == pytest.approx(fv["unseen_kl"] / fv["verification_kl"])
    assert fv["predicted_over_verification"] == pytest.approx(fv["predicted_kl"] / fv["verification_kl"])
    assert data["unseen"]["text"] == "heldout:technical" and data["setup"]["calibration"].startswith("mix:")
    assert data["allocation"]["bits_per_element"] <= 4.5 and data["seconds"]["layer_skipping"] is True
    assert any("pcaq key codecs not offered" in n for n in data["notes"])  # the tiny model has no calibrated fit


def test_resume_across_granularities_skips_measured_cells(tiny_engine, tmp_path):
    partial = str(tmp_path / "p.json")
    first = allocate_policy(tiny_engine, 4.5, partial_path=partial, verify_text=None, unseen_text=None, **SMALL)
    assert (first.measured_cells, first.resumed_cells) == (4 * 2 * 3, 0)
    again = allocate_policy(tiny_engine, 4.0, partial_path=partial, verify_text=None, unseen_text=None, **SMALL)
    assert (again.measured_cells, again.resumed_cells) == (0, 24)
    cells = json.loads(open(partial).read())["cells"]
    assert len(cells) == 24 and "3/v/turbo4" in cells


def test_head_cells_solve_within_the_exact_budget_with_protection_options():
    geo, base = KVGeometry(3, 2, 64), parse_policy("sink=4,recent=16")
    codecs = ("turbo1", "turbo2", "turbo4")
    t = SensitivityTable(list(range(3)), list(codecs), heads=[0, 1])
    for la in range(3):
        for r in "kv":
            for h in (0, 1):
                t.kl[(la, r, h)] = {c: (la + 1) * (h + 1) * (2.0 if r == "k" else 1.0) * 0.1 / 4 ** i
                                    for i, c in enumerate(codecs)}
    seen = []

    def measure(choice, pol):
        seen.append(pol)
        return sum(t.kl[u][c] for u, c in choice.items()) * (1.5 if len(seen) % 2 else 1.0)

    for budget in (2.6, 3.0, 3.7):
        alloc, measured, steps = improve(t, geo, budget, 2048, base, measure, protections=[(4, 16), (16, 64)],
                                         max_measurements=6)
        est = estimate_kv(alloc.policy, geo, 2048)
        assert est.total_bytes == alloc.estimate.total_bytes and est.bits_per_element <= budget
        assert all(s.bits_per_element is None or s.bits_per_element <= budget for s in steps)
        assert any("|" in spec for spec in alloc.k + alloc.v) or len(set(alloc.choice.values())) == 1
        assert len(alloc.choice) == 3 * 2 * 2 and measured == min(s.measured_kl for s in steps if s.accepted)


def test_staged_protection_search_measures_windows_then_sinks_at_the_best_window():
    """The default grid is searched one coordinate at a time: every recent window at the base's sink, then the
    other sinks at the best window only (options that do not fit are skipped, not measured)."""
    geo, base, table = KVGeometry(3, 2, 64), parse_policy("sink=4,recent=16"), _table()
    seen = []

    def measure(choice, pol):
        seen.append((pol.sink, pol.recent))
        return abs(pol.recent - 32) + pol.sink / 100  # recent=32 measures best, then the fewest sinks

    opts = list(dict.fromkeys([(4, 16), *((s, r) for s in (4, 16, 64) for r in (8, 16, 32, 64, 2048))]))
    alloc, measured, steps = improve(table, geo, 3.0, 2048, base, measure, protections=opts, max_measurements=8,
                                     staged=True)
    assert seen[:6] == [(4, 16), (4, 8), (4, 32), (4, 64), (16, 32), (64, 32)]
    assert [s.move for s in steps if s.measured_kl is None] == ["sink=4,recent=2048: does not fit the budget"]
    assert (alloc.policy.sink, alloc.policy.recent) == (4, 32) and measured == pytest.approx(0.04)
    assert len(seen) == 8  # the rest of the measurements went to exchange steps
    full = []
    improve(table, geo, 3.0, 2048, base, lambda c, p: full.append((p.sink, p.recent)) or 1.0, protections=opts,
            max_measurements=1)
    assert len(full) == 12  # unstaged: every option that fits is measured


def test_staged_order_ends_with_the_sliding_layers_recent_rows_at_the_best_protection():
    from tqbench.engine.allocate.exchange import _protection_order, as_protection

    opts = [as_protection(o) for o in [(4, 16), (4, 8), (16, 16), (64, 16), (4, 16, 0), (4, 16, 32), (4, 16, 8)]]
    best = iter([(4, 8, -1), (16, 8, -1)])
    order = list(_protection_order(opts, True, lambda: next(best)))
    assert order == [(4, 16, -1), (4, 8, -1), (16, 8, -1), (64, 8, -1), (16, 8, 0), (16, 8, 32)]  # srecent=8: as recent
    assert list(_protection_order(opts, False, lambda: None)) == opts
    with pytest.raises(ValueError, match="give \\(sink, recent\\) or \\(sink, recent, srecent\\)"):
        as_protection((4,))


def test_a_close_srecent_option_is_solved_again_on_its_own_cells_and_wins_when_it_measures_better():
    """``reprice``: an srecent option whose first (base-cell) solve measures within ``REPRICE_WITHIN`` of the best is
    solved again on the cells ``reprice`` gives, measured again, and kept when better (its table then prices the
    exchange steps); one measuring further off, and options without srecent, are not re-measured."""
    from tqbench.engine.allocate.exchange import REPRICE_WITHIN
    from tqbench.engine.allocate.solver import solve_allocation

    geo, base, table = KVGeometry(3, 2, 64), parse_policy("sink=4,recent=16"), _table()
    own = _table()
    for la in range(3):  # re-measured: layer 0 barely cares about its codec, so its bits go elsewhere
        own.kl[(la, "k")] = {c: (0.001 if la == 0 else 10.0) * kl for c, kl in own.kl[(la, "k")].items()}
    own_choice = solve_allocation(own, geo, 3.0, 2048, parse_policy("sink=4,recent=16,srecent=32")).choice
    assert own_choice != solve_allocation(table, geo, 3.0, 2048, base).choice
    asked = []

    def reprice(pol):
        asked.append(pol.srecent)
        return own

    def measure(choice, pol):
        if pol.srecent == 0:
            return 10.0 * REPRICE_WITHIN  # far off: not re-measured
        return 0.5 if choice == own_choice else 1.0

    opts = [(4, 16, -1), (4, 16, 32), (4, 16, 0)]
    alloc, measured, steps = improve(table, geo, 3.0, 2048, base, measure, protections=opts, max_measurements=4,
                                     reprice=reprice)
    assert asked == [32]
    assert [(s.srecent, s.measured_kl, s.accepted) for s in steps] == [
        (-1, 1.0, True), (32, 1.0, False), (32, 0.5, True), (0, 10.0 * REPRICE_WITHIN, False)]
    assert steps[2].move == "solve at sink=4,recent=16,srecent=32 (cells re-measured there)"
    assert alloc.choice == own_choice and measured == 0.5 and alloc.policy.srecent == 32
    asked.clear()
    improve(table, geo, 3.0, 2048, base, measure, protections=opts, max_measurements=4)  # no reprice: as before
    assert asked == []
