"""Every policy round-trips through its written forms (issue 42, item 1): ``parse(p.to_string()) == p`` and the
written form is stable, over every key of the grammar (a property test); the same through the dict (JSON) form.
``keep=1`` is the fraction 1.0 (every row), a row count is written ``keep=512rows`` and never equals a fraction."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tqbench.engine.policy import Policy, parse_policy
from tqbench.engine.policy.grammar import parse_compact
from tqbench.engine.policy.keep import BUDGETS, HEAD_BUDGETS, SCORES, Rows
from tqbench.engine.policy.spec import _WRITTEN, BYPASS_CHOICES, ROTATION_CHOICES, SLIDING_CHOICES

KEPT = ["fp16", "bf16", "fp32", "int8", "int4", "turbo3", "turbo4", "turbo2.5", "turbo3.5", "turbo4-qjl", "q8_0",
        "q4_0", "iq4_nl", "fp8_e4m3", "fp8_e5m2-prefill", "fp4_mx_block16", "turbo3|turbo4", "fp16|int8|turbo4"]
K_ONLY = ["pcaq2.5", "pcaq3|pcaq2"]
DEMOTES = ["", "turbo1", "turbo2", "int2", "turbo1.5"]
SELECTORS = ["0", "1-3", "last2", "first2+last2", "0+5", "last8"]
fractions = st.floats(min_value=0.01, max_value=1.0, allow_nan=False).map(lambda f: round(f, 3)).filter(bool)
keeps = st.one_of(fractions, st.builds(Rows, st.integers(64, 100_000)),
                  st.lists(fractions, min_size=2, max_size=4).map(tuple))
overrides = st.lists(st.one_of(
    st.tuples(st.sampled_from(["k", "v", "kv"]), st.sampled_from(SELECTORS), st.sampled_from(KEPT)),
    st.tuples(st.just("k"), st.sampled_from(SELECTORS), st.sampled_from(K_ONLY)),
    st.tuples(st.just("keep"), st.sampled_from(SELECTORS), st.one_of(
        fractions.map(lambda f: "1" if f == 1 else repr(f)), st.integers(64, 4096).map(lambda n: f"{n}rows"))),
    st.tuples(st.just("demote"), st.sampled_from(SELECTORS), st.sampled_from(["turbo1", "turbo2", "none"])),
), max_size=3).map(tuple)

#: one strategy per Policy field: a field the grammar gains must be drawn here too (test_every_field_is_drawn)
FIELDS = {
    "k": st.sampled_from(KEPT + K_ONLY), "v": st.sampled_from(KEPT),
    "sink": st.integers(0, 16), "recent": st.integers(0, 64), "srecent": st.integers(-1, 64),
    "protect": st.sampled_from(["", *SELECTORS]), "overrides": overrides,
    "bypass": st.sampled_from(BYPASS_CHOICES), "sliding": st.sampled_from(SLIDING_CHOICES),
    "rotation": st.sampled_from(ROTATION_CHOICES), "center": st.booleans(), "vcenter": st.booleans(),
    "normfix": st.booleans(), "group": st.integers(1, 128), "kblock": st.integers(1, 128),
    "sparsev": st.one_of(st.just(0.0), st.floats(0, 0.5, allow_nan=False)), "seed": st.integers(-5, 2**31),
    "calib": st.sampled_from(["", "fits/smollm2.safetensors"]), "keep": keeps, "score": st.sampled_from(SCORES),
    "window": st.integers(1, 64), "chunk": st.integers(1, 16), "every": st.integers(0, 128),
    "demote": st.sampled_from(DEMOTES), "heads": st.sampled_from(HEAD_BUDGETS),
    "ada_floor": st.floats(0, 1, allow_nan=False), "budget": st.sampled_from(BUDGETS), "name": st.none(),
    "fitted_on": st.none(),
}


@st.composite
def policies(draw):
    """Valid policies over every key: drawn field by field, those the policy refuses (a demote tier of a policy
    that keeps every row, heads=ada over a per-head keep list, ...) drawn again."""
    for _ in range(50):
        kw = {name: draw(strategy) for name, strategy in FIELDS.items()}
        try:
            return Policy(**kw)
        except ValueError:
            continue
    return draw(st.nothing())


def test_every_field_is_drawn_and_written():
    fields = set(Policy.__dataclass_fields__)
    assert set(FIELDS) == fields
    assert set(_WRITTEN) | {"k", "v", "overrides", "name", "fitted_on"} == fields


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(policies())
def test_every_policy_round_trips_through_its_written_form(pol):
    text = pol.to_string()
    back = parse_compact(text)
    assert back == pol, text
    assert back.to_string() == text  # stable
    assert type(back.keep) is type(pol.keep)  # a row count stays a count, a fraction a fraction
    assert Policy.from_dict(json.loads(json.dumps(pol.to_dict()))) == pol


@pytest.mark.parametrize("a,b", [("turbo4,keep=1", "turbo4,keep=1.0"), ("turbo4,keep=0.5|1", "turbo4,keep=0.5|1.0"),
                                 ("turbo4,keep@3-5=1", "turbo4,keep@3-5=1.0")])
def test_keep_1_is_every_row(a, b):
    assert parse_policy(a) == parse_policy(b) and parse_policy(a).to_string() == parse_policy(b).to_string()


def test_a_row_count_is_never_a_fraction():
    one = Policy(k="turbo4", v="turbo4", keep=Rows(36), sink=4, recent=16)
    assert one != Policy(k="turbo4", v="turbo4", keep=36 / 100, sink=4, recent=16)
    assert Rows(1) != 1.0 and Rows(1) != 1 and hash(Rows(5)) == hash(Rows(5))
    assert one.to_string().endswith("keep=36rows") and parse_policy(one.to_string()) == one
    assert parse_policy("turbo4,keep=1").label == "turbo4"  # keys that change nothing leave the preset's name


@pytest.mark.parametrize("text,msg", [
    ("turbo4,keep=2", "keep=2 is ambiguous: write keep=2rows for a row count per KV head or keep=0.5 for a fraction"),
    ("turbo4,keep=512", "keep=512 is ambiguous: write keep=512rows"),
    ("turbo4,keep@3-5=512", "keep=512 is ambiguous"),
    ("turbo4,keep=8rows", r"keep=8rows is below the 36 rows every KV head keeps anyway \(sink=4 \+ max\(window=32, "
                          r"recent=16\)\): give keep=36rows or more"),
    ("turbo4,keep@0=20rows", "keep@0=20rows is below the 36 rows"),
    ("turbo4,keep=0rows", "a row count is a whole number >= 1 with its unit, e.g. 512rows"),
    ("turbo4,keep=0.5,keep=0.25", r"sets keep twice \(keep=0.5 and keep=0.25\): give each key once"),
    ("k=turbo4,k=turbo2", r"sets k twice \(k=turbo4 and k=turbo2\)"),
    ("kv=turbo4,v=turbo2", r"sets v twice \(kv=turbo4 and v=turbo2\)"),
    ("turbo4,v@0=int8,v@0=int4", "sets v@0 twice"),
])
def test_ambiguous_counts_and_repeated_keys_are_refused(text, msg):
    with pytest.raises(ValueError, match=msg):
        parse_policy(text)


def test_a_repeated_key_in_a_toml_file_is_refused_too(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('preset = "turbo4"\nkeep = 0.5\nkeep = 0.25\n')
    with pytest.raises(ValueError, match="p.toml"):
        parse_policy(str(path))
    path.write_text('preset = "turbo4"\nkeep = 512\n')
    with pytest.raises(ValueError, match="keep=512 is ambiguous"):
        parse_policy(str(path))
    path.write_text('preset = "turbo4"\nkeep = "512rows"\n')
    assert parse_policy(str(path)).keep == Rows(512)
