"""The allocator's operating point (engine/allocate/operating.py): the rotation it pays for, the uniform policy of the
same bytes it is compared with and the warning, the fp16 cells it does not measure, the CLI's gate and phases."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tqbench.engine.allocate import SensitivityTable, solve_allocation
from tqbench.engine.allocate.operating import (
    ROTATION_SHARE,
    UNIFORM_FAR,
    choose_rotation,
    uniform_of_bytes,
    uniform_warning,
)
from tqbench.engine.allocate.solver import budget_bytes
from tqbench.engine.allocate.verify import FrontierPoint
from tqbench.engine.cache.estimate import KVGeometry, estimate_kv
from tqbench.engine.codecs.rotation import rotation_bytes
from tqbench.engine.policy import parse_policy

GEMMA = KVGeometry(18, 1, 256, tuple(["sliding_attention"] * 5 + ["full_attention"]) * 3, 512)


def test_rotation_auto_pays_for_hadamard_only_where_the_qr_bytes_weigh():
    base = parse_policy("sink=4,recent=16")
    pol, note = choose_rotation("auto", base, GEMMA, 2.5, 1024)
    qr = 2 * rotation_bytes(256, "qr")
    assert qr > ROTATION_SHARE * budget_bytes(GEMMA, 2.5, 1024, base)
    assert pol.rotation == "hadamard" and f"{qr:,} bytes" in note and "head_dim 256" in note
    small = KVGeometry(30, 3, 64)  # SmolLM2's shape: 16 KiB of rotation against ~3.7 MB
    assert choose_rotation("auto", base, small, 2.5, 1024) == (base, None)
    assert choose_rotation("qr", base, GEMMA, 2.5, 1024) == (base, None)
    assert choose_rotation("hadamard", base, small, 2.5, 1024)[0].rotation == "hadamard"
    odd = KVGeometry(4, 2, 96)  # not a power of two: no Hadamard
    assert choose_rotation("auto", base, odd, 1.5, 16)[0].rotation == "qr"
    tiny = KVGeometry(4, 2, 64)  # the rotation weighs (16% of the bytes) but a 64-wide Hadamard is not measured
    assert choose_rotation("auto", base, tiny, 4.5, 96) == (base, None)
    with pytest.raises(ValueError, match="rotation 'givens' is invalid"):
        choose_rotation("givens", base, GEMMA, 2.5, 1024)


def test_hadamard_frees_the_rotation_bytes_at_the_same_codes():
    qr = estimate_kv(parse_policy("k=turbo2,v=turbo2,sink=4,recent=16,sliding=compress"), GEMMA, 1024)
    had = estimate_kv(parse_policy("k=turbo2,v=turbo2,sink=4,recent=16,sliding=compress,rotation=hadamard"), GEMMA,
                      1024)
    # K and V rotate with independent seeds: two rotations, each counted once for the whole cache
    assert qr.total_bytes - had.total_bytes == 2 * (rotation_bytes(256, "qr") - rotation_bytes(256, "hadamard"))


def _table(geo, codecs, kl):
    t = SensitivityTable(list(range(geo.num_layers)), list(codecs))
    for layer in range(geo.num_layers):
        for role in ("k", "v"):
            t.kl[(layer, role)] = dict(zip(codecs, kl))
    return t


def test_uniform_of_bytes_is_the_widest_uniform_not_above_the_allocation():
    geo = KVGeometry(4, 2, 64)
    base = parse_policy("sink=2,recent=4")
    alloc = solve_allocation(_table(geo, ["turbo2", "turbo3", "turbo4"], [0.3, 0.1, 0.01]), geo, 3.0, 512, base)
    uni = uniform_of_bytes(alloc, base, geo, 512)
    nbytes = estimate_kv(uni, geo, 512).total_bytes
    assert nbytes <= alloc.estimate.total_bytes and uni.k == uni.v and uni.sink == 2 and uni.recent == 4
    wider = [s for s in ("turbo2.5", "turbo3", "turbo3.5", "turbo4") if s != uni.k]
    assert all(estimate_kv(replace(uni, k=s, v=s), geo, 512).total_bytes > alloc.estimate.total_bytes
               for s in wider if float(s[5:]) > float(uni.k[5:]))


def _point(policy: str, kl: float) -> FrontierPoint:
    return FrontierPoint(policy, "corpus:rivers", 1024, 2.5, 2.5, 1000, 1024, 256, kl, kl * 3, 0.9, 10.0, 11.0)


def test_the_warning_names_both_kls_only_when_far_worse():
    assert uniform_warning(_point("alloc", 0.1), _point("uniform-turbo2", 0.1 / UNIFORM_FAR)) is None
    msg = uniform_warning(_point("alloc", 0.92), _point("uniform-turbo2", 0.2))
    assert "0.9200" in msg and "4.6x" in msg and "uniform-turbo2" in msg and "0.2000" in msg
    assert uniform_warning(_point("alloc", 0.9), None) is None


def test_a_model_without_transforms_gets_them_fitted_once_and_offered(tiny_engine, tmp_path, monkeypatch):
    from tqbench.engine.allocate import allocate_policy

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the fit is cached in the user cache folder
    small = dict(calibration="bread", calib_prefill=48, calib_steps=8, context=96, base="sink=2,recent=4",
                 protections=[], max_measurements=0, verify_text=None, unseen_text=None, codecs=["turbo2", "fp16"])
    first = allocate_policy(tiny_engine, 9.0, fit_transforms=True, **small)
    assert first.seconds["transforms_fitted"] is True and first.seconds["cpu"]["calibrate"] > 0
    assert {"pcaq2", "pcaq3", "pcaq4"} <= set(first.table.choices("k")) and "pcaq2" not in first.table.choices("v")
    assert any("fitted now on the calibration mix" in n for n in first.notes)
    pol = first.allocation.policy  # names its transforms file where it uses calibrated keys, else none
    assert (str(tmp_path) in pol.calib) == ("pcaq" in pol.to_string().replace(f"calib={pol.calib}", ""))
    # fp16 cells are the reference rows: KL 0, not measured
    assert all(row["fp16"] == 0.0 for row in first.table.kl.values())
    again = allocate_policy(tiny_engine, 9.0, fit_transforms=True, **small)
    assert again.seconds["transforms_fitted"] is False and any("fitted before" in n for n in again.notes)
    plain = allocate_policy(tiny_engine, 5.0, **small)  # the engine's default: no fit, the reason in the notes
    assert "pcaq2" not in plain.table.choices("k") and any("pcaq key codecs not offered" in n for n in plain.notes)
    # at 5 bits and 96 tokens no unit can hold fp16 rows (sink 2, window 4, turbo2 elsewhere): not measured
    assert "fp16" not in plain.table.choices("k") + plain.table.choices("v")
    assert any(n.startswith("not measured (no unit can afford them") and "K fp16" in n for n in plain.notes)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_kl_from_logits_is_kl_rows_of_the_log_softmaxes(dtype, tol):
    from tqbench.engine.metrics import kl_from_logits, kl_rows

    gen = torch.Generator().manual_seed(0)
    base = torch.randn(3, 5, 4096, generator=gen, dtype=torch.float64).mul(4).to(dtype)
    for scale in (1e-3, 0.1, 2.0):  # a candidate close to the exact side, and far from it
        cand = base + scale * torch.randn(base.shape, generator=gen, dtype=torch.float64).to(dtype)
        lp = torch.log_softmax(base, -1)
        ref = kl_rows(lp.double(), torch.log_softmax(cand.double(), -1))
        got = kl_from_logits(lp.exp(), base, torch.logsumexp(base, -1), cand)
        assert torch.allclose(got.double(), ref, rtol=1e-4 if dtype == torch.float32 else 1e-9, atol=tol), scale


def test_a_bounded_choice_is_measured_only_where_the_narrower_cell_is_large(tiny_engine, monkeypatch):
    import tqbench.engine.allocate.sensitivity as sens
    from tqbench.engine.allocate import measure_sensitivity
    from tqbench.engine.allocate.texts import calibration_set

    ids = calibration_set(tiny_engine.tokenizer, "corpus:bread", 32, 4).ids
    pol = parse_policy("sink=2,recent=4")
    full = measure_sensitivity(tiny_engine, ids, 32, ["turbo1", "turbo4"], pol)
    cut = sorted(row["turbo1"] for row in full.kl.values())[len(full.kl) // 2]  # half the units above, half below
    monkeypatch.setattr(sens, "BOUNDED", {"turbo4": ("turbo1", cut)})
    persisted = {}
    table = measure_sensitivity(tiny_engine, ids, 32, ["turbo1", "turbo4"], pol, on_cell=persisted.__setitem__)
    below = [u for u, row in full.kl.items() if row["turbo1"] < cut]
    assert below and len(table.bounded) == len(below) and not set(table.bounded) & set(persisted)
    for u, row in table.kl.items():
        assert row["turbo4"] == (row["turbo1"] if u in below else pytest.approx(full.kl[u]["turbo4"]))
