"""KL vs bits per element: one point per measured policy (plotext 6). Markers by kind: uniform presets ``o``,
per-layer allocations ``*``, per-KV-head allocations ``+``, allocations that evict tokens ``e``; with calibrated
(pcaq) keys ``O``, ``#``, ``x``, ``E``. A point with a known decode speed (an allocation made with a minimum speed)
is drawn with its speed class's marker (``SPEED``): ``^`` at or above the minimum, ``v`` below it; the border title
says so when the plot has such points."""

from __future__ import annotations

import math
import re

from rich.text import Text
from textual.widgets import Static

_BG = re.compile(r"\x1b\[48;[25];[0-9;]+m")
KL_FLOOR = 1e-6  # log scale: a KL of 0 (a lossless policy) is drawn at this floor
#: point kind -> (marker, marker with calibrated pcaq keys: a kind ending in "+pcaq")
MARKERS = {"preset": ("o", "O"), "layer": ("*", "#"), "head": ("+", "x"), "evict": ("e", "E")}
#: older sessions and callers say "allocation" for a per-layer allocation
ALIASES = {"allocation": "layer"}
CALIBRATED = "+pcaq"
#: speed class (a kind's last "@" part: ``"head+pcaq@fast"``) -> (marker, what it means)
SPEED = {"fast": ("^", "at or above the minimum speed"), "slow": ("v", "below the minimum speed")}
TITLE = "log10 KL vs bits/el · o presets · * per-layer · + per-head · e evicting · O # x E: the same, pcaq keys"


def split_speed(kind: str) -> tuple[str, str | None]:
    """``(kind without its speed class, the class or None)``."""
    base, sep, speed = kind.rpartition("@")
    if not sep:
        return kind, None
    if speed not in SPEED:
        raise ValueError(f"unknown speed class {speed!r} in frontier point kind {kind!r}: use one of {', '.join(SPEED)}")
    return base, speed


def split_kind(kind: str) -> tuple[str, bool]:
    """``(base kind, calibrated)`` of a point kind such as ``"head+pcaq"`` (a speed class ``@fast`` ignored)."""
    kind = split_speed(kind)[0]
    calibrated = kind.endswith(CALIBRATED)
    base = kind[: -len(CALIBRATED)] if calibrated else kind
    base = ALIASES.get(base, base)
    if base not in MARKERS:
        raise ValueError(f"unknown frontier point kind {kind!r}: use one of {', '.join(MARKERS)} (+pcaq)")
    return base, calibrated


class FrontierPlot(Static):
    """``set_points(points)`` with ``points``: ``{label: (bits_per_element, kl, kind)}``, kind one of ``MARKERS``
    (optionally ending in ``+pcaq``). The y axis is log10 of the teacher-forced KL."""

    DEFAULT_CSS = """
    FrontierPlot { height: 1fr; min-height: 10; border: round $panel; padding: 0 1; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.points: dict[str, tuple[float, float, str]] = {}
        self.border_title = TITLE

    def set_points(self, points: dict[str, tuple[float, float, str]], subtitle: str = "") -> None:
        speeds = {split_speed(kind)[1] for _, _, kind in points.values() if split_kind(kind)}
        self.points = dict(points)
        self.border_title = TITLE + "".join(f" · {SPEED[c][0]}: {SPEED[c][1]}" for c in SPEED if c in speeds)
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
        groups: dict[tuple[str, bool, str], list[tuple[float, float]]] = {}
        for b, kl, kind in self.points.values():
            key = (*split_kind(kind), split_speed(kind)[1] or "")
            groups.setdefault(key, []).append((b, math.log10(max(kl, KL_FLOOR))))
        for (base, calibrated, speed), pts in sorted(groups.items()):
            pts.sort()
            marker = SPEED[speed][0] if speed else MARKERS[base][calibrated]
            fig.draw(fig.signal([p[0] for p in pts], [p[1] for p in pts], marker=marker))
        fig.legend(active=False)  # the border title names the markers; a legend box would hide points
        fig.label("bits/element", "x")
        return Text.from_ansi(_BG.sub("", fig.build().string()))
