"""Snapshot tests of the main screens: the SVG Textual exports, compared with the files in snapshots/.

pytest-textual-snapshot pins pytest < 9 (through syrupy) and this project runs pytest 9, so the comparison is
done here: ``TQBENCH_UPDATE_SNAPSHOTS=1 pytest tests/tui/test_snapshots.py`` rewrites the files; on a mismatch
the new SVG is written next to the stored one (``*.new.svg``) to open side by side.

The screens show the snapshot model (``words_engine``, tests/tui/words_model.py): SmolLM2's real tokenizer and
KV geometry with random weights whose greedy text is English words, so a wrong screen (garbled text, a missing
figure, a bits column of ``?``) is visible to whoever looks at the files.
"""

import os
from pathlib import Path

import pytest
from textual.widgets import Input, TextArea

from tqbench.sessions import RunRecorder
from tqbench.tui.app import WorkbenchApp, WorkbenchOptions

pytestmark = pytest.mark.anyio
SNAPSHOTS = Path(__file__).parent / "snapshots"
PROMPT = "Explain in a few sentences why the sky is blue."


@pytest.fixture(autouse=True)
def steady_screen(monkeypatch):
    monkeypatch.setattr("tqbench.tui.widgets.model_bar.memory_in_use", lambda: "RSS 512 MiB")
    monkeypatch.setenv("TEXTUAL_ANIMATIONS", "none")


@pytest.fixture(scope="module")
def fixed_record(words_engine):
    """A real lockstep run on the tiny model, with fixed step times so the graph draws the same every time."""
    rec = RunRecorder(PROMPT, True, 16, {"temperature": 0.0, "top_p": 1.0, "seed": 0})
    for ev in words_engine.lockstep(PROMPT, "fp16", "turbo2", max_new_tokens=16, track_bytes=True):
        rec(ev)
    r = rec.record
    r.baseline.step_seconds = [0.02 + 0.001 * (i % 5) for i in range(16)]
    r.candidate.step_seconds = [0.03 + 0.002 * (i % 3) for i in range(16)]
    r.kl = [None if k is None else round(k, 3) for k in r.kl]
    return r


def compare(app, name: str) -> None:
    for widget in app.query(TextArea):
        widget.cursor_blink = False
    for widget in app.query(Input):
        widget.cursor_blink = False
    app.clear_notifications()
    app.refresh()
    svg = app.export_screenshot(title="tqbench")
    path = SNAPSHOTS / f"{name}.svg"
    if os.environ.get("TQBENCH_UPDATE_SNAPSHOTS") == "1" or not path.exists():
        SNAPSHOTS.mkdir(exist_ok=True)
        path.write_text(svg)
        if os.environ.get("TQBENCH_UPDATE_SNAPSHOTS") != "1":
            pytest.fail(f"snapshot {path.name} did not exist and was written: check it and run again")
        return
    if svg != path.read_text():
        new = path.with_suffix(".new.svg")
        new.write_text(svg)
        pytest.fail(f"screen differs from {path.name}: see {new} (TQBENCH_UPDATE_SNAPSHOTS=1 accepts it)")


async def settle(pilot) -> None:
    await pilot.pause()
    await pilot.wait_for_scheduled_animations()
    await pilot.pause()


@pytest.mark.parametrize("size", [(100, 30), (200, 60)])
async def test_run_screen(size, words_engine, fixed_record, data_dir):
    app = WorkbenchApp(WorkbenchOptions(model="tiny-smollm2-words"), engine=words_engine)
    async with app.run_test(size=size) as pilot:
        app.run_pane.show_record(fixed_record)
        await settle(pilot)
        compare(app, f"run_{size[0]}x{size[1]}")


async def test_policies_screen(words_engine, data_dir):
    app = WorkbenchApp(WorkbenchOptions(model="tiny-smollm2-words"), engine=words_engine)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("f3")
        await pilot.press("down", "down", "down")
        await settle(pilot)
        compare(app, "policies_100x30")


async def test_help_screen(words_engine, data_dir):
    app = WorkbenchApp(WorkbenchOptions(model="tiny-smollm2-words"), engine=words_engine)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("f1")
        await settle(pilot)
        compare(app, "help_100x30")


@pytest.fixture(scope="module")
def fixed_scan(words_engine):
    from tqbench.engine.scan import scan

    res = scan(words_engine, PROMPT, codecs=["int8", "turbo4", "turbo2"])
    res.seconds = 1.0
    return res


@pytest.fixture(scope="module")
def fixed_compare(words_engine):
    from tqbench.engine.validate import compare_policies

    res = compare_policies(words_engine, ["turbo4", "q8k-q8v", "turbo2"], [PROMPT], max_new_tokens=6)
    for row in res.rows:
        row.throughput_ratio = 1.0  # wall-clock: the one column that changes from run to run
    return res


async def test_scan_screen(words_engine, fixed_scan, data_dir):
    app = WorkbenchApp(WorkbenchOptions(model="tiny-smollm2-words", screen="scan"), engine=words_engine)
    async with app.run_test(size=(100, 30)) as pilot:
        app.scan_pane.show_result(fixed_scan)
        await settle(pilot)
        compare(app, "scan_100x30")


async def test_compare_screen(words_engine, fixed_compare, data_dir):
    app = WorkbenchApp(WorkbenchOptions(model="tiny-smollm2-words", screen="compare"), engine=words_engine)
    async with app.run_test(size=(100, 30)) as pilot:
        app.compare_pane.show_result(fixed_compare)
        await settle(pilot)
        compare(app, "compare_100x30")
