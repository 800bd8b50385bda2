"""``tqbench.engine`` is the front ends' one door: lazy (no torch on import) and every public name resolves."""

from __future__ import annotations

import subprocess
import sys

import pytest

import tqbench.engine as door

# Names whose room package (its __init__.py) must export them; the other names come from this area
# (engine.py, models/) or from top-level engine modules (generate.py, metrics.py).
OWNED_BY_OTHER_ROOMS = {
    "Policy": "tqbench.engine.policy",
    "parse_policy": "tqbench.engine.policy",
    "PRESETS": "tqbench.engine.policy",
    "get_preset": "tqbench.engine.policy",
    "TQCache": "tqbench.engine.cache",
    "CompressedDynamicCache": "tqbench.engine.cache",
    "KVGeometry": "tqbench.engine.cache",
    "estimate_kv": "tqbench.engine.cache",
    "run_validate": "tqbench.engine.validate",
    "self_test": "tqbench.engine.validate",
    "teacher_forced_quality": "tqbench.engine.validate",
    "compare_policies": "tqbench.engine.validate",
    "needle_in_haystack": "tqbench.engine.validate",
    "run_scan": "tqbench.engine.scan",
    "capture_qkv": "tqbench.engine.scan",
}


def test_importing_the_door_loads_no_torch():
    code = (
        "import sys, tqbench.engine as e; assert e.__all__; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_names_come_from_rooms_not_from_modules_inside_them():
    for name, (module, _) in door._LAZY.items():
        assert module.count(".") == 2, f"{name} comes from {module}: map it to its room package"
    for name, room in OWNED_BY_OTHER_ROOMS.items():
        assert door._LAZY[name][0] == room


@pytest.mark.parametrize("name", door.__all__)
def test_every_public_name_resolves(name):
    """Expected to pass once every room's ``__init__.py`` exports its names (see OWNED_BY_OTHER_ROOMS)."""
    import importlib

    module, attr = door._LAZY[name]
    assert getattr(door, name) is getattr(importlib.import_module(module), attr), f"{name} is not {module}.{attr}"
    assert name in dir(door)


def test_door_and_room_hand_out_the_same_object():
    from tqbench.engine.engine import Engine
    from tqbench.engine.models import load_model

    assert door.Engine is Engine and door.load_model is load_model


def test_unknown_and_unexported_names_are_clear_attribute_errors(monkeypatch):
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        door.nope  # noqa: B018
    monkeypatch.setitem(door._LAZY, "Missing", ("tqbench.engine.metrics", "not_there"))
    with pytest.raises(AttributeError, match=r"'tqbench.engine.metrics' does not export 'not_there'"):
        door.Missing  # noqa: B018
