"""Scan: capture real Q/K/V in a worker, then heatmaps of layers x KV heads and a suggested policy."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from textual import on, work
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import Button, DataTable, Input, Label, ProgressBar, Select, Static

from tqbench.constants import DEFAULT_PROMPT
from tqbench.tui.panes.jobs import cancel_job, engine_for_job, finish_job, run_engine_job
from tqbench.tui.widgets.heatmap import Heatmap

if TYPE_CHECKING:
    from tqbench.engine.scan import ScanResult

#: heatmap choices: (label, metric key, where it lives, higher is worse)
METRICS = (
    ("K error (rel. MSE)", "k_rel_mse", "metrics", True),
    ("V error (rel. MSE)", "v_rel_mse", "metrics", True),
    ("score error (rel.)", "score_rel_err", "metrics", True),
    ("softmax KL", "softmax_kl", "metrics", True),
    ("attention output error", "attn_out_rel_err", "metrics", True),
    ("score cosine", "score_cosine", "metrics", False),
    ("K norm", "k_norm", "norms", True),
    ("V norm", "v_norm", "norms", True),
    ("K/V norm ratio", "kv_norm_ratio", "norms", True),
)


class ScanPane(Vertical):
    DEFAULT_CSS = """
    ScanPane { height: 1fr; }
    ScanPane .controls { height: 1; }
    ScanPane .controls Label { padding: 0 1; color: $text-muted; }
    ScanPane #scan-prompt { width: 1fr; }
    ScanPane #scan-layers { width: 16; }
    ScanPane #scan-codecs { width: 1fr; }
    ScanPane #scan-tokens { width: 7; }
    ScanPane #scan-button, ScanPane #use-suggested { margin-left: 1; }
    ScanPane #scan-progress { height: auto; }
    ScanPane #scan-progress ProgressBar { width: 40; }
    ScanPane #scan-status { width: 1fr; height: auto; padding: 0 1; }
    ScanPane #scan-body { height: 1fr; }
    ScanPane #heatmap { width: 1fr; }
    ScanPane #cell-detail { width: 46; border: round $panel; padding: 0 1; }
    ScanPane #metric { width: 30; }
    ScanPane #codec { width: 16; }
    ScanPane #suggested-row { height: auto; }
    ScanPane #suggested { width: 1fr; height: auto; padding: 0 1; background: $boost; }
    ScanPane #use-suggested { width: auto; }
    """

    class Finished(Message):
        def __init__(self, result, error: str | None, cancelled: bool) -> None:
            super().__init__()
            self.result = result
            self.error = error
            self.cancelled = cancelled

    class _Event(Message):
        def __init__(self, event) -> None:
            super().__init__()
            self.event = event

    def __init__(self, params: dict | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.initial = params or {}
        self.running = False
        self.status = "idle"
        self.result: ScanResult | None = None
        self._cancel = threading.Event()

    def compose(self) -> ComposeResult:
        from tqbench.engine.scan import DEFAULT_CODECS

        p = self.initial
        with Horizontal(classes="controls"):
            yield Label("prompt")
            yield Input(p.get("prompt", DEFAULT_PROMPT), id="scan-prompt", compact=True)
            yield Label("layers")
            yield Input(p.get("layers") or "", id="scan-layers", compact=True, placeholder="all (0,3,-1 first2)")
        with Horizontal(classes="controls"):
            yield Label("codecs")
            yield Input(p.get("codecs") or ",".join(DEFAULT_CODECS), id="scan-codecs", compact=True)
            yield Label("max prompt tokens")
            yield Input(str(p.get("max_prompt_tokens", 512)), id="scan-tokens", compact=True, type="integer")
            yield Button("Scan ^r", id="scan-button", compact=True, variant="primary")
        with Horizontal(id="scan-progress"):
            yield ProgressBar(total=1, show_eta=False, id="scan-bar")  # idle: an empty bar (no total animates)
            yield Label("ready: ctrl+r scans the prompt's K/V with every codec", id="scan-status")
        with Horizontal(classes="controls"):
            yield Label("heatmap")
            yield Select([(m[0], m[1]) for m in METRICS], value="k_rel_mse", id="metric", compact=True,
                         allow_blank=False)
            yield Label("codec")
            yield Select([(c, c) for c in DEFAULT_CODECS], value=DEFAULT_CODECS[0], id="codec", compact=True,
                         allow_blank=False)
        with Horizontal(id="scan-body"):
            yield Heatmap(id="heatmap")
            yield Static("select a cell to see its numbers", id="cell-detail")
        with Horizontal(id="suggested-row", classes="controls"):
            yield Static("", id="suggested")
            # enabled before a scan too (it then says to scan first): a disabled button is skipped by Tab
            yield Button("Run suggested policy", id="use-suggested", compact=True,
                         tooltip="Run the scan's suggested policy as Run's candidate beside the baseline")

    # ---- running ---------------------------------------------------------------------------------
    @on(Button.Pressed, "#scan-button")
    def action_scan(self) -> None:
        from tqbench.engine.scan import resolve_codecs

        engine = engine_for_job(self, "scan")
        if engine is None:
            return
        try:
            prompt = self.query_one("#scan-prompt", Input).value
            if not prompt.strip():
                raise ValueError("the prompt is empty: type some text in the prompt field")
            codecs = resolve_codecs(self.query_one("#scan-codecs", Input).value)
            layers = self.query_one("#scan-layers", Input).value.strip() or None
            tokens = int(self.query_one("#scan-tokens", Input).value or "512")
            if tokens < 1:
                raise ValueError(f"max prompt tokens {tokens} is invalid: use at least 1")
        except ValueError as exc:
            self.app.notify(str(exc).splitlines()[0], title="cannot scan", severity="error")
            return
        self.running = True
        self.status = "running"
        self._cancel.clear()
        bar = self.query_one("#scan-bar", ProgressBar)
        bar.update(total=None, progress=0)
        self.query_one("#scan-status", Label).update("capturing Q/K/V ...")
        self._scan(engine, prompt, layers, codecs, tokens)

    @work(thread=True, exclusive=True, group="scan", exit_on_error=False)
    def _scan(self, engine, prompt, layers, codecs, tokens) -> None:
        from tqbench.engine.scan import scan

        result, error, cancelled = run_engine_job(lambda: scan(
            engine, prompt, layers=layers, codecs=codecs, max_prompt_tokens=tokens,
            on_event=lambda ev: self.post_message(self._Event(ev)), cancel=self._cancel.is_set))
        self.post_message(self.Finished(result, error, cancelled))

    def action_cancel(self) -> bool:
        return cancel_job(self, "#scan-status")

    @on(_Event)
    def _event(self, msg: _Event) -> None:
        from tqbench.engine.events import Progress, ScanLayerDone

        ev = msg.event
        if isinstance(ev, ScanLayerDone):
            bar = self.query_one("#scan-bar", ProgressBar)
            bar.update(total=ev.total, progress=ev.index + 1)
            self.query_one("#scan-status", Label).update(f"layer {ev.layer} done ({ev.index + 1}/{ev.total})")
        elif isinstance(ev, Progress):
            self.query_one("#scan-status", Label).update(ev.message)

    @on(Finished)
    def _finished(self, msg: Finished) -> None:
        finish_job(self, msg, "#scan-status", "scan")

    # ---- showing ---------------------------------------------------------------------------------
    def show_result(self, result: ScanResult, note: str = "") -> None:
        self.result = result
        self.query_one("#scan-codecs", Input).value = ",".join(result.codecs)
        codec_sel = self.query_one("#codec", Select)
        codec_sel.set_options([(c, c) for c in result.codecs])
        codec_sel.value = result.codecs[0]
        n = len(result.layers)
        self.query_one("#scan-bar", ProgressBar).update(total=n, progress=n)
        self.query_one("#scan-status", Label).update(
            note or f"done: {n} layers x {result.kv_heads} KV heads, {len(result.codecs)} codecs in "
            f"{result.seconds:.1f}s")
        self.query_one("#suggested", Static).update(
            f"suggested policy: [b]{result.suggest_policy()}[/b]  (cheapest codec per layer meeting the "
            f"thresholds; fp16 where none did)")
        self.redraw()
        self.show_cell(0, 0)

    @on(Select.Changed)
    def redraw(self, event=None) -> None:
        if self.result is None:
            return
        metric = self.query_one("#metric", Select).value
        codec = self.query_one("#codec", Select).value
        spec = next(m for m in METRICS if m[1] == metric)
        if spec[2] == "metrics":
            values = self.result.metrics[metric].get(codec)
            if values is None:
                return
            title = f"{spec[0]} · {codec}"
        else:
            values = self.result.norms[metric]
            title = spec[0]
        hm = self.query_one("#heatmap", Heatmap)
        hm.set_data(values, self.result.layers, higher_is_worse=spec[3])
        hm.border_title = f"{title} · layers x KV heads"

    @on(DataTable.CellHighlighted, "#heatmap")
    def _cell(self, event: DataTable.CellHighlighted) -> None:
        if self.result is None:
            return
        row, col = event.coordinate.row, event.coordinate.column
        if col == 0 or row >= len(self.result.layers):
            return
        self.show_cell(row, col - 1)

    def show_cell(self, row: int, head: int) -> None:
        r = self.result
        layer = r.layers[row]
        lines = [f"[b]layer {layer}, KV head {head}[/b]"]
        for key in ("k_norm", "v_norm", "kv_norm_ratio"):
            lines.append(f"{key:<16} {r.norms[key][row][head]:.4g}")
        verdict = next((v for v in r.verdicts if v["layer"] == layer), None)
        lines.append("")
        lines.append(f"{'codec':<10}{'K mse':>7}{'V mse':>7}{'KL':>9}{'out':>7}")
        m = r.metrics
        for c in r.codecs:
            lines.append(f"{c:<10}{m['k_rel_mse'][c][row][head]:7.4f}{m['v_rel_mse'][c][row][head]:7.4f}"
                         f"{m['softmax_kl'][c][row][head]:9.1e}{m['attn_out_rel_err'][c][row][head]:7.3f}")
        if verdict:
            lines.append("")
            lines.append(f"passing: {', '.join(verdict['passing']) or 'none'}")
            lines.append(f"cheapest: [b]{verdict['cheapest'] or 'none (keep fp16)'}[/b]")
        self.query_one("#cell-detail", Static).update("\n".join(lines))

    class UsePolicy(Message):
        def __init__(self, policy: str) -> None:
            super().__init__()
            self.policy = policy

    @on(Button.Pressed, "#use-suggested")
    def action_use_suggested(self) -> None:
        if self.result is None:
            self.app.notify("run a scan first (ctrl+r on this tab)", severity="warning")
            return
        self.post_message(self.UsePolicy(self.result.suggest_policy()))
