"""Policies: which codec K and V get per layer, plus token- and layer-level protection.

``spec.py`` (the ``Policy`` dataclass and its checks), ``grammar.py`` (the compact text form, presets by name),
``files.py`` (dicts and JSON/TOML files; ``parse_policy``, the door for every form), ``default.py`` (the default
policy of a model: turbo4, or the measured hybrid default where sliding and global layers mix), ``checked.py``
(``CheckedPolicy``: a policy checked once against one model, ``Engine.check_policy``), ``presets.py`` (the
registry of named presets and shipped policy files), ``layers.py``
(layer selectors) and ``artifact.py`` (a saved policy: TOML + safetensors, the model it was fitted on; the
allocation that writes one lives in ``tqbench.engine.allocate``).
"""

from tqbench.engine.policy.artifact import (
    PolicyArtifact,
    artifact_warning_for,
    is_policy_artifact,
    load_policy_artifact,
    save_policy_artifact,
)
from tqbench.engine.policy.checked import CheckedPolicy
from tqbench.engine.policy.default import DEFAULT_POLICY, HYBRID_DEFAULT_POLICY, default_policy, is_hybrid
from tqbench.engine.policy.files import load_policy_file, parse_policy, policy_from_dict
from tqbench.engine.policy.grammar import engine_policy, get_preset, parse_compact, split_policies
from tqbench.engine.policy.layers import select_layers, validate_selector
from tqbench.engine.policy.presets import (
    ENGINE_PRESETS,
    PRESET_TEXT,
    PRESETS,
    SHIPPED_POLICY_DIR,
    shipped_policy_names,
    shipped_policy_path,
)
from tqbench.engine.policy.spec import (
    BYPASS_CHOICES,
    DENSE_SPECS,
    FULL_PRECISION,
    ROTATION_CHOICES,
    SLIDING_CHOICES,
    FittedOn,
    LayerPlan,
    Policy,
)

__all__ = [
    "BYPASS_CHOICES",
    "DEFAULT_POLICY",
    "DENSE_SPECS",
    "ENGINE_PRESETS",
    "FULL_PRECISION",
    "HYBRID_DEFAULT_POLICY",
    "PRESETS",
    "PRESET_TEXT",
    "ROTATION_CHOICES",
    "SLIDING_CHOICES",
    "SHIPPED_POLICY_DIR",
    "CheckedPolicy",
    "FittedOn",
    "LayerPlan",
    "PolicyArtifact",
    "artifact_warning_for",
    "default_policy",
    "is_hybrid",
    "is_policy_artifact",
    "load_policy_artifact",
    "save_policy_artifact",
    "shipped_policy_names",
    "shipped_policy_path",
    "Policy",
    "engine_policy",
    "get_preset",
    "load_policy_file",
    "parse_compact",
    "parse_policy",
    "policy_from_dict",
    "select_layers",
    "split_policies",
    "validate_selector",
]
