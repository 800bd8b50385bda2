"""Auto-policy in the Policies tab: a budget field that runs ``allocate_policy`` in a worker (per layer or per KV
head), then the per-layer K/V bits as a heatmap and the KL-vs-bits frontier of every preset and allocation measured
on the loaded model, on either of two texts the allocator never saw (``FRONTIER_TEXTS``: prose, technical).

The allocation takes its sink, recent window and context from the Policies builder's fields and is verified on both
texts; a minimum decode speed (the min-speed field, checked as typed by the engine's rules, as the CLI's
``--min-speed``) makes it keep the predicted speed relative to dense at or above it. The presets' points (ctrl+t)
are measured on the text the plot shows. Points are kept per model for the workbench session. The allocated policy
is kept (listed in Policies, saved with the session).
"""

from __future__ import annotations

import threading

from textual import on, work
from textual.actions import SkipAction
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import Button, Input, Label, ProgressBar, Select

from tqbench.engine.allocate.head_keeps import keeps_text
from tqbench.engine.codecs import is_calibrated_spec, is_head_list, split_head_list
from tqbench.engine.request import RequestError
from tqbench.tui.panes.jobs import cancel_job, engine_for_job, finish_job, run_engine_job
from tqbench.tui.widgets.frontier_plot import FrontierPlot
from tqbench.tui.widgets.heatmap import Heatmap

#: the presets the frontier measures (uniform bits, cheapest first)
FRONTIER_PRESETS = ("turbo2", "turbo2.5", "k3v2", "turbo3", "k4v2", "turbo3.5", "turbo4", "q8k-int4v")
#: where frontier points are measured: shipped texts of two kinds that no allocation or fit chooses on
FRONTIER_TEXTS = ("rivers", "heldout:technical")
FRONTIER = {"text": FRONTIER_TEXTS[0], "prefill": 1024, "steps": 256}
GRANULARITY_CHOICES = (("per layer", "layer"), ("per KV head", "head"))
#: what the budget is spent on (``allocate_policy``'s ``axes``): codec widths, + a keep fraction per layer, eviction
AXES_CHOICES = (("bits", "bits"), ("bits + tokens", "bits,tokens"), ("tokens", "tokens"))
#: with the tokens axis, what a layer's evicted rows may become (``allocate_policy``'s ``demote_codecs``)
DEMOTE_CHOICES = (("evicted: dropped", "none"), ("or demoted: turbo2", "turbo2"),
                  ("or demoted: turbo1/2", "turbo2,turbo1"))
#: a FrontierPoint's text label -> the frontier text it belongs to
_TEXT_LABELS = {f"corpus:{t}" if ":" not in t else t: t for t in FRONTIER_TEXTS}
#: the allocation's calibration (``allocate_policy`` arguments): the shipped mix of four kinds, as the CLI's default
CALIBRATION = {"calibration": "mix", "calib_prefill": 1024, "calib_steps": 32}
#: the workbench runs the CLI's measuring solver (``allocate_policy``'s defaults: the calibrated ``pcaq`` key choices
#: when the model has a fit, the sink/recent grid beside the builder's own, exchange steps, each measured jointly;
#: see docs/allocation.md), cells measured at the builder's sink/recent, verified on both frontier texts
#: (``protections``, ``max_measurements`` and ``k_codecs`` left at those defaults)
SOLVER = {"unseen_text": FRONTIER_TEXTS[1]}


#: what the min-speed field's value means (formatted with the value)
MIN_SPEED_NOTES = {"none": "no minimum decode speed",
                   "reference": "no slower than uniform {} fused (predicted)",
                   "given": "at least {:g}x dense decode tokens/s at the context (predicted)"}


def speed_suffix(speed) -> str:
    """A frontier point kind's speed class for an allocation's ``SpeedReport`` (none: ""): ``@fast`` when its
    decode speed relative to dense (measured where it was, else predicted) is at or above the minimum it was
    solved for (with no minimum: the uniform reference's), ``@slow`` below."""
    if speed is None:
        return ""
    ratio = speed.measured_ratio if speed.measured_ratio is not None else speed.predicted_ratio
    floor = speed.min_ratio if speed.min_ratio is not None else speed.reference_ratio
    return "@fast" if ratio >= floor - 1e-12 else "@slow"


class AllocatePanel(Vertical):
    HELP_SCOPE = "Policies · allocation"
    BINDINGS = [
        Binding("escape", "cancel", "Cancel", tooltip="Stop the running allocation or frontier",
                id="policies.cancel_allocate"),
    ]

    DEFAULT_CSS = """
    AllocatePanel { height: auto; border: round $panel; padding: 0 1; margin-top: 1; }
    AllocatePanel .row { height: 1; }
    AllocatePanel .row Label { width: 16; color: $text-muted; }
    AllocatePanel #budget { width: 10; }
    AllocatePanel #granularity { width: 16; margin-left: 1; }
    AllocatePanel #axes { width: 17; margin-left: 1; }
    AllocatePanel #frontier-text { width: 22; margin-left: 1; }
    AllocatePanel #alloc-bar { width: 30; margin-left: 2; }
    AllocatePanel #min-speed { width: 10; }
    AllocatePanel #min-speed-note { width: 1fr; margin-left: 1; color: $text-muted; }
    AllocatePanel #demote-codecs { width: 24; margin-left: 1; }
    AllocatePanel #min-speed-note.-error { color: $error; }
    AllocatePanel #alloc-status { width: 1fr; height: auto; }
    AllocatePanel #alloc-body { height: 18; }
    AllocatePanel #alloc-heatmap { width: 40; height: 18; }
    AllocatePanel #frontier-plot { width: 1fr; height: 18; }
    """

    class Finished(Message):
        def __init__(self, result, error: str | None, cancelled: bool, kind: str) -> None:
            super().__init__()
            self.result, self.error, self.cancelled, self.kind = result, error, cancelled, kind

    class _Event(Message):
        def __init__(self, event) -> None:
            super().__init__()
            self.event = event

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.running = False
        self.status = "idle"
        self.result = None  # the last AllocationReport
        from tqbench.engine.events import PhaseEta

        self._eta = PhaseEta()  # reset as each job starts
        #: text -> label -> (FrontierPoint, kind: "preset" / "layer" / "head", "+pcaq" with calibrated keys)
        self.points: dict[str, dict[str, tuple]] = {t: {} for t in FRONTIER_TEXTS}
        self.frontier = dict(FRONTIER)
        self.calibration = dict(CALIBRATION)
        self._cancel = threading.Event()
        self._points_model: str | None = None

    def compose(self) -> ComposeResult:
        with Horizontal(classes="row"):
            yield Label("budget bits/el")
            yield Input("3.0", id="budget", compact=True, type="number",
                        tooltip="Enter: allocate the best policy within this budget")
            yield Select(GRANULARITY_CHOICES, value="layer", id="granularity", compact=True, allow_blank=False,
                         tooltip="one codec width per layer and role, or per KV head")
            yield Select(AXES_CHOICES, value="bits", id="axes", compact=True, allow_blank=False,
                         tooltip="spend the budget on codec widths, on a keep fraction per layer (token eviction, "
                                 "the builder's score), or both")
            yield Button("Allocate ⏎", id="allocate", compact=True, variant="primary")
            yield Button("Frontier ^t", id="frontier-button", compact=True)
            yield Select([(t, t) for t in FRONTIER_TEXTS], value=FRONTIER_TEXTS[0], id="frontier-text", compact=True,
                         allow_blank=False, tooltip="the text the frontier plot shows (ctrl+t measures the presets on it)")
            yield ProgressBar(total=1, show_eta=False, id="alloc-bar")  # idle: an empty bar (no total animates)
        with Horizontal(classes="row"):
            yield Label("min speed")
            yield Input("none", id="min-speed", compact=True,
                        tooltip="Minimum decode tokens/s relative to a dense cache at the context (fused mode, predicted "
                                "by a cost model measured on this machine once): a ratio above 0 (e.g. 0.8), turbo4 (no "
                                "slower than uniform turbo4) or none (the CLI's default is turbo4)")
            yield Select(DEMOTE_CHOICES, value="none", id="demote-codecs", compact=True, allow_blank=False,
                         tooltip="with the tokens axis: a layer's evicted rows dropped, or kept at a cheaper codec "
                                 "where that costs less KL for the bytes (demote@LAYERS=codec, chosen per layer)")
            yield Label(MIN_SPEED_NOTES["none"], id="min-speed-note")
        yield Label("enter a budget: the allocation uses the sink, recent window and context above", id="alloc-status")
        with Horizontal(id="alloc-body"):
            yield Heatmap(id="alloc-heatmap")
            yield FrontierPlot(id="frontier-plot")

    # ---- running ---------------------------------------------------------------------------------
    def _builder(self):
        """The Policies pane holding this panel (found by what it offers: no import of policies.py, which
        imports this module)."""
        return next(a for a in self.ancestors if hasattr(a, "keep_policy") and hasattr(a, "context"))

    def _settings(self) -> tuple[float, int, int, int]:
        pane = self._builder()
        text = self.query_one("#budget", Input).value.strip()
        try:
            budget = float(text)
        except ValueError:
            raise ValueError(f"budget {text!r} is not a number: type bits per element, e.g. 3.0") from None
        from tqbench.engine.allocate import DEFAULT_CODECS, check_budget

        tokens = "tokens" in self.query_one("#axes", Select).value
        check_budget(budget, () if tokens else DEFAULT_CODECS)  # the engine's bounds (the CLI checks the same)
        ints = []
        for field in ("sink", "recent"):
            val = pane.query_one(f"#{field}", Input).value.strip() or "0"
            try:
                ints.append(int(val))
            except ValueError:
                raise ValueError(f"{field} {val!r} is not a whole number: fix it in the builder") from None
        return budget, ints[0], ints[1], pane.context()

    def _min_speed(self):
        """The min-speed field as ``allocate_policy``'s ``min_speed``: None (no minimum), the uniform reference's
        name or a ratio; ``RequestError`` for a value the engine refuses (its rules, which the CLI checks too)."""
        from tqbench.engine.allocate.budget import REFERENCE, resolve_min_speed
        from tqbench.engine.allocate.keeps import parse_axes, speed_rule

        text = self.query_one("#min-speed", Input).value.strip()
        ratio, source = resolve_min_speed(text)
        speed_rule(parse_axes(self.query_one("#axes", Select).value), text)
        return {"none": None, "reference": REFERENCE, "given": ratio}[source]

    @on(Input.Changed, "#min-speed")
    @on(Select.Changed, "#axes")
    def _check_min_speed(self) -> bool:
        """The min-speed field's meaning beside it, or (a value the engine refuses) its error; False for an error."""
        field, note = self.query_one("#min-speed", Input), self.query_one("#min-speed-note", Label)
        try:
            value = self._min_speed()
        except RequestError as exc:
            field.add_class("-invalid")
            note.add_class("-error")
            note.update(exc.spelled("min speed"))
            return False
        field.remove_class("-invalid")
        note.remove_class("-error")
        note.update(MIN_SPEED_NOTES["none" if value is None else "reference" if isinstance(value, str) else "given"]
                    .format(value))
        return True

    def _start(self, kind: str, engine) -> None:
        self.running = True
        self.status = "running"
        self._cancel.clear()
        self._eta = type(self._eta)()  # time left per phase, by the engine's one ETA rule (events.PhaseEta)
        self.query_one("#alloc-bar", ProgressBar).update(total=None, progress=0)
        self._forget_other_model(engine)

    @on(Input.Submitted, "#budget")
    @on(Input.Submitted, "#min-speed")
    @on(Button.Pressed, "#allocate")
    def action_allocate(self) -> None:
        engine = engine_for_job(self, "allocation")
        if engine is None:
            return
        try:
            budget, sink, recent, context = self._settings()
        except ValueError as exc:
            self.app.notify(str(exc), title="cannot allocate", severity="error")
            return
        if not self._check_min_speed():  # the error stays beside the field
            return
        min_speed = self._min_speed()
        granularity = self.query_one("#granularity", Select).value
        axes = self.query_one("#axes", Select).value
        demote = self.query_one("#demote-codecs", Select).value if "tokens" in axes else "none"
        self._start("allocate", engine)
        self.query_one("#alloc-status", Label).update(
            f"allocating {budget:g} bits/element at {context} tokens over {axes}, per "
            f"{'KV head' if granularity == 'head' else 'layer'}"
            + (f", min speed {min_speed}" if min_speed is not None else "")
            + (f", evicted rows dropped or demoted to {demote}" if demote != "none" else "") + " ...")
        self._allocate(engine, budget, sink, recent, context, granularity, axes, min_speed, demote)

    @work(thread=True, exclusive=True, group="allocate", exit_on_error=False)
    def _allocate(self, engine, budget, sink, recent, context, granularity, axes="bits", min_speed=None,
                  demote_codecs="none") -> None:
        from tqbench.engine import allocate_policy
        from tqbench.sessions.store import data_dir

        result, error, cancelled = run_engine_job(lambda: allocate_policy(
            engine, budget, base=f"sink={sink},recent={recent}", context=context, granularity=granularity, axes=axes,
            name=f"alloc-{budget:g}bit" + ("-head" if granularity == "head" else ""),
            verify_text=FRONTIER_TEXTS[0], verify_prefill=self.frontier["prefill"],
            verify_steps=self.frontier["steps"], partial_dir=str(data_dir() / "allocate"), **self.calibration, **SOLVER,
            min_speed=min_speed, demote_codecs=demote_codecs,
            on_event=lambda ev: self.post_message(self._Event(ev)), cancel=self._cancel.is_set))
        self.post_message(self.Finished(result, error, cancelled, "allocate"))

    def action_frontier(self) -> None:
        engine = engine_for_job(self, "frontier")
        if engine is None:
            return
        try:
            context = self._settings()[3]
        except ValueError as exc:
            self.app.notify(str(exc), title="cannot measure the frontier", severity="error")
            return
        self._start("frontier", engine)
        text = self.frontier["text"]
        todo = [p for p in FRONTIER_PRESETS if p not in self.points[text]]
        self.query_one("#alloc-status", Label).update(f"measuring {len(todo)} presets on {text} ...")
        self._frontier(engine, todo, context)

    @on(Button.Pressed, "#frontier-button")
    def _frontier_pressed(self) -> None:
        self.action_frontier()

    @work(thread=True, exclusive=True, group="allocate", exit_on_error=False)
    def _frontier(self, engine, todo, context) -> None:
        from tqbench.engine import frontier

        result, error, cancelled = run_engine_job(lambda: frontier(
            engine, todo, context=context, **self.frontier,
            on_event=lambda ev: self.post_message(self._Event(ev)), cancel=self._cancel.is_set) if todo else [])
        self.post_message(self.Finished(result, error, cancelled, "frontier"))

    def action_cancel(self) -> bool:
        """Escape stops this panel's job; with none running the key goes on to the app's cancel."""
        if not cancel_job(self, "#alloc-status"):
            raise SkipAction()
        return True

    @on(_Event)
    def _event(self, msg: _Event) -> None:
        from tqbench.engine.events import Progress, SensitivityMeasured, TeacherForcedStep

        ev = msg.event
        bar = self.query_one("#alloc-bar", ProgressBar)
        status = self.query_one("#alloc-status", Label)
        eta = self._eta.update(ev.task, ev.done, ev.total) if isinstance(ev, Progress) else ""
        if isinstance(ev, SensitivityMeasured):
            bar.update(total=ev.total, progress=ev.done)
            text = f"sensitivity {ev.done}/{ev.total}: {ev.message}" + (" (resumed)" if ev.resumed else "")
        elif isinstance(ev, TeacherForcedStep):
            bar.update(total=ev.total, progress=ev.done)
            text = f"verifying: {ev.task} step {ev.done}/{ev.total}"
        elif isinstance(ev, Progress):  # setup, solve, measure (joint measurements), verify
            if ev.total:
                bar.update(total=ev.total, progress=ev.done)
            text = f"{ev.task} {ev.done:g}/{ev.total:g}: {ev.message}" if ev.total else f"{ev.task}: {ev.message}"
        else:
            return
        status.update(f"{text} · {eta}" if eta else text)

    @on(Finished)
    def _finished(self, msg: Finished) -> None:
        if msg.kind == "frontier" and not msg.error and not msg.cancelled:
            self.running = False
            self.status = "done"
            text = self.frontier["text"]
            for p in msg.result:
                self.points[text][p.kv_policy] = (p, "preset")
            self.query_one("#alloc-status", Label).update(
                f"frontier on {text}: {len(self.points[text])} policies measured")
            self.redraw_plot()
            return
        finish_job(self, msg, "#alloc-status", "allocation" if msg.kind == "allocate" else "frontier")

    # ---- showing ---------------------------------------------------------------------------------
    def _forget_other_model(self, engine) -> None:
        if self._points_model != engine.loaded.fingerprint:
            for pts in self.points.values():
                pts.clear()
            self._points_model = engine.loaded.fingerprint

    def show_result(self, rep) -> None:
        """An ``AllocationReport``: its bits heatmap, its frontier point; the policy is kept (Policies list)."""
        self.result = rep
        a = rep.allocation
        hm = self.query_one("#alloc-heatmap", Heatmap)
        hm.set_data(a.bits_grid(), list(range(len(a.k))), higher_is_worse=False, columns=["K bits", "V bits"])
        hm.border_title = f"{a.policy.label}: bits per layer"
        v = rep.verified
        calibrated = any(is_calibrated_spec(e) for c in a.k for e in (split_head_list(c) if is_head_list(c) else [c]))
        kind = ("evict" if a.policy.evicts else rep.setup.get("granularity", "layer")) + ("+pcaq" if calibrated else "") + speed_suffix(rep.speed)
        for point in (v, rep.unseen):
            if point is not None and point.text in _TEXT_LABELS:
                self.points[_TEXT_LABELS[point.text]][a.policy.label] = (point, kind)
        self.query_one("#alloc-bar", ProgressBar).update(total=1, progress=1)
        self.query_one("#alloc-status", Label).update(
            f"[b]{a.policy.label}[/b]: {a.bits_per_element:.3f} bits/element at {a.estimate.seq_len} tokens "
            f"({a.estimate.total_bytes} B)" + (f" · verified KL [b]{v.kl_mean:.4f}[/b], top-1 {v.top1_agreement:.3f}"
                                                  f" on {v.text}" if v else "")
            + (f" · {rep.unseen.kl_mean:.4f} on {rep.unseen.text}" if rep.unseen else "")
            + f" · {rep.measured_cells} cells measured, {rep.resumed_cells} reused · kept as {a.policy.label}"
            + (f" · bytes saved by codecs {rep.axes['saved_by_codecs']}, by eviction {rep.axes['saved_by_eviction']};"
               " keep per layer " + keeps_text(rep.axes)
               if rep.axes else ""))
        self._builder().keep_policy(a.policy.label, a.policy.to_string())
        self.redraw_plot()

    @on(Select.Changed, "#frontier-text")
    def _text_changed(self, event: Select.Changed) -> None:
        self.frontier["text"] = event.value
        self.redraw_plot()

    def redraw_plot(self) -> None:
        pts = {label: (p.bits_per_element, p.kl_mean, kind) for label, (p, kind) in self.points[self.frontier["text"]].items()}
        f = self.frontier
        self.query_one("#frontier-plot", FrontierPlot).set_points(
            pts, f"{f['text']}: {f['prefill']} prefill + {f['steps']} steps · {len(pts)} points")
