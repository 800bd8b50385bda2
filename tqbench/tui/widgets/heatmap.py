"""Layers x KV heads heatmap over a DataTable: the cursor selects a cell; colours scale with the value."""

from __future__ import annotations

import math

from rich.text import Text
from textual.widgets import DataTable

# cool -> hot (good -> bad when higher is worse)
PALETTE = ("#005f5f", "#008787", "#5f8700", "#af8700", "#d75f00", "#d70000")


def _scale(values: list[float]) -> tuple[float, float, bool]:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return 0.0, 1.0, False
    lo, hi = min(finite), max(finite)
    use_log = lo > 0 and hi / lo > 20
    if use_log:
        lo, hi = math.log10(lo), math.log10(hi)
    return lo, hi, use_log


class Heatmap(DataTable):
    """``set_data(values, layers)`` with values ``[[per head] per layer]``."""

    DEFAULT_CSS = """
    Heatmap { height: 1fr; border: round $panel; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(cursor_type="cell", zebra_stripes=False, **kwargs)
        self.values: list[list[float]] = []
        self.layer_ids: list[int] = []

    def set_data(self, values: list[list[float]], layers: list[int], higher_is_worse: bool = True,
                 columns: list[str] | None = None) -> None:
        """``columns``: the value columns' titles (default ``head 0``, ``head 1``, ...)."""
        self.values, self.layer_ids = values, layers
        self.clear(columns=True)
        heads = max((len(r) for r in values), default=0)
        self.add_column("layer", width=5)
        for h in range(heads):
            self.add_column(columns[h] if columns else f"head {h}", width=11)  # fixed: auto widths race with redraws
        flat = [v for row in values for v in row]
        lo, hi, use_log = _scale(flat)
        for layer, row in zip(layers, values):
            cells = []
            for v in row:
                if v is None or not math.isfinite(v):
                    cells.append(Text(f"{v}", justify="right"))
                    continue
                x = math.log10(v) if use_log and v > 0 else v
                t = 0.5 if hi == lo else (x - lo) / (hi - lo)
                if not higher_is_worse:
                    t = 1 - t
                colour = PALETTE[min(len(PALETTE) - 1, int(t * len(PALETTE)))]
                cells.append(Text(f" {v:9.4g} ", style=f"bold white on {colour}", justify="right"))
            self.add_row(Text(f"L{layer}", style="bold"), *cells, key=str(layer))
        self.border_subtitle = ("log colour scale" if use_log else "linear colour scale") + \
            (" · red = worse" if higher_is_worse else " · red = lower")
