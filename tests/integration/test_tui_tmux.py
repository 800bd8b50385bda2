"""The workbench in a real terminal (tmux, 160x48): run, save and reopen a session on the default model; keys that
once killed it, on the tiny model."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tqbench.constants import DEFAULT_PROMPT

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


needs_tmux = pytest.mark.skipif(TMUX is None,
                                reason="tmux is not installed: this real-terminal test needs it (apt-get install tmux)")


def alive(name: str) -> bool:
    """The tmux session still exists (it ends when the workbench process exits)."""
    return subprocess.run(["tmux", "has-session", "-t", name], capture_output=True).returncode == 0


def cursor(name: str) -> tuple[int, int]:
    """Where the terminal cursor is: Textual puts it on the focused text box's cursor (for input methods)."""
    x, y = tmux("display", "-p", "-t", name, "#{cursor_x} #{cursor_y}").split()
    return int(x), int(y)


def wait_cursor(name: str, where: tuple[int, int], what: str) -> None:
    wait(name, lambda s: cursor(name) == where, 600, f"{what} (cursor at {where}, now {cursor(name)})")


@needs_tmux
def test_ctrl_z_after_adding_lines_to_the_prompt_leaves_the_workbench_running(tmp_path):
    """End, Enter, Enter, ctrl+z in Run's prompt box (Textual's undo once raised "line index 2 is out of bounds"
    and the process exited 0, the unsaved run lost); then the box still edits and a run still starts.

    Each key waits for its effect on screen or on the cursor: keys handled by a binding (End, ctrl+z) run as
    actions after the key has bubbled up to the app, so keys sent in one burst may be applied out of order."""
    name = f"tqbench-undo-{os.getpid()}"
    first = "ZQX" + DEFAULT_PROMPT
    try:
        start(name, tmp_path, "--model", "tiny", "--threads", "1")
        screen = wait(name, lambda s: "tiny-random │" in s and "╭─ baseline" in s, 600, "the tiny model to load")
        row = next(i for i, line in enumerate(screen.splitlines()) if DEFAULT_PROMPT in line)
        col = screen.splitlines()[row].index(DEFAULT_PROMPT)
        # focus starts on the Run button; shift+tab walks back over the nine controls before it to the prompt box
        tmux("send-keys", "-t", name, *["BTab"] * 9)
        wait_cursor(name, (col, row), "the prompt box to take focus")
        tmux("send-keys", "-t", name, "-l", "ZQX")
        wait(name, lambda s: first in s, 600, "ZQX typed at the start of the prompt")
        tmux("send-keys", "-t", name, "End")
        wait_cursor(name, (col + len(first), row), "End")
        tmux("send-keys", "-t", name, "Enter")
        wait_cursor(name, (col, row + 1), "the first Enter")
        tmux("send-keys", "-t", name, "Enter")  # a third line: the box (two rows) scrolls past the first
        wait(name, lambda s: first not in s, 600, "the second Enter to scroll the box")
        tmux("send-keys", "-t", name, "C-z")
        wait(name, lambda s: first in s or not alive(name), 600, "ctrl+z to take the second line back")
        assert alive(name), "the workbench exited on ctrl+z"
        wait_cursor(name, (col, row + 1), "the cursor back on the line the first Enter made")
        tmux("send-keys", "-t", name, "-l", "ABC")
        screen = wait(name, lambda s: "ABC" in s, 600, "the text typed after the undo")
        lines = screen.splitlines()
        assert first in lines[row] and lines[row + 1][col:].rstrip("│ ") == "ABC", screen
        tmux("send-keys", "-t", name, "C-r")
        wait(name, lambda s: "done │ step" in s, 600, "a run after the undo")
        assert alive(name)
    finally:
        tmux("kill-session", "-t", name)


@pytest.mark.integration
@needs_tmux
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
