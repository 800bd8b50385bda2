"""A policy checked once, at the door, against one model (``Engine.check_policy``).

Parsing a policy (a preset, a compact string, a file), planning it on the model's layers and finding whether it
was fitted on another model (``FittedOn.warning``) happen once; jobs and caches take the result as it is
(``Engine.make_cache``, ``TQCache``, every job built on ``Engine.stream``), so a validation reads the file and
checks its provenance once, not once per cache it makes."""

from __future__ import annotations

from dataclasses import dataclass

from tqbench.engine.policy.spec import Policy


@dataclass(frozen=True)
class CheckedPolicy:
    """``policy`` planned on the model with ``fingerprint``; ``warning``: why it may not suit that model (it was
    fitted on another one), or None."""

    policy: Policy
    warning: str | None = None
    fingerprint: str | None = None

    @property
    def label(self) -> str:
        return self.policy.label
