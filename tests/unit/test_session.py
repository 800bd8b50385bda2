"""Session files: exact round trip, atomic writes, clear errors for corrupt / newer files, no pickle."""

import json
import os

import pytest

from tqbench.engine.events import CacheBytes, GenerationFinished
from tqbench.engine.scan import ScanResult
from tqbench.sessions import (
    RunRecorder,
    Session,
    SessionError,
    diff_runs,
    list_sessions,
    read_header,
    session_dir,
)

SAMPLING = {"temperature": 0.0, "top_p": 1.0, "seed": 0}


@pytest.fixture(scope="module")
def record(tiny_engine):
    rec = RunRecorder("hello there", True, 12, SAMPLING)
    for ev in tiny_engine.lockstep("hello there", "fp16", "turbo2", max_new_tokens=12, track_bytes=True):
        rec(ev)
    return rec.record


@pytest.fixture(scope="module")
def session(tiny_engine, record):
    return Session(model=Session.model_info(tiny_engine, "tiny"), runs=[record], policies={"mine": "k=turbo3,v=int4"},
                   scans=[ScanResult(capture={"prompt_tokens": 2}, layers=[0], kv_heads=2, codecs=["turbo4"],
                                     codec_bits={"turbo4": 4.25}, thresholds={"softmax_kl": 0.01},
                                     metrics={"k_error": {"turbo4": [[0.1, 0.2]]}}, seconds=1.5,
                                     verdicts=[{"layer": 0, "passing": ["turbo4"], "cheapest": "turbo4",
                                                "verdict": "ok", "worst_kl": {"turbo4": 0.002}}])])


def test_recorder_matches_a_direct_lockstep(tiny_engine, record):
    base = tiny_engine.generate("hello there", "fp16", max_new_tokens=12)
    cand = tiny_engine.generate("hello there", "turbo2", max_new_tokens=12)
    assert record.baseline.token_ids == base.token_ids
    assert record.candidate.token_ids == cand.token_ids
    assert record.same_token == [a == b for a, b in zip(base.token_ids, cand.token_ids)]
    assert record.first_divergence == next(i for i, (a, b) in enumerate(zip(base.token_ids, cand.token_ids)) if a != b)
    # step 0 comes from the prefill over exact K/V in both runs (KL 0); every later step reads 2-bit K/V
    assert len(record.kl) == 12 and record.kl[0] == 0.0 and all(k > 1e-4 for k in record.kl[1:]), record.kl
    assert len(record.candidate.resident_bytes) == 12 and record.candidate.resident_bytes == sorted(
        record.candidate.resident_bytes)
    assert record.candidate.cache_report["kv_policy"] == "turbo2"


def test_track_bytes_ends_at_the_final_report(tiny_engine):
    events = list(tiny_engine.stream("hi", "turbo4", max_new_tokens=6, track_bytes=True))
    cb = [e for e in events if isinstance(e, CacheBytes)]
    rep = next(e for e in events if isinstance(e, GenerationFinished)).result.cache_report
    assert [e.step for e in cb] == list(range(6))
    # the last token is never fed back, so the cache after the last step holds what the report counts
    assert cb[-1].storage_bytes == rep.compressed_storage_bytes
    assert cb[-1].tokens == rep.tokens


def test_round_trip_is_exact(tmp_path, session, record):
    path = session.save(tmp_path / "run1")
    assert path.name == "run1.json" and (tmp_path / "run1.safetensors").is_file()
    back = Session.load(path)
    r = back.runs[0]
    for side in ("baseline", "candidate"):
        a, b = getattr(record, side), getattr(r, side)
        assert b.token_ids == a.token_ids
        assert b.text == a.text
        assert b.token_texts == a.token_texts and len(b.token_texts) == len(b.token_ids)
        assert b.step_seconds == a.step_seconds
        assert b.resident_bytes == a.resident_bytes
        assert b.cache_report == a.cache_report
    assert r.same_token == record.same_token and r.same_top1 == record.same_top1 and r.kl == record.kl
    assert back.model == session.model and back.model["fingerprint"] == "821ced01b71c0e55"
    assert back.policies == {"mine": "k=turbo3,v=int4"} and back.scans == session.scans
    assert json.loads(path.read_text())["scans"] == json.loads(json.dumps([session.scans[0].to_dict()]))
    assert diff_runs(record, r).identical


def test_files_are_json_and_safetensors_not_pickle(tmp_path, session):
    path = session.save(tmp_path / "s.json")
    doc = json.loads(path.read_text())
    assert doc["format"] == "tqbench-session" and doc["version"] == 2
    assert doc["runs"][0]["summary"]["first_divergence"] == session.runs[0].first_divergence
    raw = (tmp_path / "s.safetensors").read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + header_len])
    assert header["runs.0.candidate.token_ids"]["dtype"] == "I64"
    assert b"\x80\x04" not in raw[:2] and b"pickle" not in raw


def test_writes_are_atomic(tmp_path, session, monkeypatch):
    path = session.save(tmp_path / "a.json")
    before = path.read_bytes()

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        session.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "a.safetensors"]  # no temp files left


def test_corrupt_json_gives_a_clear_error(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('{"format": "tqbench-session", "vers')
    with pytest.raises(SessionError) as exc:
        Session.load(p)
    assert str(exc.value) == "session bad.json is corrupt (not valid JSON): it cannot be opened"


def test_newer_version_gives_a_clear_error(tmp_path, session):
    path = session.save(tmp_path / "new.json")
    doc = json.loads(path.read_text())
    doc["version"] = 99
    path.write_text(json.dumps(doc))
    with pytest.raises(SessionError) as exc:
        Session.load(path)
    assert str(exc.value) == ("session new.json was written by a newer tqbench (format version 99; this one reads "
                              "up to 2): upgrade tqbench to open it")


def test_changed_arrays_are_detected(tmp_path, session):
    path = session.save(tmp_path / "x.json")
    arr = tmp_path / "x.safetensors"
    data = bytearray(arr.read_bytes())
    data[-1] ^= 0xFF
    arr.write_bytes(bytes(data))
    with pytest.raises(SessionError, match="x.safetensors does not match the session"):
        Session.load(path)
    arr.unlink()
    with pytest.raises(SessionError, match="its arrays file x.safetensors is missing"):
        Session.load(path)


def test_not_a_session(tmp_path):
    p = tmp_path / "other.json"
    p.write_text('{"a": 1}')
    with pytest.raises(SessionError, match='other.json is not a tqbench session'):
        read_header(p)
    with pytest.raises(SessionError, match="does not exist"):
        read_header(tmp_path / "nope.json")


def test_session_dir_and_listing(tmp_path, session, monkeypatch):
    monkeypatch.setenv("TQBENCH_DATA_DIR", str(tmp_path / "data"))
    assert session_dir() == tmp_path / "data" / "sessions"
    assert session_dir(tmp_path / "elsewhere") == tmp_path / "elsewhere"
    session.save(session_dir() / "good.json")
    (session_dir() / "broken.json").write_text("{")
    entries = {e.path.name: e for e in list_sessions()}
    assert entries["good.json"].error is None and entries["good.json"].runs == 1
    assert entries["good.json"].model == "tiny-random"
    assert "corrupt" in entries["broken.json"].error


def test_diff_reports_the_first_changed_token(record):
    import copy

    other = copy.deepcopy(record)
    other.candidate.token_ids[5] += 1
    d = diff_runs(record, other)
    assert not d.identical
    assert d.sides["candidate"]["first_difference"] == 5 and d.sides["baseline"]["identical"]
    assert d.describe() == "baseline: identical (12 tokens); candidate: differs from token 5 (12 saved, 12 now)"


def test_kept_policies_round_trip_and_a_bad_file(tmp_path, monkeypatch):
    from tqbench.sessions import load_kept_policies, save_kept_policies

    monkeypatch.setenv("TQBENCH_DATA_DIR", str(tmp_path))
    assert load_kept_policies() == {}
    save_kept_policies({"mine": "k=turbo3,v=int4"})
    assert load_kept_policies() == {"mine": "k=turbo3,v=int4"}
    (tmp_path / "policies.json").write_text("[1, 2]")
    with pytest.raises(SessionError) as exc:
        load_kept_policies()
    assert str(exc.value) == f"{tmp_path / 'policies.json'} is not a {{name: policy}} object: fix or delete it"


def test_saving_over_a_session_keeps_one_backup_and_never_replaces_another_file(tmp_path, session):
    """The overwrite rule every front end follows (``sessions.store.keep_backup``)."""
    path = session.save(tmp_path / "s.json")
    assert session.backup is None
    first = json.loads(path.read_text())
    session.save(path)  # over a session: the previous version is kept, and opens as it was
    assert session.backup == tmp_path / "s.bak.json"
    kept = json.loads((tmp_path / "s.bak.json").read_text())
    assert kept["arrays"]["file"] == "s.bak.safetensors" and kept["saved"] == first["saved"]
    assert Session.load(tmp_path / "s.bak.json").runs[0].candidate.token_ids == session.runs[0].candidate.token_ids
    assert Session.load(path).policies == session.policies
    other = tmp_path / "notes.json"
    other.write_text('{"mine": true}')
    with pytest.raises(SessionError, match=r"notes.json exists and is not a tqbench session \(.*\): it is not "
                                           r"overwritten; give another file name"):
        session.save(other)
    assert other.read_text() == '{"mine": true}' and not (tmp_path / "notes.safetensors").exists()


def test_task_suite_results_are_saved_and_reopened(tmp_path, session):
    import dataclasses

    from tqbench.engine.tasks.suite import TasksResult

    sample = {"task": "niah_single", "index": 0, "prompt_tokens": 900, "references": ["7"], "baseline_answer": "7",
              "candidate_answer": "8", "baseline_score": 1.0, "candidate_score": 0.0, "agree": False,
              "baseline_compression_ratio": 1.0, "candidate_compression_ratio": 3.5}
    res = TasksResult("tiny", 1024, 0, "fp16", "turbo2", "compressed", 1, ["niah_single"], [sample], 1)
    with_tasks = dataclasses.replace(session, tasks=[res])
    back = Session.load(with_tasks.save(tmp_path / "t.json"))
    assert [t.to_dict() for t in back.tasks] == [res.to_dict()]
    assert back.tasks[0].task_row(None)["delta"] == -100.0
    assert Session.load(session.save(tmp_path / "none.json")).tasks == []


def test_long_policies_get_distinct_session_names(tmp_path, session, record):
    import dataclasses

    from tqbench.sessions.store import new_session_path

    def named(policy):
        rec = dataclasses.replace(record, candidate=dataclasses.replace(record.candidate, policy=policy))
        return new_session_path(dataclasses.replace(session, runs=[rec]), tmp_path).name[16:]  # after the time

    a = named("k=turbo4,v=turbo4,sink=4,recent=16,keep=0.5,score=snapkv")
    b = named("k=turbo4,v=turbo4,sink=4,recent=16,keep=0.5,score=tova")
    assert a != b and len(a) == len(b) == 40 + len(".json")
    assert named("turbo4") == "turbo4.json"


def test_save_session_flag_refuses_another_file_before_any_work_and_keeps_a_backup(tmp_path, session):
    from click.testing import CliRunner

    from tqbench.cli import main

    other = tmp_path / "notes.json"
    other.write_text("[1, 2]")
    r = CliRunner().invoke(main, ["--headless", "bench", "--model", "no-such-model", "--save-session", str(other)])
    assert r.exit_code == 2 and r.stderr.startswith(f"error: --save-session {other}: that file exists and is not "
                                                    "a tqbench session (")  # before the model (a bad one) loads
    assert other.read_text() == "[1, 2]"
    path = session.save(tmp_path / "mine.json")
    r = CliRunner().invoke(main, ["--headless", "bench", "--model", "tiny", "--max-new-tokens", "2", "--threads", "1",
                                  "--save-session", str(path)])
    assert r.exit_code == 0, r.output
    assert f"session saved to {path} (the previous version kept as {tmp_path / 'mine.bak.json'})" in r.stderr
    assert Session.load(tmp_path / "mine.bak.json").policies == session.policies
