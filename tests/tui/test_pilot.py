"""Pilot tests: real flows through the workbench on the tiny model (load, pick, run, save, reopen, cancel)."""

import json
import subprocess
import sys

import pytest
from textual.widgets import Input, Label, OptionList, TabbedContent
from tui_helpers import notes, plain, wait_for

from tqbench.engine.policy import PRESETS
from tqbench.sessions import Session
from tqbench.tui.app import WorkbenchApp, WorkbenchOptions
from tqbench.tui.panes.policies import PoliciesPane
from tqbench.tui.screens.help import HelpScreen, binding_rows
from tqbench.tui.widgets.model_bar import ModelBar

pytestmark = pytest.mark.anyio
PROMPT = "Explain in a few sentences why the sky is blue."


def expected(engine, candidate: str, n: int):
    base = engine.generate(PROMPT, "fp16", max_new_tokens=n)
    cand = engine.generate(PROMPT, candidate, max_new_tokens=n)
    return base.token_ids, cand.token_ids


async def run_and_wait(app, pilot, candidate: str, n: int) -> None:
    pane = app.run_pane
    pane.query_one("#candidate", Input).value = candidate
    pane.query_one("#max-tokens", Input).value = str(n)
    await pilot.press("ctrl+r")
    await wait_for(pilot, lambda: pane.status in ("done", "failed", "cancelled"), what="the run to finish")


async def test_loads_the_model_in_a_worker_and_shows_it(data_dir):
    app = WorkbenchApp(WorkbenchOptions(model="tiny", threads=1))
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.engine is not None, what="the model to load")
        await pilot.pause()
        info = plain(app.query_one("#info", Label))
        assert info.startswith("tiny-random │ cpu │ float32 │ 0.2M params │ 1 threads │ loaded in ")
        assert app.query_one(ModelBar).has_class("-loaded")
        assert plain(app.query_one("#mem", Label)).startswith("RSS ")


async def test_a_model_that_fails_to_load_leaves_the_app_running(data_dir, tmp_path):
    app = WorkbenchApp(WorkbenchOptions(model=str(tmp_path / "no-such-model")))
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: "model not loaded" in plain(app.query_one("#info", Label)), what="the load error")
        await pilot.press("ctrl+r")
        await pilot.pause()
        assert any("the model is still loading (or failed to load)" in m for m in notes(app))
        assert app.is_running


async def test_pick_a_policy_run_and_see_the_divergence_marks(data_dir, steady_engine):
    base_ids, cand_ids = expected(steady_engine, "turbo2", 16)
    diff = [i for i, (a, b) in enumerate(zip(base_ids, cand_ids)) if a != b]
    assert diff, "turbo2 on the tiny model is expected to diverge from fp16"
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("f3")
        await pilot.pause()
        ol = app.policies_pane.query_one("#policy-list", OptionList)
        assert ol.has_focus
        target = list(PRESETS).index("turbo2")
        for _ in range(len(PRESETS) + 1):
            if ol.highlighted == target:
                break
            await pilot.press("down")
        assert app.policies_pane.built_string() == "k=turbo2,v=turbo2,sink=4,recent=16"
        await pilot.press("enter")
        await pilot.pause()
        assert app.query_one(TabbedContent).active == "run"
        assert app.run_pane.query_one("#candidate", Input).value == "turbo2"
        app.run_pane.query_one("#max-tokens", Input).value = "16"
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: app.run_pane.status == "done", what="the run to finish")
        bview, cview = app.run_pane.token_views()
        assert bview.token_ids == base_ids and cview.token_ids == cand_ids
        assert cview.divergent_steps == diff and bview.divergent_steps == diff
        assert cview.first_divergence == diff[0]
        assert cview.border_subtitle == f"▶ first divergence at token {diff[0]}"
        rendered = cview.render_text()
        assert "▶" in rendered.plain
        assert any("on #af005f" in str(span.style) for span in rendered.spans)
        strip = plain(app.run_pane.query_one("#strip"))
        assert f"▶ first divergence @ {diff[0]}" in strip
        assert f"token match {16 - len(diff)}/16" in strip and "cache mode fused" in strip
        graph = app.run_pane.query_one("#graph")
        assert len(graph.tps["candidate"]) == 15 and len(graph.kv["candidate"]) == 16


async def test_dense_shadow_is_labelled_storage_only(data_dir, steady_engine):
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(120, 40)) as pilot:
        app.run_pane.query_one("#mode").value = "dense-shadow"
        await run_and_wait(app, pilot, "turbo2", 6)
        _, cview = app.run_pane.token_views()
        assert cview.border_title.endswith("(dense-shadow) · storage-only: reads exact K/V")
        assert cview.divergent_steps == []  # exact K/V: equal to fp16 by construction
        assert "dense-shadow: storage-only (outputs equal fp16 by construction)" in plain(app.run_pane.query_one("#strip"))


async def test_a_16_bit_dense_baseline_runs_and_the_graph_names_it(data_dir, steady_engine):
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(120, 40)) as pilot:
        app.run_pane.query_one("#baseline", Input).value = "dense-fp16"
        await run_and_wait(app, pilot, "turbo2", 6)
        assert app.run_pane.status == "done"
        bview, _ = app.run_pane.token_views()
        assert bview.border_title == "baseline · dense-fp16 (float16 K/V)" and len(bview.token_ids) == 6
        graph = app.run_pane.query_one("#graph")
        title = plain(graph.border_title) if not isinstance(graph.border_title, str) else graph.border_title
        assert "━ baseline · dense-fp16 (float16 K/V)" in title and "━ candidate · turbo2 (" in title
        assert len(graph.tps["baseline"]) == 5 and app.run_pane.record.baseline.policy == "dense-fp16"


async def test_bad_policy_is_reported_and_nothing_runs(data_dir, steady_engine):
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(100, 30)) as pilot:
        app.run_pane.query_one("#candidate", Input).value = "k=turbo9"
        await pilot.press("ctrl+r")
        await pilot.pause()
        assert not app.run_pane.running
        assert any(m.startswith("unknown K codec 'turbo9': valid codecs are ") for m in notes(app))


async def test_save_then_reopen_shows_the_same_tokens(data_dir, steady_engine):
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(120, 40)) as pilot:
        await run_and_wait(app, pilot, "k3v2", 10)
        first = [v.token_ids for v in app.run_pane.token_views()]
        texts = [v.text for v in app.run_pane.token_views()]
        await pilot.press("ctrl+s")
        await pilot.pause()
        path = app.session_path
        assert path is not None and path.parent == data_dir and path.name.endswith("-k3v2.json")
        assert any(m.startswith("saved 1 run(s) to ") for m in notes(app))

    saved = Session.load(path)
    assert saved.runs[0].candidate.token_ids == first[1]
    app2 = WorkbenchApp(WorkbenchOptions(session=str(path)), engine=steady_engine)
    async with app2.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        views = app2.run_pane.token_views()
        assert [v.token_ids for v in views] == first
        assert [v.text for v in views] == texts
        assert views[1].divergent_steps == [i for i, s in enumerate(saved.runs[0].same_token) if not s]
        assert app2.run_pane.query_one("#candidate", Input).value == "k3v2"  # the preset's name, as typed
        # re-run and diff against the saved tokens
        await pilot.press("ctrl+e")
        await wait_for(pilot, lambda: "re-run vs saved" in plain(app2.run_pane.query_one("#strip")), what="the diff")
        assert "re-run vs saved: baseline: identical (10 tokens); candidate: identical (10 tokens)" in plain(
            app2.run_pane.query_one("#strip"))


async def test_open_from_the_list_and_a_corrupt_file_keeps_the_app_running(data_dir, steady_engine):
    rec_app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with rec_app.run_test(size=(100, 30)) as pilot:
        await run_and_wait(rec_app, pilot, "turbo3", 5)
        await pilot.press("ctrl+s")
        await pilot.pause()
    good = rec_app.session_path
    (data_dir / "zz-broken.json").write_text('{"format": "tqbench-session"')
    newer = data_dir / "newer.json"
    doc = json.loads(good.read_text())
    doc["version"] = 7
    newer.write_text(json.dumps(doc))

    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("ctrl+o")
        await pilot.pause()
        ol = app.screen.query_one("#session-list", OptionList)
        prompts = [str(ol.get_option_at_index(i).prompt) for i in range(ol.option_count)]
        assert any("newer tqbench (format version 7" in p for p in prompts)
        broken = next(i for i, p in enumerate(prompts) if "zz-broken.json" in p)
        ol.highlighted = broken
        await pilot.press("enter")
        await pilot.pause()
        assert "session zz-broken.json is corrupt (not valid JSON): it cannot be opened" in notes(app)
        assert app.is_running and app.screen is app.screen_stack[0]
        await pilot.press("ctrl+o")
        await pilot.pause()
        ol = app.screen.query_one("#session-list", OptionList)
        ol.highlighted = next(i for i in range(ol.option_count) if good.name in str(ol.get_option_at_index(i).prompt))
        await pilot.press("enter")
        await pilot.pause()
        assert app.session_path == good
        assert app.run_pane.token_views()[1].token_ids == Session.load(good).runs[0].candidate.token_ids


async def test_escape_cancels_a_long_run_and_the_app_stays_usable(data_dir, steady_engine):
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(100, 30)) as pilot:
        pane = app.run_pane
        pane.query_one("#max-tokens", Input).value = "3000"
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: pane.steps >= 5, what="a few steps")
        await pilot.press("escape")
        await wait_for(pilot, lambda: not pane.running, what="the cancel")
        assert pane.status == "cancelled"
        assert 5 <= pane.steps < 3000
        assert pane.record.candidate.stopped_by == "cancelled" and pane.record.baseline.stopped_by == "cancelled"
        await run_and_wait(app, pilot, "turbo4", 4)
        assert pane.status == "done" and len(pane.token_views()[1].token_ids) == 4


async def test_policy_builder_estimates_and_keeps_a_named_policy(data_dir, steady_engine):
    from tqbench.engine.cache.estimate import KVGeometry, estimate_kv

    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("f3")
        pol = app.policies_pane
        pol.query_one("#k-codec").value = "turbo3"
        pol.query_one("#v-codec").value = "int4"
        pol.query_one("#recent", Input).value = "32"
        pol.query_one("#context", Input).value = "2048"
        await pilot.pause()
        assert pol.current == "k=turbo3,v=int4,sink=4,recent=32"
        est = estimate_kv(pol.current, KVGeometry.from_config(steady_engine.config), 2048)
        assert pol.estimate.total_bytes == est.total_bytes
        assert f"{est.bits_per_element:.2f} bits/element" in plain(pol.query_one("#estimate"))
        pol.query_one("#policy-name", Input).value = "t3-i4"
        await pilot.press("ctrl+k")
        await pilot.pause()
        assert pol.kept == {"t3-i4": "k=turbo3,v=int4,sink=4,recent=32"}
        assert app.session.policies == {"t3-i4": "k=turbo3,v=int4,sink=4,recent=32"}
        await pilot.press("ctrl+u")
        await pilot.pause()
        assert app.run_pane.query_one("#candidate", Input).value == "k=turbo3,v=int4,sink=4,recent=32"
    # kept in the data dir too: a new workbench lists it
    assert json.loads((data_dir.parent / "policies.json").read_text()) == {"t3-i4": "k=turbo3,v=int4,sink=4,recent=32"}
    app2 = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app2.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        ol = app2.policies_pane.query_one("#policy-list", OptionList)
        assert "t3-i4" in str(ol.get_option_at_index(ol.option_count - 1).prompt)
        assert app2.policies_pane.kept == {"t3-i4": "k=turbo3,v=int4,sink=4,recent=32"}


async def test_help_lists_every_binding(data_dir, steady_engine):
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("f1")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        described = {row[2] for row in binding_rows(app)}
        for b in (*WorkbenchApp.BINDINGS, *PoliciesPane.BINDINGS):
            assert b.description in described
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, HelpScreen)


async def test_palette_has_every_action(data_dir, steady_engine):
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(100, 30)):
        titles = {c.title for c in app.get_system_commands(app.screen)}
        for title in ("Run", "Cancel run", "Save session", "Open session", "Re-run and diff", "Policies tab",
                      "Use built policy", "Keep built policy", "Help"):
            assert title in titles


async def test_a_headless_bench_session_opens_in_the_workbench(data_dir, steady_engine, tmp_path):
    from click.testing import CliRunner

    from tqbench.cli import main

    path = tmp_path / "bench.json"
    r = CliRunner().invoke(main, ["--headless", "bench", "--model", "tiny", "--kv-policy", "turbo3", "--max-new-tokens",
                                  "6", "--prompt", "hello", "--threads", "1", "--save-session", str(path)])
    assert r.exit_code == 0, r.output
    assert f"session saved to {path}" in r.stderr
    saved = Session.load(path)
    assert saved.runs[0].kind == "bench" and saved.model["spec"] == "tiny"
    app = WorkbenchApp(WorkbenchOptions(session=str(path)), engine=steady_engine)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        bview, cview = app.run_pane.token_views()
        assert app.model_spec == "tiny"
        assert cview.token_ids == saved.runs[0].candidate.token_ids and len(cview.token_ids) == 6
        assert bview.token_ids == [] and bview.border_title == "baseline · none"


def test_workbench_needs_a_terminal():
    r = subprocess.run([sys.executable, "-m", "tqbench.cli"], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert r.returncode == 2
    assert r.stderr.strip() == ("error: the workbench needs a terminal: run `tqbench` in one, or use "
                                "`tqbench --headless <command>`")


@pytest.mark.parametrize("args", [["--session", "/no/such.json"]])
def test_missing_session_flag_is_a_clean_error(args):
    r = subprocess.run([sys.executable, "-m", "tqbench.cli", *args], capture_output=True, text=True,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 2
    assert r.stderr.strip() == "error: session file '/no/such.json' does not exist: give a saved session's .json path or a sweep's --out folder"


async def test_policies_tab_shows_the_engine_export_of_the_policy_on_screen(data_dir, steady_engine):
    """The saved allocation in the builder, on the default model's geometry: llama.cpp's flags and what they
    cannot carry (the same mapping `tqbench --headless export` prints); switching the engine updates it."""
    from textual.widgets import Select, Static

    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(120, 50)) as pilot:
        await pilot.press("f3")
        pane = app.policies_pane
        pane.query_one("#geometry-model", Input).value = "SmolLM2-135M"
        await pilot.pause()
        pane.load_into_builder("smollm2-alloc-2.5bit")
        await pilot.pause()
        text = plain(pane.query_one("#export", Static))
        assert "llama-server -m MODEL.gguf -ctk q4_0 -ctv q4_0 -fa on" in text
        assert "4.50 bits/element vs the policy's 2.48" in text
        assert "could not map: per-layer K widths (turbo2 on 10 layers" in text
        assert "sink=4 / recent=16 full-precision tokens" in text
        pane.query_one("#export-engine", Select).value = "vllm"
        await pilot.pause()
        text = plain(pane.query_one("#export", Static))
        assert text.startswith("vllm serve MODEL --kv-cache-dtype turboquant_3bit_nc\n5.07 bits/element vs the policy's "
                               "2.48")
        assert "--to vllm" in text


async def test_a_listed_policy_that_does_not_fit_the_model_says_so_and_why(data_dir, steady_engine):
    """The shipped SmolLM2 allocation names layers 0-29: on the 4-layer tiny model the list marks it "n/a" (not a
    bare "?"), and highlighting it shows the estimate's own reason."""
    from tqbench.engine.cache.estimate import KVGeometry, estimate_kv
    from tqbench.engine.policy import parse_policy

    with pytest.raises(ValueError) as exc:
        estimate_kv(parse_policy("smollm2-alloc-2.5bit"), KVGeometry.from_config(steady_engine.config), 1024)
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(160, 40)) as pilot:
        await pilot.press("f3")
        await pilot.pause()
        ol = app.policies_pane.query_one("#policy-list", OptionList)
        idx = next(i for i in range(ol.option_count) if ol.get_option_at_index(i).id == "p:smollm2-alloc-2.5bit")
        row = str(ol.get_option_at_index(idx).prompt)
        assert "n/a" in row and "not for this model: highlight it for why" in row and "?" not in row
        ol.highlighted = idx
        await pilot.pause()
        shown = plain(app.policies_pane.query_one("#estimate"))
        assert shown.startswith("invalid policy: ") and str(exc.value)[:40] in shown


async def test_highlighting_a_per_head_policy_loads_it_into_the_builder(data_dir, words_engine):
    """The shipped per-KV-head allocation (head lists ``a|b|c``) highlights like any policy: its string and bits are
    the builder's, on the model geometry it was made for (30 layers x 3 KV heads)."""
    from tqbench.engine.cache.estimate import estimate_kv
    from tqbench.engine.policy import parse_policy

    app = WorkbenchApp(WorkbenchOptions(model="tiny-words"), engine=words_engine)
    async with app.run_test(size=(160, 40)) as pilot:
        await pilot.press("f3")
        await pilot.pause()
        pane = app.policies_pane
        ol = pane.query_one("#policy-list", OptionList)
        ol.highlighted = next(i for i in range(ol.option_count) if ol.get_option_at_index(i).id == "p:smollm2-head-2.5bit")
        await pilot.pause()
        pol = parse_policy("smollm2-head-2.5bit")
        assert "|" in pol.k + pol.v and pane.current == pol.to_string()
        est = estimate_kv(pol, words_engine.geometry, 1024)
        assert pane.estimate.total_bytes == est.total_bytes
        assert f"{est.bits_per_element:.2f} bits/element" in plain(pane.query_one("#estimate"))
