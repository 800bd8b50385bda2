"""Saved sessions in the workbench: a version-2 session shows before the model has loaded (its tokens carry
their texts); a version-1 one waits for the model's tokenizer to rebuild them."""

import shutil
import threading
from pathlib import Path

import pytest
from textual.widgets import Select
from tui_helpers import notes, wait_for

from tqbench.engine.engine import Engine
from tqbench.sessions import RunRecorder, Session, restore_token_texts, save_session
from tqbench.tui.app import WorkbenchApp, WorkbenchOptions

pytestmark = pytest.mark.anyio
V1 = Path(__file__).parents[1] / "unit" / "data" / "session-v1.json"


@pytest.fixture
def held_load(monkeypatch, steady_engine):
    """``Engine.load`` waits until the test sets the event: until then the app runs without a model."""
    gate = threading.Event()

    def load(model=None, **kwargs):
        gate.wait(600)
        return steady_engine

    monkeypatch.setattr(Engine, "load", staticmethod(load))
    yield gate
    gate.set()


def pieces(view) -> list[str]:
    return [text for _, text, _ in view.tokens]


async def test_a_version_2_session_shows_before_the_model_has_loaded(data_dir, steady_engine, held_load, tmp_path):
    rec = RunRecorder("hello there", True, 8, {"temperature": 0.0, "top_p": 1.0, "seed": 0})
    for ev in steady_engine.lockstep("hello there", "fp16", "turbo2", candidate_mode="simulate", max_new_tokens=8):
        rec(ev)
    record = rec.record
    path = save_session(Session(runs=[record]), tmp_path / "s.json", engine=steady_engine, model_spec="tiny")
    app = WorkbenchApp(WorkbenchOptions(session=str(path)))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        assert app.engine is None and app.model_spec == "tiny"
        bview, cview = app.run_pane.token_views()
        assert bview.token_ids == record.baseline.token_ids and cview.token_ids == record.candidate.token_ids
        assert pieces(bview) == record.baseline.token_texts and pieces(cview) == record.candidate.token_texts
        assert bview.text == record.baseline.text and cview.text == record.candidate.text
        assert cview.divergent_steps == [i for i, same in enumerate(record.same_token) if not same]
        assert app.session_path == path and any(m.startswith("opened s.json: 1 run(s)") for m in notes(app))
        held_load.set()
        await wait_for(pilot, lambda: app.engine is not None, what="the model to load")
        await pilot.pause()
        # the model loading changes nothing on screen, keeps the session's model and its run's cache mode
        assert cview.token_ids == record.candidate.token_ids and pieces(cview) == record.candidate.token_texts
        assert app.session.model["fingerprint"] == steady_engine.loaded.fingerprint
        assert app.run_pane.query_one("#mode", Select).value == "simulate"
        assert not any("re-runs will differ" in m for m in notes(app))


async def test_a_version_1_session_opens_once_the_model_has_loaded(data_dir, steady_engine, held_load, tmp_path):
    path = tmp_path / V1.name
    shutil.copy(V1, path)
    shutil.copy(V1.with_suffix(".safetensors"), path.with_suffix(".safetensors"))
    app = WorkbenchApp(WorkbenchOptions(session=str(path)))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        assert app.engine is None and app.session_path is None
        assert app.run_pane.token_views()[1].token_ids == []
        assert "session-v1.json opens as soon as the model has loaded" in notes(app)
        held_load.set()
        await wait_for(pilot, lambda: app.session_path is not None, what="the session to open")
        await pilot.pause()
        saved = Session.load(path)
        restore_token_texts(saved.runs, steady_engine.tokenizer)
        run = saved.runs[0]
        bview, cview = app.run_pane.token_views()
        assert bview.token_ids == run.baseline.token_ids and cview.token_ids == run.candidate.token_ids
        assert pieces(bview) == run.baseline.token_texts and pieces(cview) == run.candidate.token_texts
        assert cview.divergent_steps == [2, 3, 4, 5, 6, 7]


async def test_task_results_reopen_and_save_as_keeps_the_opened_file(data_dir, steady_engine, tmp_path):
    """Issue 42: a session's task-suite table comes back when it is opened; "save as" writes another file and
    ctrl+s over the opened session keeps the previous version as NAME.bak.json."""
    from textual.widgets import DataTable, Input

    from tqbench.engine.tasks.suite import TasksResult
    from tqbench.tui.screens.sessions import SaveAsScreen

    sample = {"task": "niah_single", "index": 0, "prompt_tokens": 900, "references": ["7"], "baseline_answer": "7",
              "candidate_answer": "8", "baseline_score": 1.0, "candidate_score": 0.0, "agree": False,
              "baseline_compression_ratio": 1.0, "candidate_compression_ratio": 3.5}
    res = TasksResult("tiny", 1024, 0, "fp16", "turbo2", "compressed", 1, ["niah_single"], [sample], 0)
    path = save_session(Session(tasks=[res]), tmp_path / "t.json", engine=steady_engine, model_spec="tiny")
    app = WorkbenchApp(WorkbenchOptions(session=str(path)), engine=steady_engine)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        table = app.compare_pane.query_one("#cmp-tasks-table", DataTable)
        assert table.row_count == 2 and [str(c) for c in table.get_row("turbo2")][:3] == ["turbo2", "3.500", "0.0"]
        app.action_save_session_as()
        await wait_for(pilot, lambda: isinstance(app.screen, SaveAsScreen) and app.screen.query("#save-as-path"),
                       what="the save-as screen")
        app.screen.query_one("#save-as-path", Input).value = str(tmp_path / "copy")
        await pilot.press("enter")
        await wait_for(pilot, lambda: (tmp_path / "copy.json").exists(), what="the copy to be written")
        assert Session.load(tmp_path / "copy.json").tasks[0].to_dict() == res.to_dict()
        assert app.session_path == tmp_path / "copy.json"
        app.session_path = path  # back to the opened file: ctrl+s keeps its previous version
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: (tmp_path / "t.bak.json").exists(), what="the backup")
        assert any("the previous version kept as t.bak.json" in m for m in notes(app))
