"""Snapshot of Run's kept-token map (f8) after a real run of an evicting policy on the snapshot model (SmolLM2's
tokenizer and KV geometry: 30 layers x 3 KV heads, real word pieces), so a wrong picture is visible in the file."""

from __future__ import annotations

import pytest

from tests.tui.test_snapshots import PROMPT, compare, settle, steady_screen  # noqa: F401 (an autouse fixture)
from tqbench.engine.events import KeptTokens
from tqbench.sessions import RunRecorder
from tqbench.tui.app import WorkbenchApp, WorkbenchOptions

pytestmark = pytest.mark.anyio
POLICY = "turbo4,sink=2,recent=4,keep=0.5,score=snapkv,window=8"


@pytest.fixture(scope="module")
def evicting_run(words_engine):
    rec = RunRecorder(PROMPT, True, 8, {"temperature": 0.0, "top_p": 1.0, "seed": 0})
    kept = None
    for ev in words_engine.lockstep(PROMPT, "fp16", POLICY, candidate_mode="compressed", max_new_tokens=8,
                                    track_bytes=True, track_kept=True):
        rec(ev)
        if isinstance(ev, KeptTokens):
            kept = ev
    r = rec.record
    r.baseline.step_seconds = [0.02] * len(r.baseline.step_seconds)
    r.candidate.step_seconds = [0.03] * len(r.candidate.step_seconds)
    r.kl = [None if k is None else round(k, 3) for k in r.kl]
    return r, kept


async def test_run_kept_tokens_screen(words_engine, evicting_run, data_dir):
    record, kept = evicting_run
    assert kept is not None and len(kept.kept.layers) == 30
    app = WorkbenchApp(WorkbenchOptions(model="tiny-smollm2-words"), engine=words_engine)
    async with app.run_test(size=(120, 40)) as pilot:
        app.run_pane.show_record(record)
        app.run_pane.set_kept(kept)
        await pilot.press("f8")
        await pilot.press("down", "down", "down", "down")  # layer 1, KV head 1
        await settle(pilot)
        assert app.run_pane.query_one("#kept-map").selected == (1, 1)
        compare(app, "run_kept_tokens_120x40")
