"""A policy checked once, at the door, against one model (``Engine.check_policy``).

Parsing a policy (a preset, a compact string, a file), planning it on the model's layers and finding whether it
was fitted on another model (``FittedOn.warning``) happen once; jobs and caches take the result as it is
(``Engine.make_cache``, ``TQCache``, every job built on ``Engine.stream``), so a validation reads the file and
checks its provenance once, not once per cache it makes."""

from __future__ import annotations

from dataclasses import dataclass

from tqbench.engine.policy.spec import LayerPlan, Policy


@dataclass(frozen=True)
class CheckedPolicy:
    """``policy`` planned on the model with ``fingerprint``; ``warning``: why it may not suit that model (it was
    fitted on another one), or None; ``plans``: its per-layer plan on that model's layers (``Policy.plan``), taken
    by the caches made from it (``TQCache``) instead of planning again, for the layers it was made for
    (``planned_for``: the layer count and layer types)."""

    policy: Policy
    warning: str | None = None
    fingerprint: str | None = None
    plans: tuple[LayerPlan, ...] = ()
    planned_for: tuple | None = None

    def plans_for(self, num_layers: int, layer_types: list[str] | None) -> list[LayerPlan]:
        """The per-layer plan for a model with these layers: the one made at the door when it was made for them,
        else planned now."""
        if self.plans and self.planned_for == (num_layers, tuple(layer_types) if layer_types else None):
            return list(self.plans)
        return self.policy.plan(num_layers, layer_types)

    @property
    def label(self) -> str:
        return self.policy.label
