"""``pid_lock``: an OS lock (``flock``) on a file in a build folder that records its holder's pid, for every
tqbench builder (the native kernel, llama.cpp). The OS drops it however the holder ends, so a killed build never
leaves a lock behind; a process that finds it held says once that it waits, and for which pid."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["pid_lock"]


def _holder(fd: int) -> str:
    """The pid the lock file's holder wrote into it ("?" when it has not yet)."""
    try:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        return "?"
    return text if text.isdigit() else "?"


@contextmanager
def pid_lock(path: Path, on_wait: Callable[[str], None]) -> Iterator[bool]:
    """Hold the lock on ``path`` (created, with its folder) for the block, writing this pid into it. When another
    live process holds it, ``on_wait(pid)`` is called once and this one waits. Yields False where the OS has no
    ``flock`` (Windows: nothing is held), else True."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - POSIX everywhere tqbench builds today
        yield False
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait(_holder(fd))
            fcntl.flock(fd, fcntl.LOCK_EX)  # returns when that process finishes or dies
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield True
    finally:
        os.close(fd)  # drops the flock
