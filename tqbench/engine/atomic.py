"""One way to write a file so a crash never leaves half of it: a temp file in the same folder, fsync,
``os.replace``. Every writer of a file a user keeps uses it: saved sessions and kept policies (``tqbench.sessions``),
sweep results (``engine.sweep.store``), policy artifacts, calibrated transforms, allocate's partial results and the
CLI's ``--report-json`` / ``--report-md``."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def check_output_path(path: str | os.PathLike, suffix: str | None = None, what: str = "output file", *,
                      folder: bool = False) -> Path:
    """The one rule for a path a job will write (checked before the work starts; messages name ``what``).

    A file: it ends in ``suffix`` (when given), is not an existing folder, and its folder exists and takes a new
    file (never created on the way: a typo must not become a folder). ``folder=True``, a folder the job fills
    (created when missing): it is not an existing file, and its nearest existing parent is a folder that takes a
    new entry. Returns ``path`` as a Path; a ValueError says what to do.
    """
    path = Path(path)
    shown = f"{what} {str(path)!r}"
    if suffix is not None and path.suffix != suffix:
        raise ValueError(f"{shown} must end in {suffix}")
    if folder:
        if path.exists() and not path.is_dir():
            raise ValueError(f"{shown} is a file, not a folder: give a folder path")
        parent = path if path.is_dir() else next(p for p in path.absolute().parents if p.exists())
        if not parent.is_dir():
            raise ValueError(f"{shown}: {str(parent)!r} is a file, not a folder: pick another path")
    else:
        if path.is_dir():
            raise ValueError(f"{shown} is a folder: give a file path inside it")
        parent = path.absolute().parent
        if not parent.is_dir():
            raise ValueError(f"{shown}: folder {str(parent)!r} does not exist: create it or pick another path")
    if not _takes_new_file(parent):
        raise ValueError(f"{shown}: folder {str(parent)!r} is not writable: pick another path")
    return path


def _takes_new_file(folder: Path) -> bool:
    """Whether a new file can be created in ``folder`` (tried, then removed: permission bits do not tell for root,
    read-only mounts or /proc)."""
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tqbench-write-check.", suffix=".tmp")
    except OSError:
        return False
    os.close(fd)
    os.unlink(tmp)
    return True


def atomic_write(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file in the same folder and ``os.replace``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
