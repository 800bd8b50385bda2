import json

import pytest

from tqbench.engine.policy import PRESET_TEXT, PRESETS, Policy, get_preset, parse_policy

SEED_PRESETS = [
    "fp16", "fp16k-q8v", "boundary-fp16-fp16k-q8v", "boundary-fp16-q8k-q8v", "q8k-q8v", "fp16k-int4v",
    "q8k-int4v", "fp16k-int4v-last8-fp16", "q8k-int4v-last8-q8v", "fp16k-int4v-boundary-last", "q8k-turbo4v",
]


def test_registry_has_seed_and_turbo_presets():
    for name in SEED_PRESETS + ["turbo2", "turbo2.5", "turbo3", "turbo3.5", "turbo4", "k4v2", "turbo4-qjl"]:
        assert name in PRESETS


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_round_trips_through_text_and_dict(name):
    pol = get_preset(name)
    assert parse_policy(pol.to_string()) == pol
    assert Policy.from_dict(json.loads(json.dumps(pol.to_dict()))) == pol
    assert pol.label == name


def test_compact_form_parses_every_field():
    pol = parse_policy("k=turbo4,v=turbo3,sink=4,recent=32,protect=first2+last2,rotation=hadamard,center=off")
    assert (pol.k, pol.v, pol.sink, pol.recent, pol.protect) == ("turbo4", "turbo3", 4, 32, "first2+last2")
    assert pol.rotation == "hadamard" and pol.center is False
    assert parse_policy("kv=int4").k == "int4" and parse_policy("kv=int4").v == "int4"


def test_preset_prefix_with_modifications():
    pol = parse_policy("turbo4,recent=64")
    assert pol.k == "turbo4" and pol.recent == 64 and pol.sink == 4


def test_seed_preset_meanings_per_layer():
    plan = get_preset("boundary-fp16-q8k-q8v").plan(30)
    assert [p.k for p in plan[:2]] == ["fp16", "fp16"] and [p.k for p in plan[-2:]] == ["fp16", "fp16"]
    assert all(p.k == "int8" and p.v == "int8" for p in plan[2:-2])
    plan = get_preset("q8k-int4v-last8-q8v").plan(30)
    assert all(p.v == "int8" and p.k == "int8" for p in plan[22:])
    assert all(p.v == "int4" for p in plan[:22])
    plan = get_preset("fp16k-int4v-last8-fp16").plan(30)
    assert all(p.v == "fp16" for p in plan[22:]) and all(p.v == "int4" for p in plan[:22])
    plan = get_preset("fp16k-int4v-boundary-last").plan(30)
    assert [p.v for p in plan[-3:]] == ["int4", "fp16", "fp16"]


def test_negative_and_explicit_layer_indices_and_reasons():
    plan = parse_policy("k=turbo3,v=turbo3,protect=0+-1,v@5-6=int8").plan(8)
    assert plan[0].k == "fp16" and plan[7].k == "fp16" and "protected" in plan[7].reason
    assert plan[5].v == "int8" and plan[5].k == "turbo3" and "override" in plan[5].reason
    assert plan[3].reason is None


def test_sliding_layers_keep_bounded_window_and_global_bypass():
    types = ["sliding_attention", "full_attention"] * 2
    plan = parse_policy("kv=turbo4,bypass=global").plan(4, types)
    assert plan[0].dense_window and "sliding" in plan[0].reason
    assert plan[1].k == "fp16" and "global" in plan[1].reason
    plan = parse_policy("kv=turbo4").plan(4, types)
    assert plan[1].k == "turbo4" and plan[1].reason is None


@pytest.mark.parametrize(
    "text, needle",
    [
        ("k=turbo9", "unknown K codec 'turbo9': valid codecs are"),
        ("k=turbo4,v=int3", "unknown V codec 'int3'"),
        ("k=turbo4,foo=1", "unknown policy key 'foo'"),
        ("k=turbo4,sink=-1", "sink=-1 is invalid"),
        ("k=turbo4,sink=abc", "sink must be a whole number"),
        ("k=turbo4,protect=middle3", "bad layer selector part 'middle3'"),
        ("k=turbo4,rotation=dct", "rotation='dct' is invalid: valid choices are qr, hadamard"),
        ("k=turbo4,bypass=sometimes", "bypass='sometimes' is invalid"),
        ("turbo5", "unknown policy preset 'turbo5': valid presets are"),
        ("k=turbo4,center=maybe", "center must be on or off"),
        ("k=turbo4,x@3=int8", "override must start with"),
    ],
)
def test_bad_policy_text_names_the_bad_part(text, needle):
    with pytest.raises(ValueError) as err:
        parse_policy(text)
    assert needle in str(err.value)


def test_unknown_layer_index_is_an_error():
    with pytest.raises(ValueError, match="layer index 40 is out of range for a model with 30 layers"):
        parse_policy("kv=int8,protect=40").plan(30)


def test_policy_files(tmp_path):
    p = tmp_path / "mine.json"
    p.write_text(json.dumps({"k": "turbo4", "v": "turbo2", "sink": 4, "recent": 16}))
    pol = parse_policy(str(p))
    assert pol.v == "turbo2" and pol.recent == 16 and pol.label == "mine"
    t = tmp_path / "other.toml"
    t.write_text('[policy]\npreset = "turbo3"\nrecent = 8\n')
    pol = parse_policy(str(t))
    assert pol.k == "turbo3" and pol.recent == 8
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_policy(str(bad))
    with pytest.raises(ValueError, match="does not exist"):
        parse_policy(str(tmp_path / "missing.json"))


def test_preset_meanings_are_documented():
    assert all(meaning for _, meaning in PRESET_TEXT.values())


def test_shipped_allocation_policies_load_by_name_and_fit_their_budget():
    from tqbench.engine.cache.estimate import KVGeometry, estimate_kv

    for name, budget in (("smollm2-alloc-3.5bit", 3.5), ("smollm2-alloc-2.5bit", 2.5)):
        pol = parse_policy(name)
        assert pol.label == name and pol.overrides
        assert estimate_kv(pol, KVGeometry(30, 3, 64), 1280).bits_per_element <= budget


def test_corpus_texts_are_shipped_and_bad_names_are_clear(tiny_engine):
    from tqbench.engine.validate import corpus_ids

    assert corpus_ids(tiny_engine.tokenizer, "bread", 300).shape == (1, 300)
    with pytest.raises(ValueError, match="unknown corpus text 'soup': shipped texts are bread, lighthouses, rivers"):
        corpus_ids(tiny_engine.tokenizer, "soup", 10)
