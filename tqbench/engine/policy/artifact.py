"""A saved policy as a first-class artifact: ``POLICY.toml`` (+ ``POLICY.safetensors``).

The TOML holds ``[policy]`` (the ``Policy`` fields: ``parse_policy("POLICY.toml")``, ``TQCache(policy=PATH)``
and every front end load it), ``[model]`` (the name, fingerprint and KV geometry it was fitted on),
``[allocation]`` (budget, stated context, exact bytes, predicted KL, calibration text and settings) and
``[verified]`` (the held-out frontier point). The safetensors sidecar holds tensors: the measured sensitivity
table ``sensitivity`` ``[layers, 2, codecs]`` (so another budget can be solved without measuring again). The
codecs' own calibration state (key-centering means, outlier channels) is fitted per prompt on the prefill by the
cache at run time, so there is none to save.

"This policy was fitted on another model" is one rule, ``FittedOn.warning`` (``policy/spec.py``): a ``Policy`` read
from an artifact carries its ``[model]`` table as ``fitted_on``, so the check works on a path, a shipped name and an
already-parsed ``Policy`` alike.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tqbench.engine.atomic import atomic_write, check_output_path
from tqbench.engine.policy.files import parse_policy
from tqbench.engine.policy.spec import Policy
from tqbench.engine.tomlfile import read_toml

if TYPE_CHECKING:  # torch loads with the sidecar, not with the policy (a policy is checked before torch)
    import torch

FORMAT = "tqbench-policy/1"


@dataclass
class PolicyArtifact:
    policy: Policy
    model: dict = field(default_factory=dict)  # name, fingerprint, num_layers, kv_heads, head_dim
    allocation: dict = field(default_factory=dict)
    verified: dict = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    path: str | None = None

    def to_dict(self) -> dict:
        return {"format": FORMAT, "policy": self.policy.to_dict(), "model": self.model,
                "allocation": self.allocation, "verified": self.verified, "path": self.path,
                "tensors": {k: list(t.shape) for k, t in self.tensors.items()}}


def sidecar_path(path: str | os.PathLike) -> Path:
    return Path(path).with_suffix(".safetensors")


def _toml_safe(value):
    """TOML has no null: drop None values (recursively)."""
    if isinstance(value, dict):
        return {k: _toml_safe(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_toml_safe(v) for v in value if v is not None]
    return value


def save_policy_artifact(artifact: PolicyArtifact, path: str | os.PathLike) -> Path:
    """Write ``path`` (.toml) and, when the artifact has tensors, its ``.safetensors`` sidecar."""
    import tomli_w
    from safetensors.torch import save

    path = check_output_path(path, ".toml", "policy artifact")
    body = {"format": FORMAT, "policy": artifact.policy.to_dict(), "model": artifact.model,
            "allocation": artifact.allocation, "verified": artifact.verified}
    if artifact.tensors:
        side = sidecar_path(path)
        atomic_write(side, save({k: t.contiguous() for k, t in artifact.tensors.items()}))
        body["files"] = {"tensors": side.name}
    text = f"# {FORMAT}: written by tqbench allocate\n" + tomli_w.dumps(_toml_safe(body))
    atomic_write(path, text.encode("utf-8"))
    artifact.path = str(path)
    return path


def is_policy_artifact(path: str | os.PathLike) -> bool:
    p = Path(path)
    if p.suffix != ".toml" or not p.is_file():
        return False
    try:
        return read_toml(p).get("format") == FORMAT
    except ValueError:  # not TOML (or no tomllib): loading it as a policy file says what is wrong, naming it
        return False


def load_policy_artifact(path: str | os.PathLike) -> PolicyArtifact:
    """Read an artifact written by ``save_policy_artifact`` (any policy TOML works: missing tables are empty)."""
    from safetensors.torch import load_file

    from tqbench.engine.policy.files import load_policy_file

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"policy file {str(p)!r} does not exist")
    data = read_toml(p, "policy file")
    tensors = {}
    side = (data.get("files") or {}).get("tensors")
    if side:
        side_path = p.parent / side
        if not side_path.is_file():
            raise ValueError(f"{p} names tensors file {side!r}, which is missing next to it")
        tensors = load_file(str(side_path))
    return PolicyArtifact(load_policy_file(str(p)), data.get("model", {}), data.get("allocation", {}),
                          data.get("verified", {}), tensors, str(p))


def artifact_warning_for(policy, fingerprint: str | None = None, geometry=None) -> str | None:
    """``FittedOn.warning`` for ``policy`` (a ``Policy``, or text that names one: a preset, a shipped policy or an
    artifact path), from the provenance the parsed ``Policy`` carries; None when it has none or the text does
    not parse (the caller parses it, and says why, itself)."""
    if isinstance(policy, os.PathLike):
        policy = str(policy)
    if isinstance(policy, str):
        try:
            policy = parse_policy(policy)
        except (ValueError, OSError):
            return None
    if not isinstance(policy, Policy) or policy.fitted_on is None:
        return None
    return policy.fitted_on.warning(fingerprint, geometry)
