"""The workbench in a real terminal (tmux, 160x48) on the default model: run, save, reopen the session."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
TMUX = shutil.which("tmux")


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True).stdout


def pane(name: str) -> str:
    return tmux("capture-pane", "-p", "-t", name)


def wait(name: str, predicate, timeout: float, what: str, seen: list | None = None) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        text = pane(name)
        if seen is not None:
            seen.append(text)
        if predicate(text):
            return text
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}; the screen was:\n{pane(name)}")


def start(name: str, data: Path, *args: str) -> None:
    # COLUMNS/LINES inherited from pytest would pin the app at 80x24 whatever the pane size
    cmd = " ".join(["env -u COLUMNS -u LINES", f"TQBENCH_DATA_DIR={data}", sys.executable, "-m", "tqbench", *args])
    # Textual draws on stderr: it must stay on the terminal
    tmux("new-session", "-d", "-s", name, "-x", "160", "-y", "48", f"cd {ROOT} && {cmd}")
    tmux("resize-window", "-t", name, "-x", "160", "-y", "48")  # a first server may start at 80x24


def text_panels(screen: str) -> list[str]:
    """The rows of the two side-by-side token views (between their top and bottom borders)."""
    lines = screen.splitlines()
    top = next(i for i, line in enumerate(lines) if "─ baseline ·" in line)
    bottom = next(i for i in range(top + 1, len(lines)) if lines[i].startswith("╰"))
    rows = lines[top + 1:bottom]
    while rows and not rows[-1].replace("│", "").strip():  # the strip's height may differ by a row
        rows.pop()
    return rows


@pytest.mark.skipif(TMUX is None, reason="tmux is not installed: this real-terminal test needs it (apt-get install tmux)")
def test_workbench_runs_saves_and_reopens_in_tmux(tmp_path):
    name = f"tqbench-test-{os.getpid()}"
    second = f"{name}-reopen"
    try:
        # a subcommand without --headless opens the workbench with its flags filled in
        start(name, tmp_path, "bench", "--kv-policy", "turbo2", "--max-new-tokens", "16", "--threads", "1")
        wait(name, lambda s: "SmolLM2-135M-Instruct │" in s, 600, "the default model to load")
        # the Policies tab lets the user go back (F3 arrives as ESC O R, F2 as ESC O Q under tmux)
        tmux("send-keys", "-t", name, "F3")
        wait(name, lambda s: "presets · bits/element" in s, 600, "the Policies tab")
        tmux("send-keys", "-t", name, "F2")
        # the Run tab is back once its controls and both token views are drawn (a frame may be half drawn)
        wait(name, lambda s: "presets · bits/element" not in s and "Run ^r" in s and "╭─ baseline" in s
             and "╭─ candidate" in s, 600, "F2 back to Run")
        tmux("send-keys", "-t", name, "C-r")
        seen: list[str] = []
        done = wait(name, lambda s: "done │ step 16" in s, 600, "the run to finish", seen)
        # the graph moved while tokens streamed: a running frame already had the tokens/s axis drawn
        assert any("running │ step" in s and "┤" in s for s in seen)
        assert "─ baseline · fp16 (compressed)" in done and "─ candidate · turbo2 (compressed)" in done
        assert "▶ first divergence @ " in done and "▶ first divergence at token " in done
        first_panels = text_panels(done)
        assert len(first_panels) >= 2 and all("││ " in row for row in first_panels)  # both texts on screen
        tmux("send-keys", "-t", name, "C-s")
        sessions = tmp_path / "sessions"
        end = time.monotonic() + 600
        while not list(sessions.glob("*.json")) and time.monotonic() < end:
            time.sleep(0.2)
        saved = list(sessions.glob("*.json"))
        assert len(saved) == 1, pane(name)
        tmux("send-keys", "-t", name, "C-q")  # quit as a user would

        start(second, tmp_path, "--session", str(saved[0]), "--threads", "1")
        reopened = wait(second, lambda s: "saved run │ step 16" in s, 600, "the saved run to show")
        assert text_panels(reopened) == first_panels
    finally:
        tmux("kill-session", "-t", name)
        tmux("kill-session", "-t", second)
