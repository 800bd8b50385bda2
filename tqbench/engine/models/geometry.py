"""A model's KV geometry for every ``--model`` a command takes, without loading weights: ``cache.model_geometry``
(shipped configs by name, ``gemma3-270m`` included; a config.json or a model folder) plus ``.gguf`` files, read
from their converted folder's ``config.json`` when tqbench has converted them, else from the GGUF's own metadata
(transformers' GGUF config reader: no tensor is read)."""

from __future__ import annotations

import json
from pathlib import Path

from tqbench.engine.cache.geometry import ModelGeometry, geometry_from_config_dict, model_geometry
from tqbench.engine.models.gguf import converted_dir
from tqbench.engine.models.resolve import resolve_model


def _is_gguf(text: str) -> bool:
    path = Path(text).expanduser()
    return text.lower().endswith(".gguf") or (path.is_dir() and not (path / "config.json").is_file()
                                              and any(path.glob("*.gguf")))


def find_geometry(spec: str) -> ModelGeometry:
    """``cache.model_geometry`` for names, configs and folders; a ``.gguf`` file (or a folder holding one) here."""
    text = str(spec).strip()
    if not _is_gguf(text):
        return model_geometry(text)
    source = resolve_model(text)  # a missing file: ModelNotFoundError, one line
    config = converted_dir(source) / "config.json"
    if config.is_file():
        return geometry_from_config_dict(source.display_name, json.loads(config.read_text(encoding="utf-8")),
                                         f"{source.gguf_path} (converted config {config})")
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(source.path_or_id, gguf_file=source.gguf_file)
    except Exception as exc:
        raise ValueError(f"could not read a model config from {source.gguf_path}: {type(exc).__name__}: {exc}") from exc
    data = {"model_type": cfg.model_type, **cfg.to_diff_dict()}
    return geometry_from_config_dict(source.display_name, data, f"{source.gguf_path} (GGUF metadata)")
