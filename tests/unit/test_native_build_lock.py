"""The native kernel's build lock and build folders.

Torch waits forever on a ``lock`` file a killed build left behind. Every tqbench builder holds an OS lock
(``flock``) on its build folder while it builds or loads, so the next builder knows at once whether torch's lock
belongs to a live build (wait, and say so) or to a dead one (remove it, and say so). Build folders are per install
(torch, interpreter), so two venvs never rebuild each other's kernel."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest

import tqbench.kernels.cpu as cpu
from tqbench.kernels.cpu import BUILDER_LOCK, build_name, builder_lock, cflags

# a builder in another process: takes the flock, writes its pid, creates torch's lock, says "ready", then waits for
# a line on stdin (finishing: removes torch's lock and exits) or is killed
_BUILDER = textwrap.dedent("""
    import fcntl, os, sys
    d = sys.argv[1]
    fd = os.open(os.path.join(d, %r), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    open(os.path.join(d, "lock"), "w").close()
    print("ready", flush=True)
    sys.stdin.readline()
    os.remove(os.path.join(d, "lock"))
""") % BUILDER_LOCK


def _start_builder(path):
    proc = subprocess.Popen([sys.executable, "-c", _BUILDER, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_a_lock_left_by_a_killed_build_is_removed_at_once(tmp_path):
    proc = _start_builder(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)  # a build killed mid-way: torch's lock stays behind
    proc.wait(30)
    assert (tmp_path / "lock").exists()
    t0 = time.monotonic()
    with pytest.warns(UserWarning, match="removed a stale native-kernel build lock"):
        with builder_lock(tmp_path) as note:
            assert not (tmp_path / "lock").exists()
    assert note.startswith(f"removed a stale native-kernel build lock {tmp_path / 'lock'}")
    assert time.monotonic() - t0 < 60  # (at once in practice: no age rule, no polling)


def test_a_live_build_is_waited_for_with_its_pid_and_its_lock_left_alone(tmp_path):
    proc = _start_builder(tmp_path)
    entered = threading.Event()
    seen: dict = {}

    def waiter():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with builder_lock(tmp_path) as note:
                seen["note"] = note
                seen["lock_after"] = (tmp_path / "lock").exists()
                entered.set()
        seen["warnings"] = [str(w.message) for w in caught]

    t = threading.Thread(target=waiter)
    t.start()
    assert not entered.wait(1.0)  # the live builder holds the folder
    assert (tmp_path / "lock").exists()  # and its lock is not touched
    proc.communicate("done\n", timeout=30)  # the build finishes: its lock goes, its flock with its process
    t.join(60)
    assert entered.is_set()
    assert seen["note"] is None and seen["lock_after"] is False
    waits = [w for w in seen["warnings"] if "waiting for another process's native-kernel build" in w]
    assert len(waits) == 1 and f"(pid {proc.pid})" in waits[0]


def test_no_lock_enters_at_once_and_records_the_holder(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with builder_lock(tmp_path) as note:
            assert note is None
            assert (tmp_path / BUILDER_LOCK).read_text().strip() == str(os.getpid())


def test_the_build_runs_past_a_stale_lock(tmp_path, monkeypatch):
    """``native_module``'s build path: a killed build's lock does not stop the next load."""
    import torch.utils.cpp_extension as ext

    proc = _start_builder(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    loaded = {}

    def fake_load(name, sources, **kw):
        loaded["lock"] = (tmp_path / "lock").exists()
        loaded["sources"] = sorted(os.listdir(tmp_path))
        return "module"

    monkeypatch.setattr(ext, "_get_build_directory", lambda name, verbose: str(tmp_path))
    monkeypatch.setattr(ext, "load", fake_load)
    monkeypatch.delenv(cpu.DISABLE_ENV, raising=False)
    with pytest.warns(UserWarning, match="removed a stale native-kernel build lock"):
        assert cpu._build() == "module"
    assert loaded["lock"] is False
    assert {s.name for s in cpu.SOURCES} <= set(loaded["sources"])  # every header beside the .cpp


def test_each_install_has_its_own_build_folder(monkeypatch):
    import torch

    flags = cflags()
    base = build_name(flags)
    assert build_name(flags) == base  # the same install: the same folder ("built once")
    monkeypatch.setattr(sys, "prefix", "/some/other/venv")
    other_prefix = build_name(flags)
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__file__", "/elsewhere/site-packages/torch/__init__.py")
    other_torch = build_name(flags)
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.0+other")
    other_version = build_name(flags)
    assert len({base, other_prefix, other_torch, other_version}) == 4


def test_every_source_file_is_hashed(monkeypatch, tmp_path):
    """Editing a header gives a new build folder (a rebuild), not a stale build of the old header."""
    flags = cflags()
    copies = []
    for src in cpu.SOURCES:
        dst = tmp_path / src.name
        dst.write_bytes(src.read_bytes())
        copies.append(dst)
    monkeypatch.setattr(cpu, "SOURCES", tuple(copies))
    before = cpu._source_tag(flags)
    header = next(p for p in copies if p.suffix == ".h")
    header.write_bytes(header.read_bytes() + b"\n// an edit\n")
    assert cpu._source_tag(flags) != before
