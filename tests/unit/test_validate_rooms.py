"""The validate/ and scan/ rooms: each exports its public names, and the old module paths still used outside the
rooms give the very same objects (they go once every importer has switched)."""

from __future__ import annotations

import importlib

import pytest

import tqbench.engine.scan as scan_room
import tqbench.engine.validate as validate_room


@pytest.mark.parametrize("room", [validate_room, scan_room])
def test_the_room_exports_its_public_names(room):
    for name in room.__all__:
        assert getattr(room, name) is not None, name
    assert callable(room.__dict__.get("scan" if room is scan_room else "validate"))  # a function, not a submodule


@pytest.mark.parametrize("old, names", [
    ("tqbench.engine.validate.validation", ["self_test", "validate"]),
    ("tqbench.engine.validate.quality", ["baseline_logprobs", "corpus_ids", "teacher_forced"]),
    ("tqbench.engine.validate.compare", ["compare_policies", "default_policies"]),
    ("tqbench.engine.validate.niah", ["needle_in_haystack"]),
])
def test_old_import_paths_give_the_same_objects(old, names):
    module = importlib.import_module(old)
    room = scan_room if ".scan." in old else validate_room
    for name in names:
        assert getattr(module, name) is getattr(room, name), name


def test_one_step_record_builder_and_one_cancelled():
    from tqbench.engine import events, generate
    from tqbench.engine.validate import compare, steps, validation

    assert generate.Cancelled is events.Cancelled is validate_room.Cancelled is scan_room.Cancelled
    assert compare.step_record is validation.step_record is steps.step_record
