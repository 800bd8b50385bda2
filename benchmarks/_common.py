"""What every benchmark script records about the machine, and how it writes its JSON (scripts import this
as ``_common``: ``python benchmarks/X.py`` puts this folder first on ``sys.path``)."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from tqbench.constants import DENSE_BASELINES  # noqa: E402  (torch-free)


def add_baseline_arg(parser) -> None:
    """``--baseline``: the dense cache a speed benchmark's ratios are against (``DENSE_BASELINES``)."""
    parser.add_argument("--baseline", default="dense", choices=list(DENSE_BASELINES),
                        help="the dense cache ratios are against: dense (K/V in the model's dtype, float32 on CPU), "
                             "dense-fp16 or dense-bf16 (K/V rows stored in 16 bits, upcast for the model's attention)")


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
