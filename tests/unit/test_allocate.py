import pytest

from tqbench.engine.cache.estimate import KVGeometry, estimate_kv
from tqbench.engine.policy.allocate import allocate_bits, allocation_policy, row_bits


def test_sensitive_layers_get_more_bits_within_budget():
    sk = [0.001, 0.02, 0.001, 0.005]
    sv = [0.01, 0.0005, 0.0005, 0.0005]
    kb, vb, pred = allocate_bits(sk, sv, budget=3.25, head_dim=64)
    mean = sum(row_bits(b, 64) for b in kb + vb) / 8
    assert mean <= 3.25
    assert kb[1] == max(kb) and vb[0] == max(vb)
    assert kb[1] > kb[0] and vb[0] > vb[1]
    uniform = sum(s * 0.0334 / 0.114 for s in sk + sv)  # everything at 3 bits costs the same bytes
    assert pred < uniform


def test_budget_below_minimum_is_an_error():
    with pytest.raises(ValueError, match="below the minimum"):
        allocate_bits([1.0], [1.0], budget=1.0, head_dim=64)


def test_allocation_policy_round_trips_and_fits_exact_bytes():
    kb, vb = [2, 3, 3, 2], [2, 2, 4, 2]
    pol = allocation_policy(kb, vb, sink=4, recent=16, name="mine")
    plan = pol.plan(4)
    assert [p.k for p in plan] == ["turbo2", "turbo3", "turbo3", "turbo2"]
    assert [p.v for p in plan] == ["turbo2", "turbo2", "turbo4", "turbo2"]
    est = estimate_kv(pol, KVGeometry(4, 3, 64), 1280)
    assert 2.75 < est.bits_per_element < 3.3
