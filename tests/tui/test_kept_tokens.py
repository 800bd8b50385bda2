"""Eviction in the workbench, driven as a person does: build an evicting policy in the Policies builder with the
keys, run it on the tiny model, look at which tokens each KV head kept (f8), from every tab."""

import pytest
from textual.widgets import Input, OptionList, Select, TabbedContent
from tui_helpers import notes, plain, wait_for

from tqbench.engine.cache.estimate import estimate_kv
from tqbench.engine.events import KeptTokens
from tqbench.engine.policy import Policy, parse_policy
from tqbench.tui.app import TABS, WorkbenchApp, WorkbenchOptions
from tqbench.tui.widgets.kept_map import EVICTED_STYLE, KEPT_STYLE, KeptMap, strip

pytestmark = pytest.mark.anyio
TAB_KEYS = {"run": "f2", "policies": "f3", "scan": "f4", "compare": "f5"}
PROMPT = "Explain in a few sentences why the sky is blue."


async def type_into(pilot, app, widget, text: str) -> None:
    app.screen.set_focus(widget)
    await pilot.pause()
    await pilot.press("end", *["backspace"] * 12, *text)
    await pilot.pause()


async def choose(pilot, app, select: Select, value: str) -> None:
    """Open a choice with enter and walk to ``value`` with the arrow keys, as a person does."""
    app.screen.set_focus(select)
    await pilot.press("enter")
    await pilot.pause()
    values = [v for _, v in select._options]
    steps = values.index(value) - values.index(select.value)
    await pilot.press(*(["down"] * steps if steps > 0 else ["up"] * -steps), "enter")
    await pilot.pause()
    assert select.value == value


async def test_build_an_evicting_policy_run_it_and_see_the_kept_tokens(data_dir, steady_engine):
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(120, 44)) as pilot:
        await pilot.press("f3")
        await pilot.pause()
        pane = app.policies_pane
        geo, ctx = pane.geometry(), pane.context()
        full = pane.estimate
        assert full is not None and "eviction" not in plain(pane.query_one("#estimate"))
        await type_into(pilot, app, pane.query_one("#keep", Input), "0.5")
        await choose(pilot, app, pane.query_one("#score", Select), "tova")
        await type_into(pilot, app, pane.query_one("#window", Input), "8")
        await type_into(pilot, app, pane.query_one("#every", Input), "4")
        built = Policy(k="turbo4", v="turbo4", sink=4, recent=16, keep=0.5, score="tova", window=8, every=4)
        assert pane.current == built.to_string() == "k=turbo4,v=turbo4,sink=4,recent=16,keep=0.5,score=tova,window=8,every=4"
        est = estimate_kv(parse_policy(pane.current), geo, ctx)
        assert pane.estimate.total_bytes == est.total_bytes < full.total_bytes  # the engine's, and it fell
        shown = plain(pane.query_one("#estimate"))
        assert f"{est.bits_per_element:.2f} bits/element" in shown
        # 1024 tokens: 4 sinks + 16 protected + floor(0.5 * 1004) = 522 rows per KV head, every layer of 4
        assert "eviction: 4 of 4 layers keep 522 of 1024 rows per KV head (score tova, window 8, every 4)" in shown
        # a bad keep names the field and what to use; nothing is kept as current
        await type_into(pilot, app, pane.query_one("#keep", Input), "1.5")
        assert pane.current == "" and "keep=1.5 is invalid: use a fraction 0 < f <= 1" in plain(pane.query_one("#estimate"))
        # one fraction per KV head (the tiny model has 2): each head its own rows; a wrong count names the heads
        await type_into(pilot, app, pane.query_one("#keep", Input), "0.5|1")
        assert "keep=0.5|1" in pane.current
        assert "eviction: 4 of 4 layers keep 522-1024 of 1024 rows per KV head" in plain(pane.query_one("#estimate"))
        await type_into(pilot, app, pane.query_one("#keep", Input), "0.5|1|1")
        assert "lists 3 fractions but layer 0 has 2 KV heads" in plain(pane.query_one("#estimate"))
        await type_into(pilot, app, pane.query_one("#keep", Input), "0.5")
        assert pane.current == built.to_string()
        # evicted rows demoted to a cheaper codec instead of dropped: more bytes than dropping, fewer than keeping
        await choose(pilot, app, pane.query_one("#demote", Select), "turbo2")
        assert pane.current == built.to_string() + ",demote=turbo2"
        assert est.total_bytes < pane.estimate.total_bytes < full.total_bytes
        assert pane.estimate.total_bytes == estimate_kv(parse_policy(pane.current), geo, ctx).total_bytes
        await choose(pilot, app, pane.query_one("#demote", Select), "drop")
        assert pane.current == built.to_string()
        # only tiers cheaper than the kept rows are offered (the policy's rule: demote=fp32 would be refused)
        tiers = {value for _, value in pane.query_one("#demote", Select)._options}
        assert {"drop", "turbo2", "turbo3", "int2"} <= tiers and not tiers & {"turbo4", "int4", "q4_0", "fp16", "fp32"}
        await choose(pilot, app, pane.query_one("#k-codec", Select), "turbo2")
        await choose(pilot, app, pane.query_one("#v-codec", Select), "turbo2")
        tiers = {value for _, value in pane.query_one("#demote", Select)._options}
        assert "turbo1" in tiers and not tiers & {"turbo2", "turbo3"}
        await choose(pilot, app, pane.query_one("#k-codec", Select), "turbo4")
        await choose(pilot, app, pane.query_one("#v-codec", Select), "turbo4")
        assert pane.current == built.to_string()
        # AdaKV head budgets: the same bytes, the key written; a bad floor names the key
        await choose(pilot, app, pane.query_one("#heads", Select), "ada")
        assert pane.current == built.to_string() + ",heads=ada"
        assert pane.estimate.total_bytes == est.total_bytes
        await type_into(pilot, app, pane.query_one("#ada-floor", Input), "0.5")
        assert pane.current == built.to_string() + ",heads=ada,ada_floor=0.5"
        await type_into(pilot, app, pane.query_one("#ada-floor", Input), "x")
        assert pane.current == "" and "ada_floor='x' is not a number" in plain(pane.query_one("#estimate"))
        await type_into(pilot, app, pane.query_one("#ada-floor", Input), "0.2")
        await choose(pilot, app, pane.query_one("#heads", Select), "uniform")
        assert pane.current == built.to_string()
        # chunked ranking (ChunkKV): the key written, the same bytes; 0 is refused with the key's own message
        await type_into(pilot, app, pane.query_one("#chunk", Input), "8")
        assert pane.current == built.to_string().replace(",every=4", ",chunk=8,every=4")
        assert pane.estimate.total_bytes == est.total_bytes
        await type_into(pilot, app, pane.query_one("#chunk", Input), "0")
        assert pane.current == "" and "chunk=0 is invalid: use a whole number of tokens >= 1" in plain(
            pane.query_one("#estimate"))
        await type_into(pilot, app, pane.query_one("#chunk", Input), "1")
        assert pane.current == built.to_string()

        await pilot.press("ctrl+u")
        await wait_for(pilot, lambda: app.query_one(TabbedContent).active == "run", what="Run after ctrl+u")
        run = app.run_pane
        assert run.query_one("#candidate", Input).value == built.to_string()
        run.query_one("#max-tokens", Input).value = "9"
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: run.status in ("done", "failed"), what="the run to finish")
        assert run.status == "done", notes(app)
        assert run.kept is not None and "f8: which tokens each head kept" in plain(run.query_one("#strip"))

        # the same run in the engine, alone: the map shows exactly its kept positions
        mode = str(run.query_one("#mode", Select).value)
        want = next(e for e in steady_engine.stream(PROMPT, built, mode, max_new_tokens=9, track_kept=True)
                    if isinstance(e, KeptTokens)).kept
        assert run.kept.kept == want
        assert want.layers[0].evicted_prefill > 0 and want.layers[0].evicted_decode > 0

        kept_map = run.query_one("#kept-map", KeptMap)
        assert not kept_map.display
        await pilot.press("f8")
        await pilot.pause()
        assert kept_map.display and not run.query_one("#graph").display
        strips = kept_map.query_one("#kept-strips", OptionList)
        assert strips.has_focus and strips.option_count == 4 * 2  # tiny: 4 layers x 2 KV heads
        for i, (layer, head) in enumerate(kept_map.rows):
            row = strips.get_option_at_index(i).prompt
            assert row.plain.endswith(strip(want.mask(layer, head)).plain)
            assert f"{len(want.layer(layer).heads[head])}/{want.seen}" in row.plain
        assert kept_map.selected == (0, 0)
        await pilot.press("down", "down", "down")
        await pilot.pause()
        assert kept_map.selected == (1, 1)
        text = kept_map.token_text(1, 1)
        mask = want.mask(1, 1)
        kept_chars = "".join(text.plain[s.start:s.end] for s in text.spans if s.style == KEPT_STYLE)
        evicted = [s for s in text.spans if s.style == EVICTED_STYLE]
        assert len([s for s in text.spans if s.style == KEPT_STYLE]) == sum(mask)
        assert len(evicted) == len(mask) - sum(mask) > 0
        assert kept_chars.startswith(run.kept.texts[0])
        assert "layer 1, KV head 1: kept" in kept_map.query_one("#kept-tokens-box").border_title

        await pilot.press("f8")  # on Run, f8 again: the graph
        await pilot.pause()
        assert not kept_map.display and run.query_one("#graph").display
        assert app.focused is not None and kept_map not in app.focused.ancestors

        for tab in TABS:  # f8 opens the map from every tab, and the tab keys leave it (focus on its strips)
            await pilot.press(TAB_KEYS[tab])
            await pilot.pause()
            assert app.query_one(TabbedContent).active == tab
            await pilot.press("f8")
            await pilot.pause()
            assert app.query_one(TabbedContent).active == "run" and kept_map.display, tab
            assert strips.has_focus, tab

        # a candidate chosen elsewhere clears the map (it belonged to the last run)
        run.set_candidate("turbo2")
        await pilot.pause()
        assert run.kept is None and not kept_map.display


async def test_f8_before_an_evicting_run_says_what_to_do(data_dir, steady_engine):
    app = WorkbenchApp(WorkbenchOptions(model="tiny", screen="policies"), engine=steady_engine)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("f8")
        await pilot.pause()
        assert app.query_one(TabbedContent).active == "run"
        assert any(m.startswith("no kept-token map yet: run a candidate policy that evicts tokens") for m in notes(app))
        assert not app.run_pane.query_one("#kept-map").display


async def test_a_preset_with_eviction_loads_into_the_builder(data_dir, steady_engine):
    app = WorkbenchApp(WorkbenchOptions(model="tiny"), engine=steady_engine)
    async with app.run_test(size=(120, 44)) as pilot:
        await pilot.press("f3")
        pane = app.policies_pane
        pane.keep_policy("evicting", "turbo4,keep=64rows,score=h2o,window=16,demote=int2,keep@0=1.0")
        pane.load_into_builder("evicting")
        await pilot.pause()
        assert pane.query_one("#keep", Input).value == "64rows" and pane.query_one("#score", Select).value == "h2o"
        assert pane.query_one("#window", Input).value == "16" and pane.query_one("#overrides", Input).value == "keep@0=1"
        assert pane.query_one("#demote", Select).value == "int2"
        assert pane.current == parse_policy("turbo4,keep=64rows,score=h2o,window=16,demote=int2,keep@0=1.0").to_string()
        assert "eviction: 3 of 4 layers keep 64 of 1024 rows per KV head (score h2o, window 16)" in \
            plain(pane.query_one("#estimate"))


def test_the_map_says_per_head_losses_demoted_or_dropped_and_a_true_legend():
    """Issue 42: "dropped 3 each" where heads lost 1/4/4 and the rows were demoted; "2 per column" for 88
    positions over 64 columns."""
    from tqbench.engine.cache.evict.kept import KeptPositions, LayerKept
    from tqbench.tui.widgets.kept_map import _gone, head_losses, legend

    assert legend(88) == "88 positions over 64 columns, 1-2 per column (brighter: more of them kept)"
    assert legend(128) == "128 positions over 64 columns, 2 per column (brighter: more of them kept)"
    assert legend(40) == "40 positions, one per column"
    ragged = LayerKept(3, ((0, 1, 2, 5, 6, 7, 8, 9, 10), tuple(range(6)), tuple(range(6))), 4, 0, "turbo2")
    assert head_losses(ragged, 10) == "the layer's KV heads demoted 1/4/4 rows (heads 0-2)"
    uniform = LayerKept(4, (tuple(range(7)), tuple(range(7))), 2, 1, "")
    assert head_losses(uniform, 10) == "the layer's KV heads dropped 3 rows each: 2 at the prompt, 1 while decoding"
    assert _gone(KeptPositions("p", 10, 8, (ragged, uniform))) == "demoted to turbo2 or dropped"
    assert _gone(KeptPositions("p", 10, 8, (uniform,))) == "dropped"
