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
from tqbench.constants import DENSE_BASELINE_ATTENTION, DENSE_BASELINES  # noqa: E402  (torch-free)


def baselines_help() -> str:
    """Every dense baseline with its K/V dtype and how its attention reads the rows (``DENSE_BASELINE_ATTENTION``)."""
    return "; ".join(f"{n}: {DENSE_BASELINES[n] or 'model dtype'} K/V, {DENSE_BASELINE_ATTENTION[n]}"
                     for n in DENSE_BASELINES)


def add_baseline_arg(parser) -> None:
    """``--baseline``: the dense cache a speed benchmark's ratios are against (``DENSE_BASELINES``)."""
    parser.add_argument("--baseline", default="dense", choices=list(DENSE_BASELINES),
                        help="the dense cache ratios are against (float32 on a CPU model for dense): "
                             + baselines_help().replace("%", "%%"))


def check_baselines(names, engine) -> None:
    """Exit 2 with the reason when a kernel-attended baseline cannot run here (no native kernel, a GPU model)."""
    from tqbench.constants import KERNEL_BASELINES
    from tqbench.engine.cache.dense_kernel import check_kernel_baseline

    for name in names:
        if name in KERNEL_BASELINES:
            try:
                check_kernel_baseline(name, engine.loaded.device)
            except RuntimeError as exc:
                print(f"error: {exc}", file=sys.stderr)
                raise SystemExit(2) from None


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
