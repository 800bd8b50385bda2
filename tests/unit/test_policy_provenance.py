"""A saved policy carries the model it was fitted on (``Policy.fitted_on``): "fitted on another model" is
found whatever form the policy reaches the engine in, and the CLI shows it."""

from __future__ import annotations

import warnings

import pytest
from click.testing import CliRunner

from tqbench.cli.group import main
from tqbench.engine.policy import FittedOn, parse_policy, shipped_policy_path
from tqbench.engine.policy.artifact import artifact_warning_for

SHIPPED = "smollm2-alloc-2.5bit"
FITTED = ("this policy was fitted on SmolLM2-135M-Instruct (fingerprint fd81e99705258ac1), not on this model "
          "(fingerprint {fp}): its allocation may not suit it; allocate a policy for this model")


def fitting_artifact(tmp_path):
    """A policy file fitted on the default model whose layers also exist in the tiny model (no overrides)."""
    text = shipped_policy_path(SHIPPED).read_text(encoding="utf-8")
    model = text[text.index("[model]"):]
    path = tmp_path / "from-smollm2.toml"
    path.write_text('format = "tqbench-policy/1"\n\n[policy]\nk = "turbo3"\nv = "turbo2"\nsink = 4\n\n' + model,
                    encoding="utf-8")
    return path


def test_a_parsed_shipped_policy_carries_its_model():
    pol = parse_policy(SHIPPED)
    assert pol.fitted_on == FittedOn("SmolLM2-135M-Instruct", "fd81e99705258ac1", 30, 3, 64)
    assert parse_policy(str(shipped_policy_path(SHIPPED))).fitted_on == pol.fitted_on
    assert parse_policy("turbo4").fitted_on is None and parse_policy("k=turbo3,v=turbo2").fitted_on is None
    # provenance is not the policy's value: equal policies compare equal, and the forms do not carry it
    assert pol == parse_policy(pol.to_string()) and "fitted_on" not in pol.to_dict()


@pytest.mark.parametrize("form", ["name", "path", "parsed"])
def test_the_warning_arrives_whatever_form_the_policy_has(tiny_engine, form):
    policy = {"name": SHIPPED, "path": str(shipped_policy_path(SHIPPED)), "parsed": parse_policy(SHIPPED)}[form]
    assert tiny_engine.policy_warning(policy) == FITTED.format(fp=tiny_engine.loaded.fingerprint)
    assert artifact_warning_for(policy, geometry=tiny_engine.geometry) == (
        "this policy was fitted on SmolLM2-135M-Instruct (fingerprint fd81e99705258ac1) with 30 layers x 3 KV heads "
        "x head_dim 64, but this model has 4 x 2 x 16")
    # its layer selectors do not exist here: the refusal says which model it was fitted on
    with pytest.raises(ValueError, match=r"^layer index 12 is out of range for a model with 4 layers .*; this "
                                         r"policy was fitted on SmolLM2-135M-Instruct"):
        tiny_engine.check_policy(policy)


def test_make_cache_warns_once_for_a_parsed_policy(tiny_engine, tmp_path):
    pol = parse_policy(str(fitting_artifact(tmp_path)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = tiny_engine.make_cache(pol)
    assert [str(w.message) for w in caught] == [FITTED.format(fp=tiny_engine.loaded.fingerprint)]
    assert cache.policy_warning == str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tiny_engine.make_cache(parse_policy("k=turbo3,v=turbo2,sink=4")).policy_warning is None


def _cli(*args):
    return CliRunner().invoke(main, ["--headless", *args, "--model", "tiny", "--max-new-tokens", "3"])


@pytest.mark.parametrize("command", [["bench", "--kv-policy"], ["validate", "--candidate"]])
def test_cli_shows_the_warning_for_the_shipped_artifact(command, tiny_engine):
    r = _cli(*command, str(shipped_policy_path(SHIPPED)))
    warning = FITTED.format(fp=tiny_engine.loaded.fingerprint)
    assert r.exit_code == 2
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert f"warning: {warning}" in lines
    assert lines[-1].startswith("error: layer index 12 is out of range") and lines[-1].endswith(warning)


@pytest.mark.parametrize("command", [["bench", "--kv-policy"], ["validate", "--candidate"]])
def test_cli_shows_the_warning_and_runs_a_policy_that_fits(command, tiny_engine, tmp_path):
    r = _cli(*command, str(fitting_artifact(tmp_path)), "--json")
    assert r.exit_code in (0, 1), r.stderr  # validate may gate on the verdict; the run itself went through
    assert f"warning: {FITTED.format(fp=tiny_engine.loaded.fingerprint)}" in r.stderr.splitlines()
    assert r.stdout.lstrip().startswith("{")  # --json stdout stays one JSON object


def test_no_warning_for_a_preset(tiny_engine):
    r = _cli("bench", "--kv-policy", "turbo4")
    assert r.exit_code == 0 and "warning" not in r.stderr


def test_a_validation_checks_each_policy_once(tiny_engine, tmp_path, monkeypatch):
    """The fitted-on-another-model check runs once per policy at the door (``Engine.check_policy``); the runs
    and caches of a validation, a comparison and a teacher-forced run take the ``CheckedPolicy`` as it is."""
    from tqbench.engine import CheckedPolicy
    from tqbench.engine.validate import compare_policies, teacher_forced_quality, validate

    path = str(fitting_artifact(tmp_path))
    calls = []
    real = FittedOn.warning
    monkeypatch.setattr(FittedOn, "warning", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validate(tiny_engine, "Hello", "fp16", path, max_new_tokens=3)
        assert len(calls) == 1
        compare_policies(tiny_engine, [path], ["Hello", "Bye"], max_new_tokens=2)
        assert len(calls) == 2  # one more check for the comparison, whatever its cells
        teacher_forced_quality(tiny_engine, [path], prompt="Hello", max_new_tokens=3)
        assert len(calls) == 3
    assert {str(w.message) for w in caught} == {FITTED.format(fp=tiny_engine.loaded.fingerprint)}
    checked = tiny_engine.check_policy(path)
    assert isinstance(checked, CheckedPolicy) and tiny_engine.check_policy(checked) is checked
    assert tiny_engine.policy_warning(checked) == checked.warning and len(calls) == 4
    assert tiny_engine.make_cache(checked).policy_warning == checked.warning and len(calls) == 4
    r = _cli("validate", "--candidate", path, "--json")  # the CLI's door shows the warning and checks it once
    assert f"warning: {checked.warning}" in r.stderr.splitlines() and len(calls) == 5


def test_a_checked_policy_carries_its_plan_to_the_cache(tiny_engine, monkeypatch):
    """``Engine.check_policy`` plans once; a cache made from the ``CheckedPolicy`` takes that plan (issue 42)."""
    from tqbench.engine.policy import Policy

    checked = tiny_engine.check_policy("turbo4,keep=0.5,kv@0=int8")
    calls = []
    real = Policy.plan
    monkeypatch.setattr(Policy, "plan", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    cache = tiny_engine.make_cache(checked)
    assert calls == [] and cache.plans == list(checked.plans) and cache.plans[0].k == "int8"
    assert checked.plans_for(2, None) == real(checked.policy, 2, None)  # other layers: planned for them
