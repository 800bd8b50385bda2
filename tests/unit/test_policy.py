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
    plan = parse_policy("kv=turbo4,bypass=global,sliding=bypass").plan(4, types)
    assert plan[0].dense_window and "sliding" in plan[0].reason
    assert plan[1].k == "fp16" and "global" in plan[1].reason
    # the default (sliding=auto) compresses a mixed model's sliding layers too, in a window-bounded store
    plan = parse_policy("kv=turbo4,bypass=global").plan(4, types)
    assert plan[0].sliding and not plan[0].dense_window and plan[0].k == "turbo4" and plan[0].reason is None
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


# -- a TOML file that does not parse is named, with its line --------------------------------------------------------
def test_a_policy_toml_that_does_not_parse_names_the_file_and_line(tmp_path):
    bad = tmp_path / "mine.toml"
    bad.write_text('[policy]\nk = "turbo4"\nv turbo2\n', encoding="utf-8")
    with pytest.raises(ValueError) as err:
        parse_policy(str(bad))
    assert str(err.value) == (f"policy file {bad}:3:3: not valid TOML: Expected '=' after a key in a key/value pair "
                              "(line 3 reads 'v turbo2')")
    assert (err.value.path, err.value.line) == (str(bad), 3)
    from click.testing import CliRunner

    from tqbench.cli import main

    res = CliRunner().invoke(main, ["--headless", "kv-estimate", "--kv-policy", str(bad)])
    assert res.exit_code != 0
    assert f"policy file {bad}:3:3: not valid TOML: Expected '=' after a key" in res.output


def test_every_toml_input_names_its_file(tmp_path):
    """Policy artifacts, sweep specs, unreadable bytes, a truncated file, a policy field's error, and a calibrated
    transforms file whose metadata does not parse: each error says which file."""
    from tqbench.engine.policy.artifact import is_policy_artifact, load_policy_artifact
    from tqbench.engine.sweep.spec import SpecError, load_spec

    bad = tmp_path / "alloc.toml"
    bad.write_text('format = "tqbench-policy/1"\n[model\nname = "x"\n', encoding="utf-8")
    assert not is_policy_artifact(bad)  # (loading it says why)
    with pytest.raises(ValueError, match=rf"^policy file {bad}:2:7: not valid TOML: .*\(line 2 reads '\[model'\)$"):
        load_policy_artifact(bad)
    spec = tmp_path / "sweep.toml"
    spec.write_text('models = ["tiny"]\npolicies = [\n', encoding="utf-8")
    with pytest.raises(SpecError, match=rf"^sweep spec {spec}:3: not valid TOML: Invalid value at the end of the file$"):
        load_spec(spec)
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b'k = "caf\xe9"\n')
    with pytest.raises(ValueError, match=rf"^policy file {latin}: not UTF-8 text \(byte 8\): save it as UTF-8$"):
        parse_policy(str(latin))
    field = tmp_path / "field.toml"
    field.write_text('k = "turbo9"\n', encoding="utf-8")
    with pytest.raises(ValueError, match=rf"^policy file {field}: .*turbo9"):
        parse_policy(str(field))


def test_a_transforms_file_with_broken_metadata_names_the_file(tmp_path):
    import torch
    from safetensors.torch import save_file

    from tqbench.engine.codecs.transforms_file import FORMAT, TransformsMismatch, load_transforms

    path = tmp_path / "t.safetensors"
    fields = [f"{r}.{n}" for r in "kv" for n in ("basis", "scale", "var", "levels", "mse")]
    meta = {"format": FORMAT, "model": "m", "fingerprint": "f", "num_layers": "two", "kv_heads": "1",
            "head_dim": "4"}
    save_file({n: torch.zeros(1) for n in fields}, str(path), metadata=meta)
    with pytest.raises(TransformsMismatch, match=rf"^{path}: its metadata does not parse \(invalid literal"):
        load_transforms(str(path))
    del meta["num_layers"]
    save_file({n: torch.zeros(1) for n in fields}, str(path), metadata=meta)
    load_transforms.cache_clear()
    with pytest.raises(TransformsMismatch, match=rf"^{path}: its metadata lacks 'num_layers'"):
        load_transforms(str(path))
