"""The default policy of a model, one rule (``default_policy``): ``turbo4`` where the model has no sliding layers
(every layer global, or every layer sliding), ``HYBRID_DEFAULT_POLICY`` in a hybrid model (sliding-window + global
layers: Gemma-2/3, gpt-oss): turbo4 with the window rows and the global layers' keys at q8_0. Its layer-kind
overrides (``sliding``, ``global``: ``layers.py``) name no layer in a model without sliding layers, so on SmolLM2 it
stores the same bytes as turbo4.

Chosen by measurement (issue 39; ``benchmarks/hybrid_default.py``, the table in docs/gemma3-270m.md): on Gemma-3
270M, held-out technical text and code, 1024 prefill + 128 teacher-forced steps, turbo4 on every layer gave KL
0.048 / 0.036; dense or q8_0 windows left 0.010 / 0.025 (the 3 global layers), q8_0 global keys with turbo4
windows 0.036 / 0.010; q8_0 windows and q8_0 global keys 0.0013 / 0.0015 (global values at turbo4). It saves 47%
of the model's fp16 cache at 1K, 56% at 8K, 59% at 32K (turbo4 everywhere: 68 / 72 / 74%).
"""

from __future__ import annotations

from tqbench.engine.policy.files import parse_policy
from tqbench.engine.policy.layers import SLIDING
from tqbench.engine.policy.spec import Policy

DEFAULT_POLICY = "turbo4"
#: the default of a hybrid model: turbo4, with the window rows and the global layers' keys at q8_0
HYBRID_DEFAULT_POLICY = "turbo4,kv@sliding=q8_0,k@global=q8_0"


def is_hybrid(layer_types) -> bool:
    """A model that mixes sliding-window and full-attention layers."""
    types = set(layer_types or ())
    return SLIDING in types and len(types) > 1


def default_policy(layer_types=None) -> Policy:
    """The default policy of a model with these ``layer_types`` (its config's; None: a model without sliding layers)."""
    return parse_policy(HYBRID_DEFAULT_POLICY if is_hybrid(layer_types) else DEFAULT_POLICY)
