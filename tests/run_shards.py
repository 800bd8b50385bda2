"""Run the test suite as N pytest processes at once (``make test``: N=2, one per core of the 2-core machines it
runs on), each on its share of the test files (``--shard I/N``, tests/conftest.py); then one summary: every
share's result line and the slowest tests of the whole run.

Tests run torch at one thread (tests/conftest.py) and spend much of their time waiting on subprocesses, servers
and compilers, so one pytest process leaves a core idle; two shares keep both busy. Shares share nothing but the
caches that concurrent runs already share safely (build locks, converted models). The first share's output
streams live; the others' is printed when they end. Exit status: 0 when every share passed, else the first
failing share's.

    python tests/run_shards.py [--shards N] [PYTEST ARGS...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SLOWEST = 20
NO_TESTS = 5  # pytest's exit status when nothing was collected


def slowest(junit_files: list[Path], n: int = SLOWEST) -> list[tuple[float, str]]:
    """The n slowest test cases (setup + call + teardown, as junit records them) over every share."""
    rows = []
    for path in junit_files:
        if not path.is_file():
            continue
        for case in ET.parse(path).getroot().iter("testcase"):
            rows.append((float(case.get("time") or 0.0), f"{case.get('classname')}::{case.get('name')}"))
    return sorted(rows, reverse=True)[:n]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=2, help="pytest processes at once (default 2)")
    opts, pytest_args = parser.parse_known_args(argv)
    if opts.shards < 1:
        parser.error(f"--shards {opts.shards}: give 1 or more")
    if opts.shards == 1:
        return subprocess.call([sys.executable, "-m", "pytest", *pytest_args], cwd=ROOT)
    with tempfile.TemporaryDirectory(prefix="tqbench-shards-") as tmp:
        procs, logs, junits = [], [], []
        for i in range(1, opts.shards + 1):
            junit = Path(tmp) / f"shard-{i}.xml"
            cmd = [sys.executable, "-m", "pytest", f"--shard={i}/{opts.shards}", f"--junitxml={junit}", *pytest_args]
            log = None if i == 1 else open(Path(tmp) / f"shard-{i}.log", "w+", encoding="utf-8")  # noqa: SIM115
            procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT if log else None,
                                          env={**os.environ, "PYTHONUNBUFFERED": "1"}))
            logs.append(log)
            junits.append(junit)
        codes = [p.wait() for p in procs]
        for i, log in enumerate(logs, start=1):
            if log is not None:
                log.seek(0)
                print(f"\n{'=' * 30} shard {i}/{opts.shards} {'=' * 30}\n{log.read()}", end="", flush=True)
                log.close()
        print(f"\n{'=' * 20} slowest {SLOWEST} tests of all {opts.shards} shards {'=' * 20}")
        for seconds, name in slowest(junits):
            print(f"{seconds:8.2f}s  {name}")
        if any(c != NO_TESTS for c in codes):  # a share that got no test of a narrow selection is no failure
            codes = [0 if c == NO_TESTS else c for c in codes]
        for i, code in enumerate(codes, start=1):
            print(f"shard {i}/{opts.shards}: {'passed' if code == 0 else f'FAILED (pytest exit {code})'}")
    return next((c for c in codes if c != 0), 0)


if __name__ == "__main__":
    sys.exit(main())
