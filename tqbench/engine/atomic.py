"""One way to write a file so a crash never leaves half of it: a temp file in the same folder, fsync,
``os.replace``. Every writer of a file a user keeps uses it: saved sessions and kept policies (``tqbench.sessions``),
sweep results (``engine.sweep.store``), policy artifacts, calibrated transforms, allocate's partial results and the
CLI's ``--report-json`` / ``--report-md``."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def check_output_path(path: str | os.PathLike, suffix: str, what: str) -> Path:
    """``path`` as a Path when it ends in ``suffix`` and its folder exists; else ValueError saying what to do."""
    path = Path(path)
    if path.suffix != suffix:
        raise ValueError(f"{what} {str(path)!r} must end in {suffix}")
    if not path.parent.is_dir():
        raise ValueError(f"folder {str(path.parent)!r} does not exist: create it or pick another path")
    return path


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
