"""The native kernel's build lock: torch waits forever on a lock file a killed build left behind; tqbench removes
one whose folder has not changed for a while (and says so), and waits for a live one."""

from __future__ import annotations

import os
import threading
import time

import pytest

from tqbench.kernels.cpu import wait_for_build_lock


def test_a_stale_lock_is_removed_and_reported(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    (tmp_path / "fused_attention.o").write_bytes(b"half a build")
    old = time.time() - 3600
    for p in tmp_path.iterdir():
        os.utime(p, (old, old))
    with pytest.warns(UserWarning, match="removed a stale native-kernel build lock"):
        note = wait_for_build_lock(tmp_path, stale_after=900)
    assert not lock.exists()
    assert note.startswith(f"removed a stale native-kernel build lock {lock}: nothing in its folder changed for 900 s")


def test_a_live_lock_is_waited_for_not_removed(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()  # fresh: another process is building
    released = threading.Event()

    def build_finishes():
        time.sleep(0.2)  # (the waiter polls; this only lets it start waiting first)
        lock.unlink()
        released.set()

    threading.Thread(target=build_finishes).start()
    assert wait_for_build_lock(tmp_path, stale_after=900, poll=0.01) is None
    assert released.wait(30)  # the lock went because its owner removed it, not because the waiter did


def test_no_lock_returns_at_once(tmp_path):
    assert wait_for_build_lock(tmp_path) is None
