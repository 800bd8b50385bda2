"""Live throughput graph: tokens/s per step for both runs, and resident KV bytes over time (plotext 6)."""

from __future__ import annotations

import re

from rich.markup import escape
from rich.text import Text
from textual.widgets import Static

_BG = re.compile(r"\x1b\[48;[25];[0-9;]+m")
COLORS = {"baseline": "#5f87ff", "candidate": "#00d75f"}  # plotext's first two signal colours (12, 10)


class ThroughputGraph(Static):
    """Two plots side by side, redrawn from the series on every update (plotext's own figure API)."""

    DEFAULT_CSS = """
    ThroughputGraph { height: 1fr; min-height: 7; border: round $panel; padding: 0 1; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.tps: dict[str, list[float]] = {"baseline": [], "candidate": []}
        self.kv: dict[str, list[int]] = {"baseline": [], "candidate": []}
        self.set_names()

    def set_names(self, baseline: str = "", candidate: str = "") -> None:
        """Name what each line is (``baseline · dense-fp16 (float16 K/V)``): a ratio read off the graph says
        against what."""
        def name(run: str, what: str) -> str:
            what = escape(what)
            return f"[{COLORS[run]}]━ {run}{' · ' + what if what else ''}[/]"

        self.border_title = (f"throughput: {name('baseline', baseline)} {name('candidate', candidate)}"
                             " · left: tokens/s per step · right: resident KV MiB")

    def on_mount(self) -> None:
        self._dirty = False
        self.set_interval(0.25, self._redraw_if_dirty)  # plotext is not free: at most 4 redraws a second

    def _redraw_if_dirty(self) -> None:
        if self._dirty:
            self._dirty = False
            self.refresh()

    def clear(self) -> None:
        for series in (self.tps, self.kv):
            for v in series.values():
                v.clear()
        self.refresh()

    def add_step(self, run: str, step_seconds: float) -> None:
        self.tps[run].append(1.0 / step_seconds if step_seconds > 0 else 0.0)
        self._dirty = True

    def add_bytes(self, run: str, resident: int) -> None:
        self.kv[run].append(resident)
        self._dirty = True

    def set_series(self, tps: dict[str, list[float]], kv: dict[str, list[int]]) -> None:
        self.tps = {k: list(tps.get(k, [])) for k in ("baseline", "candidate")}
        self.kv = {k: list(kv.get(k, [])) for k in ("baseline", "candidate")}
        self.refresh()

    def render(self) -> Text:
        w, h = self.content_region.width, self.content_region.height
        if w < 20 or h < 4:
            return Text("")
        if not any(self.tps.values()) and not any(self.kv.values()):
            return Text("run a prompt to see tokens/s and KV bytes here", style="dim")
        import plotext as plt

        fig = plt.figure
        fig.clear()
        fig.plot_size(w, h)
        fig.subplots(1, 2)
        for col, (series, scale) in enumerate(((self.tps, 1.0), (self.kv, 1 / 2**20)), start=1):
            ax = fig.subplot(1, col)
            for run in ("baseline", "candidate"):
                ys = [y * scale for y in series[run]]
                if not ys:
                    ys = [0.0]  # keeps each run's colour in its place
                sig = ax.signal(list(range(1, len(ys) + 1)), ys)
                sig.lines()
                ax.draw(sig)
        return Text.from_ansi(_BG.sub("", fig.build().string()))
