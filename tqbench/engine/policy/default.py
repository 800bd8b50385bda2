"""The default policy of a model, one rule (``default_policy``): ``turbo4`` where the model has no sliding layers
(every layer global, or every layer sliding), ``HYBRID_DEFAULT_POLICY`` in a hybrid model (sliding-window + global
layers: Gemma-2/3, gpt-oss): turbo4 with Hadamard rotations, the global layers' keys in 4-bit per-channel affine
blocks (``int4``, KIVI's layout, a scale and zero per channel per 64 rows) and the windows' last 48 rows in fp16
(``srecent``). Its layer-kind overrides
(``sliding``, ``global``: ``layers.py``) and ``srecent`` name no layer in a model without sliding layers.

Chosen by measurement (issue 39; ``benchmarks/hybrid_default.py``, the table in docs/gemma3-270m.md): on Gemma-3
270M, held-out technical text and code, 1024 prefill + 128 teacher-forced steps, turbo4 on every layer gave KL
0.048 / 0.036 (0.077 / 0.035 with Hadamard rotations); the global keys carry the error on code and per-token codecs
at 4-5 bits do not fix it (q4_0 0.062, q5_0 0.026, pcaq4 fitted on Gemma 0.158), per-channel int4 keys do (0.012);
the windows' recent rows carry it on the manual (the last 48 rows fp16: 0.063 -> 0.007 with int4 global keys).
This policy, the one that saves the most at 8K of those measured under KL 0.01 on both texts: KL 0.0065 / 0.0091,
71.6% of the model's fp16 cache saved at 8K (68.3% at 1K, 72.7% at 32K); with 32-row key blocks 0.0069 / 0.0070
at 70.5%. Over 256 steps code is over 0.01 for both (0.0125, 0.0129; technical 0.0060, 0.0064). The previous default (windows and global keys at q8_0) had KL 0.0013 / 0.0015 at 56.2% saved at 8K.
"""

from __future__ import annotations

from tqbench.engine.policy.files import parse_policy
from tqbench.engine.policy.layers import SLIDING
from tqbench.engine.policy.spec import Policy

DEFAULT_POLICY = "turbo4"
#: the default of a hybrid model: turbo4 (Hadamard rotations), the global layers' keys int4 per channel (blocks of 64
#: rows), the windows' last 48 rows fp16
HYBRID_DEFAULT_POLICY = "turbo4,rotation=hadamard,k@global=int4,kblock=64,srecent=48"


def is_hybrid(layer_types) -> bool:
    """A model that mixes sliding-window and full-attention layers."""
    types = set(layer_types or ())
    return SLIDING in types and len(types) > 1


def default_policy(layer_types=None) -> Policy:
    """The default policy of a model with these ``layer_types`` (its config's; None: a model without sliding layers)."""
    return parse_policy(HYBRID_DEFAULT_POLICY if is_hybrid(layer_types) else DEFAULT_POLICY)
