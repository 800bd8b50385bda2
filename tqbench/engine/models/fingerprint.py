"""What a model is, without its weights: the attention geometry summary of its config, and a short
deterministic fingerprint of geometry plus weights (sessions use it to tell models apart)."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import torch

from tqbench.engine.cache.estimate import KVGeometry


def model_config_summary(config: Any) -> dict[str, Any]:
    """Attention geometry from a transformers config (no weights needed); the KV part is ``KVGeometry``'s."""
    kv = KVGeometry.from_config(config)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return {
        "model_type": getattr(config, "model_type", None),
        "num_layers": kv.num_layers,
        "num_heads": config.num_attention_heads,
        "num_kv_heads": kv.kv_heads,
        "head_dim": kv.head_dim,
        "hidden_size": config.hidden_size,
        "vocab_size": getattr(config, "vocab_size", None),
        "max_position_embeddings": getattr(config, "max_position_embeddings", None),
        "layer_types": list(kv.layer_types) if kv.layer_types else None,
        "sliding_window": kv.sliding_window,
    }


def _hash_shard_headers(digest: Any, folder: Path) -> bool:
    """Feed every safetensors shard's name, size and JSON header (a few KB each) into ``digest``."""
    shards = sorted(folder.glob("*.safetensors"))
    for shard in shards:
        with shard.open("rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            header = fh.read(header_len)
        digest.update(f"{shard.name}|{shard.stat().st_size}|".encode() + header)
    return bool(shards)


def _hash_params(digest: Any, model: torch.nn.Module, sample: int = 256) -> None:
    """Feed every parameter's name/shape and the first values of a few tensors (as fp32) into ``digest``."""
    params = list(model.named_parameters())
    for name, p in params:
        digest.update(f"{name}|{tuple(p.shape)}|".encode())
    for _, p in params[:2] + params[-2:]:
        digest.update(p.detach().flatten()[:sample].to("cpu", torch.float32).numpy().tobytes())


def model_fingerprint(model: torch.nn.Module, folder: str | os.PathLike | None = None) -> str:
    """Short, cheap, deterministic id of a model: attention geometry plus its weights.

    Weights are identified by the safetensors shard headers of ``folder`` when it has any (independent
    of the load dtype), otherwise by parameter names/shapes and a sample of values (dtype-dependent).
    """
    digest = hashlib.sha256(json.dumps(model_config_summary(model.config), sort_keys=True).encode())
    if folder is None or not _hash_shard_headers(digest, Path(folder)):
        _hash_params(digest, model)
    return digest.hexdigest()[:16]
