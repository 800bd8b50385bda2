"""Format version 2 keeps each token's text; a version-1 file (written by the version-1 code, checked in under
data/) still opens, its texts rebuilt with the model's tokenizer, and saves again as version 2."""

import json
import shutil
from pathlib import Path

import pytest

from tqbench.sessions import VERSION, RunRecorder, Session, migrate, restore_token_texts, save_session

V1 = Path(__file__).parent / "data" / "session-v1.json"
SAMPLING = {"temperature": 0.0, "top_p": 1.0, "seed": 0}


@pytest.fixture(scope="module")
def record(tiny_engine):
    rec = RunRecorder("hello there", True, 8, SAMPLING)
    for ev in tiny_engine.lockstep("hello there", "fp16", "turbo2", max_new_tokens=8):
        rec(ev)
    return rec.record


def test_the_fixture_is_a_version_1_file():
    doc = json.loads(V1.read_text())
    assert doc["version"] == 1 and VERSION == 2
    assert "token_texts" not in doc["runs"][0]["candidate"] and "token_texts" not in doc["runs"][0]["baseline"]


def test_a_version_1_session_still_opens():
    s = Session.load(V1)
    r = s.runs[0]
    assert r.baseline.token_ids == [242, 112, 73, 118, 193, 123, 257, 224]
    assert r.candidate.token_ids == [242, 112, 130, 221, 128, 186, 37, 96]
    assert r.same_token == [True, True] + [False] * 6 and r.first_divergence == 2
    assert len(r.kl) == 8 and r.kl[0] == 0.0
    assert r.candidate.policy == "turbo2" and r.candidate.cache_report["kv_policy"] == "turbo2"
    assert s.model["spec"] == "tiny" and s.policies == {"mine": "k=turbo3,v=int4"} and s.title == "v1 fixture"
    # no texts per token in version 1: the workbench rebuilds them once the model's tokenizer is there
    assert r.candidate.token_texts == [] and not r.candidate.has_token_texts and not s.has_token_texts


def test_migrate_fills_what_version_1_lacks():
    doc = migrate(json.loads(V1.read_text()))
    assert doc["version"] == VERSION and doc["runs"][0]["candidate"]["token_texts"] == []


def test_version_1_texts_are_rebuilt_and_saved_as_version_2(tmp_path, tiny_engine):
    shutil.copy(V1, tmp_path / V1.name)
    shutil.copy(V1.with_suffix(".safetensors"), tmp_path / V1.with_suffix(".safetensors").name)
    s = Session.load(tmp_path / V1.name)
    assert restore_token_texts(s.runs, tiny_engine.tokenizer) == 2
    assert restore_token_texts(s.runs, tiny_engine.tokenizer) == 0  # nothing left to rebuild
    for side in s.runs[0].sides:
        assert len(side.token_texts) == len(side.token_ids) and "".join(side.token_texts) == side.text
    path = save_session(s, tmp_path / V1.name)
    doc = json.loads(path.read_text())
    assert doc["version"] == 2 and doc["runs"][0]["candidate"]["token_texts"] == s.runs[0].candidate.token_texts
    back = Session.load(path)
    assert back.has_token_texts and back.runs[0].baseline.token_texts == s.runs[0].baseline.token_texts


def test_version_2_keeps_the_streamed_texts(tmp_path, tiny_engine, record):
    for side in record.sides:  # the pieces the live view showed, one per token
        assert len(side.token_texts) == len(side.token_ids) and "".join(side.token_texts) == side.text
    back = Session.load(save_session(Session(runs=[record]), tmp_path / "a.json"))
    assert back.has_token_texts
    for a, b in zip(record.sides, back.runs[0].sides):
        assert b.token_texts == a.token_texts


def test_save_session_names_a_new_file_and_records_the_machine(tmp_path, tiny_engine, record):
    s = Session(runs=[record])
    path = save_session(s, directory=tmp_path, engine=tiny_engine, model_spec="tiny")
    assert path.parent == tmp_path and path.name.endswith("-turbo2.json")
    doc = json.loads(path.read_text())
    assert doc["model"]["spec"] == "tiny" and doc["model"]["fingerprint"] == tiny_engine.loaded.fingerprint
    assert doc["environment"]["device"] == "cpu" and doc["environment"]["torch"]
    assert save_session(s, path) == path  # saving again writes the same file
