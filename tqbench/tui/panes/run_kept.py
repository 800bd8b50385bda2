"""The Run tab's kept-token map: the engine's ``KeptTokens`` of the candidate's run (a policy that evicts tokens)
drawn in the graph's place on demand (``KeptMapWiring``, a part of ``RunPane``)."""

from __future__ import annotations

from tqbench.tui.widgets.graph import ThroughputGraph
from tqbench.tui.widgets.kept_map import KeptMap


class KeptMapWiring:
    """The map (``#kept-map``) and the graph (``#graph``) ``RunPane.compose`` yields share one place."""

    kept: object | None  # the engine's KeptTokens of the candidate's last run (set in RunPane.__init__)

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
