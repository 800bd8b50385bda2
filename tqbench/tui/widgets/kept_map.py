"""Which tokens each KV head kept: a strip per evicting layer x KV head over the token positions (bright: kept,
dark: evicted), and the highlighted strip's tokens below with the evicted ones struck through.

The picture of an engine ``KeptTokens`` event (``cache.evict.kept.KeptPositions``): nothing here decides what
was kept.
"""

from __future__ import annotations

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

#: columns of a strip; a longer context puts several positions in one column (shaded by the share kept)
STRIP_COLUMNS = 64
#: share of a column's positions kept -> colour (none kept ... all kept)
SHADES = ("#3a3a3a", "#005f3f", "#008751", "#00af5f", "#5fd787")
KEPT_STYLE = "bold #d7ffd7 on #005f3f"
EVICTED_STYLE = "strike #808080"


def strip(mask: list[bool], columns: int = STRIP_COLUMNS) -> Text:
    """``mask`` (kept per position) drawn in at most ``columns`` cells: one cell per position when it fits,
    else each cell covers an equal run of positions and its colour says what share of them was kept."""
    n = len(mask)
    out = Text()
    if n == 0:
        return out
    cells = min(columns, n)
    for c in range(cells):
        lo, hi = c * n // cells, (c + 1) * n // cells
        share = sum(mask[lo:hi]) / (hi - lo)
        if share == 0:
            out.append("·", style=SHADES[0])
        else:
            out.append("█", style=SHADES[1 + min(3, int(share * 4 - 1e-9))])
    return out


def _gone(kept) -> str:
    """What happened to the rows not kept: dropped, or demoted to a cheaper codec (``demote=``, ``demote@``)."""
    tiers = sorted({la.demote for la in kept.layers if la.demote})
    if not tiers:
        return "dropped"
    return f"demoted to {'/'.join(tiers)}" + (" or dropped" if any(not la.demote for la in kept.layers) else "")


def legend(seen: int, columns: int = STRIP_COLUMNS) -> str:
    """How many positions a strip's column covers (``strip``: equal runs of ``seen // cells`` or one more)."""
    cells = min(columns, seen)
    if cells == 0:
        return "no positions"
    lo, hi = seen // cells, -(-seen // cells)
    if hi == 1:
        return f"{seen} positions, one per column"
    per = f"{lo}" if lo == hi else f"{lo}-{hi}"
    return f"{seen} positions over {cells} columns, {per} per column (brighter: more of them kept)"


def head_losses(la, seen: int) -> str:
    """The rows each KV head of layer ``la`` does not hold after ``seen`` tokens, and what became of them: one
    count when its heads agree, else one per head (``1/4/4``)."""
    gone = "demoted" if la.demote else "dropped"
    counts = [seen - len(h) for h in la.heads]
    if len(set(counts)) == 1:
        split = (f": {la.evicted_prefill} at the prompt, {la.evicted_decode} while decoding"
                 if la.evicted_prefill + la.evicted_decode == counts[0] else "")
        return f"the layer's KV heads {gone} {counts[0]} rows each{split}"
    return f"the layer's KV heads {gone} {'/'.join(map(str, counts))} rows (heads 0-{len(counts) - 1})"


class KeptMap(Vertical):
    """``show(event)`` with an engine ``KeptTokens``; the strip under the cursor picks the tokens shown."""

    DEFAULT_CSS = """
    KeptMap { height: 1fr; }
    KeptMap #kept-strips { height: 1fr; min-height: 4; border: round $panel; }
    KeptMap #kept-tokens-box { height: 1fr; min-height: 4; border: round $panel; padding: 0 1; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.event = None  # the engine's KeptTokens shown
        self.rows: list[tuple[int, int]] = []  # (layer, kv head) of each strip
        self.selected: tuple[int, int] | None = None

    def compose(self) -> ComposeResult:
        yield OptionList(id="kept-strips")
        with VerticalScroll(id="kept-tokens-box"):
            yield Static("", id="kept-tokens", markup=False)

    def show(self, event) -> None:
        self.event, kept = event, event.kept
        self.rows = [(la.layer, h) for la in kept.layers for h in range(len(la.heads))]
        ol = self.query_one("#kept-strips", OptionList)
        ol.clear_options()
        for layer, head in self.rows:
            n = len(kept.layer(layer).heads[head])
            label = Text(f"L{layer:<3}h{head:<2} {n:>5}/{kept.seen:<5} ", style="bold")
            ol.add_option(Option(label + strip(kept.mask(layer, head)), id=f"k:{layer}:{head}"))
        heads = len(kept.layers[0].heads) if kept.layers else 0
        ol.border_title = f"kept tokens · {kept.policy} · {len(kept.layers)} evicting layers x {heads} KV heads"
        ol.border_subtitle = f"{legend(kept.seen)} · █ kept  · {_gone(kept)}"
        if self.rows:
            ol.highlighted = 0
            self.select(*self.rows[0])

    def clear(self) -> None:
        self.event, self.rows, self.selected = None, [], None
        self.query_one("#kept-strips", OptionList).clear_options()
        self.query_one("#kept-tokens", Static).update("")

    @on(OptionList.OptionHighlighted, "#kept-strips")
    def _highlighted(self, event: OptionList.OptionHighlighted) -> None:
        _, layer, head = event.option.id.split(":")
        self.select(int(layer), int(head))

    def select(self, layer: int, head: int) -> None:
        """Show the tokens of ``layer``'s KV head ``head``: kept highlighted, evicted struck through."""
        kept = self.event.kept
        self.selected = (layer, head)
        self.query_one("#kept-tokens", Static).update(self.token_text(layer, head))
        la = kept.layer(layer)
        box = self.query_one("#kept-tokens-box", VerticalScroll)
        box.border_title = (f"layer {layer}, KV head {head}: kept {len(la.heads[head])} of {kept.seen} tokens "
                            f"({head_losses(la, kept.seen)})")
        gone = f"demoted to {la.demote}" if la.demote else "dropped"
        box.border_subtitle = f"kept: highlighted · {gone}: struck through"

    def token_text(self, layer: int, head: int) -> Text:
        kept, texts = self.event.kept, self.event.texts
        mask = kept.mask(layer, head)
        out = Text()
        for pos, (piece, on_) in enumerate(zip(texts, mask)):
            if pos == kept.prompt_tokens and pos < len(mask):
                out.append(" │generated│ ", style="bold #ffd700")
            shown = piece.replace("\n", "⏎\n") if piece else "·"
            out.append(shown, style=KEPT_STYLE if on_ else EVICTED_STYLE)
        return out
