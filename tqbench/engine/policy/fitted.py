"""``FittedOn``: the model a saved policy was fitted on, and the one rule for "fitted on another model"."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class FittedOn:
    """The model a saved policy was fitted on (an artifact's ``[model]`` table): a ``Policy`` read from such a
    file carries it, so "fitted on another model" can be checked whatever form the policy reaches the engine in
    (a path, a shipped name, or an already-parsed ``Policy``)."""

    name: str | None = None
    fingerprint: str | None = None
    num_layers: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None

    @classmethod
    def from_dict(cls, data: dict | None) -> FittedOn | None:
        if not data:
            return None
        return cls(**{k: data.get(k) for k in cls.__dataclass_fields__})

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def warning(self, fingerprint: str | None, geometry=None) -> str | None:
        """Why a policy fitted on this model may not suit a model with ``fingerprint`` (else, when only a config
        is known, with KV ``geometry``); None when it matches or nothing comparable is recorded. The one rule."""
        fitted = f"{self.name or '?'} (fingerprint {self.fingerprint or '?'})"
        if fingerprint is not None and self.fingerprint and self.fingerprint != fingerprint:
            return (f"this policy was fitted on {fitted}, not on this model (fingerprint {fingerprint}): its "
                    "allocation may not suit it; allocate a policy for this model")
        if geometry is not None:
            want = (self.num_layers, self.kv_heads, self.head_dim)
            have = (geometry.num_layers, geometry.kv_heads, geometry.head_dim)
            if None not in want and want != have:
                return (f"this policy was fitted on {fitted} with {want[0]} layers x {want[1]} KV heads x "
                        f"head_dim {want[2]}, but this model has {have[0]} x {have[1]} x {have[2]}")
        return None
