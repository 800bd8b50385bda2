"""What every benchmark script records about the machine, and how it writes its JSON (scripts import this
as ``_common``: ``python benchmarks/X.py`` puts this folder first on ``sys.path``)."""

from __future__ import annotations

import json
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (``platform.processor()`` is often empty on Linux)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def write_json(path: str | Path, payload: dict, console=None) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    (console.print if console is not None else print)(f"wrote {path}")
