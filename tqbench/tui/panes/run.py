"""Run: a prompt, then baseline and candidate generate side by side in lockstep (``Engine.lockstep``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from textual import on, work
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.suggester import SuggestFromList
from textual.widgets import Button, Checkbox, Input, Label, Select, TextArea

from tqbench.constants import (
    CACHE_MODE_RESIDENT,
    CACHE_MODES,
    DEFAULT_PROMPT,
    DENSE_BASELINES,
    dense_baseline_kv,
    fastest_quality_mode,
)
from tqbench.tui.panes.jobs import notify_policy_warnings
from tqbench.tui.widgets.graph import ThroughputGraph
from tqbench.tui.widgets.kept_map import KeptMap
from tqbench.tui.widgets.model_bar import RunStrip
from tqbench.tui.widgets.prompt_box import PromptBox
from tqbench.tui.widgets.token_view import TokenView


@dataclass(frozen=True)
class RunParams:
    prompt: str
    chat: bool
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    baseline: str
    candidate: str
    cache_mode: str

    @property
    def sampling(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed}

    @property
    def request(self):
        """The engine's ``GenerationRequest`` (validated: the same rules and messages as the CLI and server)."""
        from tqbench.engine import GenerationRequest

        return GenerationRequest(self.max_new_tokens, self.temperature, self.top_p, self.seed)


@dataclass(frozen=True)
class Tok:
    token_id: int
    text: str
    step_seconds: float


class RunPane(Vertical):
    """The Run tab. Long work runs in a thread worker; escape sets the cancel flag the engine checks every step."""

    # ctrl+r (run) and escape (cancel) are app bindings: they work from every tab

    DEFAULT_CSS = """
    RunPane { height: 1fr; }
    RunPane #prompt { height: 4; border: round $panel; }
    RunPane .controls { height: 1; margin: 0 0 0 0; }
    RunPane .controls Label { padding: 0 1; color: $text-muted; }
    RunPane #baseline { width: 16; }
    RunPane #candidate { width: 1fr; min-width: 20; }
    RunPane #mode { width: 18; }
    RunPane #first-controls { height: auto; }
    RunPane #mode-note { width: 1fr; min-width: 24; height: auto; }
    RunPane #max-tokens { width: 7; }
    RunPane #temperature, RunPane #top-p { width: 7; }
    RunPane #seed { width: 7; }
    RunPane #chat { width: auto; }
    RunPane #run-button { margin-left: 1; min-width: 9; }
    RunPane #texts { height: 3fr; min-height: 5; }
    RunPane ThroughputGraph { height: 2fr; min-height: 8; max-height: 20; }
    RunPane KeptMap { height: 3fr; min-height: 10; display: none; }
    """

    class Finished(Message):
        """A run ended (done, cancelled or failed); ``record`` is the session's ``RunRecord``."""

        def __init__(self, record, error: str | None, cancelled: bool, savings=None) -> None:
            super().__init__()
            self.record = record
            self.error = error
            self.cancelled = cancelled
            self.savings = savings  # engine.cache.savings.Savings of the candidate at the length it held

    class _Event(Message):
        def __init__(self, event: object) -> None:
            super().__init__()
            self.event = event

    def __init__(self, params: RunParams | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.initial = params
        self.running = False
        self._cancel = threading.Event()
        self.record = None  # the RunRecord on screen
        self.steps = 0
        # the run's per-step arrays; ``metrics.pair_summary`` turns them into the strip's numbers
        self._same_token: list[bool] = []
        self._same_top1: list[bool] = []
        self._kl: list[float | None] = []
        self._produced = {"baseline": 0, "candidate": 0}  # tokens each side produced (a cancel may cut one short)
        self._cancelled: tuple[int, int] | None = None  # (baseline, candidate) tokens of a cancelled run
        self._savings = None  # cache.savings.Savings of the finished run's candidate (None: saves, or unknown)
        self._diff_note = ""
        self.status = "idle"
        self.on_finish = None  # callback(record) set by the app for re-run-and-diff
        self._mode_chosen = False  # the user (or a saved run) picked the candidate's cache mode
        self.kept = None  # the engine's KeptTokens of the candidate's last run (a policy that evicts tokens)

    # ---- layout ----------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        p = self.initial
        from tqbench.engine.policy import PRESETS

        presets = list(PRESETS)
        yield PromptBox(p.prompt if p else DEFAULT_PROMPT, id="prompt")
        with Horizontal(id="first-controls", classes="controls"):
            yield Label("baseline")
            yield Input(p.baseline if p else "fp16", id="baseline", compact=True,
                        suggester=SuggestFromList([*DENSE_BASELINES, *presets]),
                        tooltip="Baseline: a policy (preset or compact form) or a dense DynamicCache: dense (K/V in the "
                                "model's dtype), dense-fp16 or dense-bf16 (K/V rows stored in 16 bits)")
            yield Label("candidate")
            yield Input(p.candidate if p else "turbo4", id="candidate", compact=True,
                        suggester=SuggestFromList(presets), tooltip="Candidate policy: a preset, k=...,v=... or a file")
            mode = p.cache_mode if p else fastest_quality_mode("cpu")
            yield Select([(m, m) for m in CACHE_MODES], value=mode, id="mode", compact=True, allow_blank=False,
                         tooltip="Candidate cache mode (default: the fastest mode whose quality claims hold here)")
            yield Label(CACHE_MODE_RESIDENT[mode], id="mode-note")
        with Horizontal(classes="controls"):
            yield Label("max tokens")
            yield Input(str(p.max_new_tokens if p else 48), id="max-tokens", compact=True, type="integer")
            yield Checkbox("chat", p.chat if p else True, id="chat", compact=True, tooltip="Apply the chat template")
            yield Label("temperature")
            yield Input(str(p.temperature if p else 0.0), id="temperature", compact=True, type="number",
                        tooltip="0 = greedy; > 0 samples with the seed")
            yield Label("top-p")
            yield Input(str(p.top_p if p else 1.0), id="top-p", compact=True, type="number")
            yield Label("seed")
            yield Input(str(p.seed if p else 0), id="seed", compact=True, type="integer")
            yield Button("Run ^r", id="run-button", compact=True, variant="primary")
        with Horizontal(id="texts"):
            yield TokenView("baseline", id="baseline-view")
            yield TokenView("candidate", id="candidate-view")
        yield RunStrip("ready: write a prompt, pick a candidate policy, press ctrl+r", id="strip")
        yield ThroughputGraph(id="graph")
        yield KeptMap(id="kept-map")

    # ---- reading the form ------------------------------------------------------------------------
    def params(self) -> RunParams:
        """The form as ``RunParams``; bad input raises ``ValueError`` with a message naming the field."""
        from tqbench.engine.policy import parse_policy

        def num(widget_id: str, kind, what: str):
            raw = self.query_one(f"#{widget_id}", Input).value.strip()
            try:
                return kind(raw)
            except ValueError:
                raise ValueError(f"{what} {raw!r} is not a number") from None

        prompt = self.query_one("#prompt", TextArea).text
        if not prompt.strip():
            raise ValueError("the prompt is empty: type some text in the prompt box")
        max_new = num("max-tokens", int, "max tokens")
        base = self.query_one("#baseline", Input).value.strip() or "fp16"
        cand = self.query_one("#candidate", Input).value.strip()
        if base not in DENSE_BASELINES:  # dense, dense-fp16, dense-bf16: a DynamicCache, not a policy
            parse_policy(base)
        parse_policy(cand)
        p = RunParams(prompt, self.query_one("#chat", Checkbox).value, max_new, num("temperature", float, "temperature"),
                      num("top-p", float, "top-p"), num("seed", int, "seed"), base, cand,
                      str(self.query_one("#mode", Select).value))
        p.request  # noqa: B018  (validates max tokens, temperature, top-p)
        return p

    def fill(self, params: dict) -> None:
        """Put a saved run's parameters into the form."""
        self.query_one("#prompt", TextArea).text = params["prompt"]
        self.query_one("#chat", Checkbox).value = bool(params["chat"])
        self.query_one("#max-tokens", Input).value = str(params["max_new_tokens"])
        s = params.get("sampling", {})
        self.query_one("#temperature", Input).value = str(s.get("temperature", 0.0))
        self.query_one("#top-p", Input).value = str(s.get("top_p", 1.0))
        self.query_one("#seed", Input).value = str(s.get("seed", 0))
        if params.get("baseline"):
            self.query_one("#baseline", Input).value = params["baseline"]
        self.query_one("#candidate", Input).value = params["candidate"]
        mode = params.get("candidate_mode") or "compressed"
        if mode in CACHE_MODES:
            self.query_one("#mode", Select).value = mode

    def params_or_defaults(self) -> dict:
        """The form as a ``fill`` dict, without validation."""
        def val(i: str) -> str:
            return self.query_one(f"#{i}", Input).value
        return {"prompt": self.query_one("#prompt", TextArea).text, "chat": self.query_one("#chat", Checkbox).value,
                "max_new_tokens": val("max-tokens"), "baseline": val("baseline"), "candidate": val("candidate"),
                "candidate_mode": str(self.query_one("#mode", Select).value),
                "sampling": {"temperature": val("temperature"), "top_p": val("top-p"), "seed": val("seed")}}

    def engine_ready(self, device_type: str) -> None:
        """The model is loaded: a mode nobody chose becomes the fastest quality-faithful one on its device."""
        if self.initial is None and not self._mode_chosen:
            with self.prevent(Select.Changed):
                self.query_one("#mode", Select).value = fastest_quality_mode(device_type)
            self._show_mode_note()

    @on(Select.Changed, "#mode")
    def _mode_changed(self) -> None:
        self._mode_chosen = True
        self._show_mode_note()

    def _show_mode_note(self) -> None:
        mode = str(self.query_one("#mode", Select).value)
        self.query_one("#mode-note", Label).update(CACHE_MODE_RESIDENT.get(mode, ""))

    def set_candidate(self, policy: str) -> None:
        """A candidate chosen elsewhere (Policies, Scan, Compare): the texts of another candidate's run leave the
        screen (a run in progress keeps its own)."""
        field = self.query_one("#candidate", Input)
        changed = field.value.strip() != policy
        field.value = policy
        if changed and not self.running:
            self.clear_shown()

    def clear_shown(self) -> None:
        """Empty texts, graph and figures, titled with the form's policies: nothing on screen belongs to a run
        of other settings."""
        key = self.app.key_for("app.run")
        base = self.query_one("#baseline", Input).value.strip() or "fp16"
        cand = self.query_one("#candidate", Input).value.strip()
        self.query_one("#baseline-view", TokenView).clear(f"baseline · {base}")
        self.query_one("#candidate-view", TokenView).clear(f"candidate · {cand} · not run yet: {key} runs it")
        self.query_one("#graph", ThroughputGraph).clear()
        self._clear_kept()
        self.steps = 0
        self._same_token, self._same_top1, self._kl = [], [], []
        self._diff_note = ""
        self.status = "ready"
        self._update_strip()

    # ---- running ---------------------------------------------------------------------------------
    @on(Button.Pressed, "#run-button")
    def _pressed(self) -> None:
        self.action_run()

    def action_run(self, on_finish=None) -> None:
        if self.running:
            self.app.notify("a run is already going: press escape to cancel it", severity="warning")
            return
        engine = getattr(self.app, "engine", None)
        if engine is None:
            self.app.notify("the model is still loading (or failed to load): wait for the header to show it",
                            severity="warning")
            return
        try:
            params = self.params()
        except ValueError as exc:
            self.app.notify(str(exc).splitlines()[0], title="cannot run", severity="error")
            return
        self.on_finish = on_finish
        notify_policy_warnings(self.app, engine, params.candidate, params.baseline)
        self._start(engine, params)

    def _start(self, engine, params: RunParams) -> None:
        from tqbench.engine.policy import parse_policy

        self.running = True
        self._cancel.clear()
        self.steps = 0
        self._same_token, self._same_top1, self._kl = [], [], []
        self._produced = {"baseline": 0, "candidate": 0}
        self._cancelled = None
        self._savings = None
        self._diff_note = ""
        self.status = "running"
        cand = parse_policy(params.candidate)
        base = self._base_title(params.baseline, str(engine.loaded.dtype).replace("torch.", ""))
        self.query_one("#baseline-view", TokenView).clear(f"baseline · {base}")
        self.query_one("#candidate-view", TokenView).clear(self._cand_title(cand.label, params.cache_mode))
        graph = self.query_one("#graph", ThroughputGraph)
        graph.clear()
        graph.set_names(base, f"{cand.label} ({params.cache_mode})")
        self._clear_kept()
        self.params_running = params
        self._update_strip()
        self._generate(engine, params)

    @staticmethod
    def _base_title(baseline: str, model_dtype: str | None) -> str:
        """``dense-fp16 (float16 K/V)`` for a dense baseline, ``fp16 (compressed)`` for a policy."""
        from tqbench.engine.policy import parse_policy

        if baseline in DENSE_BASELINES:
            kv = dense_baseline_kv(baseline, model_dtype) if model_dtype else DENSE_BASELINES[baseline]
            return f"{baseline} ({kv or 'model dtype'} K/V)"
        return f"{parse_policy(baseline).label} (compressed)"

    @staticmethod
    def _cand_title(label: str, mode: str) -> str:
        title = f"candidate · {label} ({mode})"
        if mode == "dense-shadow":
            title += " · storage-only: reads exact K/V"
        return title

    @work(thread=True, exclusive=True, group="run", exit_on_error=False)
    def _generate(self, engine, params: RunParams) -> None:
        from tqbench.engine.events import PairStep
        from tqbench.sessions import RunRecorder

        rec = RunRecorder(params.prompt, params.chat, params.max_new_tokens, params.sampling)
        error = None
        try:
            events = engine.lockstep(
                params.prompt, params.baseline, params.candidate, candidate_mode=params.cache_mode,
                chat=params.chat, max_new_tokens=params.max_new_tokens,
                sampling=params.request.sampling, collect_logits=True,
                cancel=self._cancel.is_set, track_bytes=True, track_kept=True,
            )
            for ev in events:
                rec(ev)
                if isinstance(ev, PairStep):  # drop the logits before crossing to the UI thread
                    ev = (ev.step, _tok(ev.baseline), _tok(ev.candidate), ev.same_token, ev.same_top1, ev.kl)
                self.post_message(self._Event(ev))
        except Exception as exc:  # shown in the app, which keeps running
            error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        savings = None
        report = rec.record.candidate.cache_report
        if error is None and report is not None:
            try:
                savings = engine.savings(params.candidate, params.baseline, report["tokens"])
            except Exception:  # noqa: BLE001 - a geometry the estimate cannot read: the strip shows the bytes only
                savings = None
        self.post_message(self.Finished(rec.record, error, self._cancel.is_set(), savings))

    def action_cancel(self) -> bool:
        if self.running:
            self._cancel.set()
            self.status = "cancelling"
            self._update_strip()
            return True
        return False

    @on(_Event)
    def _event(self, msg: _Event) -> None:
        from tqbench.engine.events import CacheBytes, KeptTokens

        ev = msg.event
        graph = self.query_one("#graph", ThroughputGraph)
        if isinstance(ev, tuple):
            step, b, c, same, top1, kl = ev
            self.steps = step + 1
            self._same_token.append(bool(same))
            self._same_top1.append(bool(top1))
            self._kl.append(kl)
            differs = not same
            for run, tok in (("baseline", b), ("candidate", c)):
                if tok is not None:
                    self._produced[run] += 1
                    self.query_one(f"#{run}-view", TokenView).add(tok.token_id, tok.text, differs and b is not None
                                                                  and c is not None)
                    if step > 0:
                        graph.add_step(run, tok.step_seconds)
            self._update_strip()
        elif isinstance(ev, CacheBytes):
            graph.add_bytes(ev.run, ev.resident_bytes)
        elif isinstance(ev, KeptTokens) and ev.run == "candidate":
            self.set_kept(ev)

    @on(Finished)
    def _finished(self, msg: Finished) -> None:
        self.running = False
        self.record = msg.record
        if msg.error:
            self.status = "failed"
            self.app.notify(msg.error, title="run failed", severity="error")
        else:
            self.status = "cancelled" if msg.cancelled else "done"
            if msg.cancelled:
                self._cancelled = (self._produced["baseline"], self._produced["candidate"])
            self._savings = msg.savings
        self._update_strip()
        callback, self.on_finish = self.on_finish, None
        if callback is not None and not msg.error:
            callback(msg.record)

    # ---- showing a saved run ---------------------------------------------------------------------
    def show_record(self, rec, note: str = "") -> None:
        """Render a ``RunRecord`` (from a session) exactly as a live run would have left the screen."""
        self.record = rec
        self._clear_kept()  # a session keeps no kept-token map
        self.fill(rec.params())
        self._mode_chosen = True  # the saved run's mode stays when the model loads
        views = {"baseline": self.query_one("#baseline-view", TokenView),
                 "candidate": self.query_one("#candidate-view", TokenView)}
        graph = self.query_one("#graph", ThroughputGraph)
        for run in ("baseline", "candidate"):
            side = getattr(rec, run)
            if side is None:
                views[run].clear(f"{run} · (none in this run)")
                continue
            texts = side.token_texts if side.has_token_texts else [f"[{i}]" for i in side.token_ids]
            views[run].set_tokens([(tid, text, rec.baseline is not None and i < rec.steps and not rec.same_token[i])
                                   for i, (tid, text) in enumerate(zip(side.token_ids, texts))])
        base = None
        if rec.baseline is not None:
            base = self._base_title(rec.baseline.policy, None) if rec.baseline.policy in DENSE_BASELINES \
                else f"{rec.baseline.policy} ({rec.baseline.cache_mode})"
        views["baseline"].border_title = f"baseline · {base or 'none'}"
        views["candidate"].border_title = self._cand_title(rec.candidate.policy, rec.candidate.cache_mode)
        graph.set_names(base or "", f"{rec.candidate.policy} ({rec.candidate.cache_mode})")
        graph.set_series(
            {r: getattr(rec, r).tokens_per_second for r in ("baseline", "candidate") if getattr(rec, r)},
            {r: getattr(rec, r).resident_bytes for r in ("baseline", "candidate") if getattr(rec, r)},
        )
        self.steps = rec.steps
        self._same_token, self._same_top1, self._kl = list(rec.same_token), list(rec.same_top1), list(rec.kl)
        self._cancelled = rec.cancelled_tokens
        self._savings = None
        self.status = "saved run"
        self._diff_note = note
        self._update_strip()

    # ---- which tokens each head kept ------------------------------------------------------------
    def _clear_kept(self) -> None:
        self.kept = None
        self.query_one("#kept-map", KeptMap).clear()
        self.show_kept(False)

    def set_kept(self, event) -> None:
        """The engine's ``KeptTokens`` of the candidate's run: drawn in the map (f8 shows it)."""
        self.kept = event
        self.query_one("#kept-map", KeptMap).show(event)
        self._update_strip()

    @property
    def kept_shown(self) -> bool:
        return self.query_one("#kept-map", KeptMap).display

    def show_kept(self, on: bool | None = None) -> bool:
        """Show the kept-token map in the graph's place (``on`` None: toggle); False when there is none to show."""
        on = not self.kept_shown if on is None else on
        if on and self.kept is None:
            return False
        kept_map = self.query_one("#kept-map", KeptMap)
        kept_map.display = on
        self.query_one("#graph", ThroughputGraph).display = not on
        if on:
            self.screen.set_focus(kept_map.query_one("#kept-strips"))
        elif self.screen.focused is not None and kept_map in self.screen.focused.ancestors:
            self.screen.set_focus(self.query_one("#run-button"))
        return True

    def set_diff_note(self, note: str) -> None:
        self._diff_note = note
        self._update_strip()

    def _update_strip(self) -> None:
        from tqbench.engine.metrics import pair_summary

        # the numbers validate reports; a cancelled run compares only the steps both sides produced
        summary = pair_summary(self._same_token, self._same_top1, self._kl, self._cancelled)
        n = summary.steps
        parts = [f"[b]{self.status}[/b]", f"step {self.steps}"]
        if summary.note:
            parts.append(f"[b yellow]{summary.note}[/]")
        if n:
            same, top1 = round(summary.token_match * n), round(summary.top1_agreement * n)
            parts.append(f"token match {same}/{n} ({100 * same / n:.0f}%)")
            parts.append(f"top-1 {top1}/{n}")
        if summary.kl_mean is not None:
            parts.append(f"KL same-context mean {summary.kl_mean:.4f} max {summary.kl_max:.4f}")
        if summary.first_divergence is not None:
            parts.append(f"[b #ffd700]▶ first divergence @ {summary.first_divergence}[/]")
        elif n:
            parts.append("[green]no divergence[/]")
        try:
            mode = str(self.query_one("#mode", Select).value)
        except Exception:
            mode = "compressed"
        rec = self.record if self.status not in ("running", "ready") else None
        if rec is not None and rec.candidate.cache_report:
            cr = rec.candidate.cache_report
            mode = cr["cache_mode"]
            parts.append(f"KV {cr['bits_per_element']:.2f} b/el, {cr['memory_saved_pct']:.1f}% saved")
        if self._savings is not None and not self._savings.saves:
            parts.append(f"[b yellow]{self._savings.message}[/]")
        parts.append(f"cache mode [b]{mode}[/b]")
        if mode == "dense-shadow":
            parts.append("[b yellow]dense-shadow: storage-only (outputs equal fp16 by construction)[/]")
        if self.kept is not None and self.status not in ("running", "ready"):
            parts.append(f"{self.app.key_for('app.kept')}: which tokens each head kept")
        if self._diff_note:
            parts.append(self._diff_note)
        self.query_one("#strip", RunStrip).update(" │ ".join(parts))

    # for tests and the app
    def token_views(self) -> tuple[TokenView, TokenView]:
        return self.query_one("#baseline-view", TokenView), self.query_one("#candidate-view", TokenView)


def _tok(ev) -> Tok | None:
    return None if ev is None else Tok(ev.token_id, ev.text_delta, ev.step_seconds)
