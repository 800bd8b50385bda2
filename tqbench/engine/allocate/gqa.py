"""Grouped-query attention without copying K/V per query head, for the chunk forwards (``chunk.ChunkRunner``).

transformers' SDPA path repeats every K/V head to its query heads (``repeat_kv``: a copy of the whole history per
layer) unless it may pass ``enable_gqa=True``, which on CPU it does only without a mask; a chunk forward always has
one (1024 cached tokens + a causal chunk). ``TRANSFORMERS_SDPA_FORCE_GQA=1`` (read per call by
``transformers.integrations.sdpa_attention.use_gqa_in_sdpa``) lets it: PyTorch's CPU flash kernel then reads each
K/V head for its query group. Measured on the default model (4 x 32 chunk tokens over 1024 cached, 1 thread, CPU
seconds): a 20-layer chunk forward 0.556 -> 0.351, the log-probabilities bit-identical (``torch.equal``). Only
applied on CPU (a CUDA SDPA with a mask and GQA falls back to the math kernel); models whose attention is not SDPA
ignore it.
"""

from __future__ import annotations

import contextlib
import os

_VAR = "TRANSFORMERS_SDPA_FORCE_GQA"


@contextlib.contextmanager
def grouped_sdpa(device):
    """Within the block, SDPA attention reads K/V heads per query group (CPU only; restored after)."""
    if getattr(device, "type", str(device)) != "cpu" or os.environ.get(_VAR) is not None:
        yield
        return
    os.environ[_VAR] = "1"
    try:
        yield
    finally:
        os.environ.pop(_VAR, None)
