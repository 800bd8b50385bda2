"""``LoadedModel``: a model and its tokenizer in eval mode, with where they came from and how they loaded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tqbench.engine.models.resolve import ResolvedModel


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    name: str
    source: ResolvedModel
    device: torch.device
    dtype: torch.dtype
    num_params: int
    config_summary: dict[str, Any]
    load_seconds: float
    fingerprint: str
    threads: int
