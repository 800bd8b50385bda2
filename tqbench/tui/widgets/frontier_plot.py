"""KL vs bits per element: one point per measured policy, presets (o) and allocations (*) (plotext 6)."""

from __future__ import annotations

import math
import re

from rich.text import Text
from textual.widgets import Static

_BG = re.compile(r"\x1b\[48;[25];[0-9;]+m")
KL_FLOOR = 1e-6  # log scale: a KL of 0 (a lossless policy) is drawn at this floor


class FrontierPlot(Static):
    """``set_points(points)`` with ``points``: ``{label: (bits_per_element, kl, kind)}``, kind "preset" or
    "allocation". The y axis is log10 of the teacher-forced KL."""

    DEFAULT_CSS = """
    FrontierPlot { height: 1fr; min-height: 10; border: round $panel; padding: 0 1; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.points: dict[str, tuple[float, float, str]] = {}
        self.border_title = "frontier: log10 KL vs bits/element · o presets · * allocations"

    def set_points(self, points: dict[str, tuple[float, float, str]], subtitle: str = "") -> None:
        self.points = dict(points)
        self.border_subtitle = subtitle
        self.refresh()

    def render(self) -> Text:
        w, h = self.content_region.width, self.content_region.height
        if w < 20 or h < 5:
            return Text("")
        if not self.points:
            return Text("allocate a budget (enter in the budget field) or measure the presets (ctrl+t) to plot "
                        "the frontier here", style="dim")
        import plotext as plt

        fig = plt.figure
        fig.clear()
        fig.plot_size(w, h)
        for kind, marker in (("preset", "o"), ("allocation", "*")):
            pts = sorted((b, math.log10(max(kl, KL_FLOOR))) for b, kl, k in self.points.values() if k == kind)
            if pts:
                sig = fig.signal([p[0] for p in pts], [p[1] for p in pts], marker=marker)
                fig.draw(sig)
        fig.legend(active=False)  # the border title names the markers; a legend box would hide points
        fig.label("bits/element", "x")
        return Text.from_ansi(_BG.sub("", fig.build().string()))
