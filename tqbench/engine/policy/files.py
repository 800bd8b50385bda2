"""A policy from a dict or a file (JSON / TOML, shipped by name), and ``parse_policy``: the one door that takes any
form (a ``Policy``, a preset or shipped name, a compact string, a file path)."""

from __future__ import annotations

import json
import os
from dataclasses import replace

from tqbench.engine.policy.checked import CheckedPolicy
from tqbench.engine.policy.grammar import get_preset, parse_compact
from tqbench.engine.policy.presets import PRESETS, shipped_policy_path
from tqbench.engine.policy.spec import FittedOn, Policy
from tqbench.engine.tomlfile import read_toml


def policy_from_dict(data: dict) -> Policy:
    """The dict form (a policy file's body): ``preset`` names the base the other fields change."""
    if "preset" in data:
        base = get_preset(data["preset"])
        return Policy.from_dict({k: v for k, v in data.items() if k != "preset"}, base=base)
    return Policy.from_dict(data)


_HOLDS = "a policy file holds one object with keys k, v, sink, recent, ... (or preset = a preset's name)"


def load_policy_file(path: str) -> Policy:
    fitted = None  # an artifact's [model] table: the model the policy was fitted on
    if path.endswith(".toml"):
        data = read_toml(path, "policy file")
        fitted = data.get("model") if "policy" in data else None
        data = data.get("policy", data)
    else:
        with open(path, "rb") as fh:
            raw = fh.read()
        if not raw.strip():
            raise ValueError(f"policy file {path} is empty: {_HOLDS}")
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"policy file {path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"policy file {path}: {_HOLDS}")
    if not data:  # nothing set: it would run as fp16 without a word
        raise ValueError(f"policy file {path} is empty: {_HOLDS}")
    try:
        pol = policy_from_dict(data)
    except ValueError as exc:  # a field's error, named with the file it came from
        raise ValueError(f"policy file {path}: {exc}") from None
    pol = replace(pol, fitted_on=FittedOn.from_dict(fitted if isinstance(fitted, dict) else None))
    beside = os.path.join(os.path.dirname(os.path.abspath(path)), pol.calib) if pol.calib else ""
    if pol.calib and not os.path.isabs(pol.calib) and os.path.isfile(beside):  # a transforms file next to it
        pol = replace(pol, calib=beside)
    return pol if pol.name else pol.with_name(os.path.splitext(os.path.basename(path))[0])


def parse_policy(text: str | Policy | CheckedPolicy) -> Policy:
    """A preset name, a compact string, or a path to a .json/.toml policy file (a ``CheckedPolicy``: its policy)."""
    if isinstance(text, CheckedPolicy):
        return text.policy
    if isinstance(text, Policy):
        return text
    text = text.strip()
    if text in PRESETS:
        return get_preset(text)
    if "," not in text and "=" not in text:
        shipped = shipped_policy_path(text)
        if shipped is not None:
            return load_policy_file(str(shipped))
    if text.endswith((".json", ".toml")):
        if not os.path.exists(text):
            raise ValueError(f"policy file {text!r} does not exist")
        return load_policy_file(text)
    return parse_compact(text)
