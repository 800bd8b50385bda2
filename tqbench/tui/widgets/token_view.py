"""Generated text of one run, token by token; tokens that differ from the other run are highlighted."""

from __future__ import annotations

from rich.text import Text
from textual.containers import VerticalScroll
from textual.widgets import Static

DIFF_STYLE = {"baseline": "bold black on #d7af5f", "candidate": "bold white on #af005f"}
FIRST_MARK = "▶"


class TokenView(VerticalScroll):
    """A scrolling panel of tokens; ``divergent_steps`` are the steps whose token differs from the other run."""

    DEFAULT_CSS = """
    TokenView { border: round $primary; height: 1fr; padding: 0 1; }
    TokenView:focus { border: round $accent; }
    TokenView > Static { width: 1fr; }
    """

    def __init__(self, run: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.run = run
        self.tokens: list[tuple[int, str, bool]] = []  # (token id, text, differs)
        self.first_divergence: int | None = None
        self._body = Static("", markup=False)
        self.border_title = run

    def compose(self):
        yield self._body

    @property
    def text(self) -> str:
        return "".join(t for _, t, _ in self.tokens)

    @property
    def token_ids(self) -> list[int]:
        return [i for i, _, _ in self.tokens]

    @property
    def divergent_steps(self) -> list[int]:
        return [i for i, (_, _, d) in enumerate(self.tokens) if d]

    def clear(self, title: str | None = None) -> None:
        self.tokens = []
        self.first_divergence = None
        if title is not None:
            self.border_title = title
        self.border_subtitle = ""
        self._body.update("")

    def add(self, token_id: int, text: str, differs: bool) -> None:
        self.tokens.append((token_id, text, differs))
        if differs and self.first_divergence is None:
            self.first_divergence = len(self.tokens) - 1
            self.border_subtitle = f"{FIRST_MARK} first divergence at token {self.first_divergence}"
        self._body.update(self.render_text())
        self.scroll_end(animate=False)

    def set_tokens(self, items: list[tuple[int, str, bool]]) -> None:
        self.clear()
        for tok in items:
            self.tokens.append(tok)
            if tok[2] and self.first_divergence is None:
                self.first_divergence = len(self.tokens) - 1
                self.border_subtitle = f"{FIRST_MARK} first divergence at token {self.first_divergence}"
        self._body.update(self.render_text())

    def render_text(self) -> Text:
        out = Text()
        style = DIFF_STYLE.get(self.run, DIFF_STYLE["candidate"])
        for i, (_, piece, differs) in enumerate(self.tokens):
            if i == self.first_divergence:
                out.append(FIRST_MARK, style="bold #ffd700")
            if differs:
                shown = piece.replace("\n", "⏎\n") if piece.strip() == "" and piece else piece
                out.append(shown or "·", style=style)
            else:
                out.append(piece)
        return out
