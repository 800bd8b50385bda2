"""A model's KV geometry (layers, KV heads, head size, sliding layers), read from its config alone.

``KVGeometry.from_config`` is the one reader of a transformers config's attention fields (the cache, the
estimates and the front ends all go through it). ``model_geometry`` finds a geometry by name: a shipped config
(``tqbench/data/models/<name>.json``: the attention fields of the model's public ``config.json``), a local
``config.json`` or model folder (config only, no weights), or explicit ``layers / kv_heads / head_dim``. A
config is read through transformers' own config class, so derived fields match what the model does
(Gemma-2's alternating sliding/global ``layer_types``; a ``sliding_window`` without ``layer_types`` means
every layer slides, as transformers' ``DynamicCache`` treats it). ``default_geometry()`` is the default
model's (SmolLM2-135M), from its shipped config.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from tqbench.constants import MODELS_DATA_DIR
from tqbench.engine.request import RequestError

MODELS_DIR = MODELS_DATA_DIR
ALIASES = {"default": "SmolLM2-135M", "smollm2-135m-instruct": "SmolLM2-135M",
           "smollm2-1.7b-instruct": "SmolLM2-1.7B", "phi-3-mini-4k-instruct": "Phi-3-mini-4k",
           "gemma3-270m": "Gemma-3-270M"}  # --model gemma3-270m (models/named.py; a test holds every name here)


def text_config(config):
    """The decoder's config of ``config`` (multimodal configs nest it), else ``config`` itself."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


class UnsupportedModelError(ValueError):
    """The compressed cache cannot hold this model's attention state (raised before any generation)."""


def model_label(config) -> str:
    arch = getattr(config, "architectures", None)
    return arch[0] if arch else f"a {getattr(config, 'model_type', '?')} model"


def is_mla(config) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3 style): the cache holds the latent, not per-head K/V."""
    return bool(getattr(text_config(config), "kv_lora_rank", None))


def unsupported_attention(config) -> str | None:
    """Why the compressed cache cannot hold ``config``'s attention state, or None when it can."""
    cfg = text_config(config)
    other = sorted({t for t in (getattr(cfg, "layer_types", None) or ()) if t not in SUPPORTED_LAYER_TYPES})
    if other:
        return (f"its {', '.join(other)} layers (state-space / linear attention) keep a recurrent state the "
                f"compressed cache does not hold (supported layer types: {', '.join(SUPPORTED_LAYER_TYPES)})")
    return None


def check_supported(config) -> None:
    why = unsupported_attention(config)
    if why:
        raise UnsupportedModelError(
            f"{model_label(config)} cannot use the compressed cache in any mode: {why}; run it with the plain "
            "fp16 DynamicCache baseline (no KV policy)"
        )


def falcon_cache_heads(cfg) -> int:
    """The K/V rows per token a Falcon layer hands the cache. Falcon-7B style (``multi_query``): one; the new
    decoder layout (Falcon-40B/180B, ``new_decoder_architecture``): its ``num_kv_heads`` groups from transformers
    5.25 on (an ``AttentionInterface`` layer that repeats the groups after the cache), one row per query head
    before (``FalconAttention._split_heads`` broadcast the groups before the cache); otherwise one per head."""
    if cfg.new_decoder_architecture:
        return cfg.num_kv_heads if falcon_attention_interface() else cfg.num_attention_heads
    if not cfg.multi_query:
        return cfg.num_attention_heads
    return 1


def falcon_attention_interface() -> bool:
    """True when transformers' Falcon caches its KV groups as they are (5.25+: ``FalconAttention`` goes through
    ``AttentionInterface`` and repeats the groups after the cache)."""
    from transformers.models.falcon import modeling_falcon

    return hasattr(modeling_falcon, "eager_attention_forward")


#: full-precision rows (sinks, recent window, partial blocks, the fp16 baseline) are counted as fp16, the deployment
#: dtype
FP_BYTES = 2


def fp16_row_bytes(rows: int, width: int) -> int:
    """Bytes of ``rows`` rows of ``width`` elements held in fp16 (one role: K or V)."""
    return rows * width * FP_BYTES


def dense_fp16_bytes(rows: int, head_dim: int, v_head_dim: int | None = None) -> int:
    """What an fp16 cache holds for ``rows`` (batch x KV heads x tokens) K rows ``head_dim`` wide plus as many V
    rows ``v_head_dim`` wide (None: as wide as K). The one definition of the dense fp16 baseline."""
    return fp16_row_bytes(rows, head_dim) + fp16_row_bytes(rows, v_head_dim or head_dim)


def window_rows(sliding_window: int | None) -> int | None:
    """The rows a sliding-window layer keeps between calls: the last ``sliding_window - 1`` (as transformers'
    ``DynamicSlidingWindowLayer`` keeps them); None without a window. The one definition of that rule."""
    return sliding_window - 1 if sliding_window else None


@dataclass(frozen=True)
class KVGeometry:
    num_layers: int
    kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    v_head_dim: int | None = None  # V rows' width where it differs from K's (MLA: the RoPE key part)

    @property
    def v_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def row_dims(self) -> int:
        """K width + V width: the elements of one token of one KV head."""
        return self.head_dim + self.v_dim

    @property
    def window_rows(self) -> int | None:
        """The rows a sliding layer of this model keeps between calls (``window_rows``)."""
        return window_rows(self.sliding_window)

    def window_held(self, tokens: int) -> int:
        """Of ``tokens`` seen, the rows a sliding layer holds between calls (all of them without a window)."""
        return tokens if self.window_rows is None else min(tokens, self.window_rows)

    def dense_fp16_bytes(self, tokens: int, batch: int = 1) -> int:
        """What an fp16 cache holds for ``tokens`` tokens of one layer (``dense_fp16_bytes``)."""
        return dense_fp16_bytes(batch * self.kv_heads * tokens, self.head_dim, self.v_dim)

    @classmethod
    def from_config(cls, config) -> KVGeometry:
        cfg = text_config(config)
        lt = getattr(cfg, "layer_types", None)
        window = getattr(cfg, "sliding_window", None)
        if not lt and window:  # Mistral, Phi-3: one window on every layer, as transformers' DynamicCache does
            lt = ("sliding_attention",) * cfg.num_hidden_layers
        if is_mla(cfg):  # the cache holds one "head": K = the kv_lora_rank latent, V = the shared RoPE key
            return cls(cfg.num_hidden_layers, 1, cfg.kv_lora_rank, None, None, cfg.qk_rope_head_dim)
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        if getattr(cfg, "model_type", None) == "falcon":
            kv_heads = falcon_cache_heads(cfg)
        return cls(
            num_layers=cfg.num_hidden_layers,
            kv_heads=kv_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            layer_types=tuple(lt) if lt else None,
            sliding_window=window,
        )


def shipped_models() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


@dataclass(frozen=True)
class ModelGeometry:
    name: str
    geometry: KVGeometry
    max_context: int | None
    source: str

    def to_dict(self) -> dict:
        g = self.geometry
        return {"name": self.name, "source": self.source, "num_layers": g.num_layers, "kv_heads": g.kv_heads,
                "head_dim": g.head_dim, "v_head_dim": g.v_dim, "sliding_window": g.sliding_window,
                "sliding_layers": sum(t == "sliding_attention" for t in g.layer_types) if g.layer_types else 0,
                "max_context": self.max_context}


def geometry_from_config_dict(name: str, data: dict, source: str) -> ModelGeometry:
    from transformers import AutoConfig

    data = {k: v for k, v in data.items() if not k.startswith("_")}
    model_type = data.pop("model_type", None)
    if not model_type:
        raise ValueError(f"{source}: the config has no model_type: it is not a transformers config.json")
    try:
        cfg = AutoConfig.for_model(model_type, **data)
    except ValueError as exc:
        raise ValueError(f"{source}: model_type {model_type!r} is unknown to transformers ({exc})") from None
    check_supported(cfg)
    geo = KVGeometry.from_config(cfg)
    return ModelGeometry(name, geo, getattr(text_config(cfg), "max_position_embeddings", None), source)


def model_geometry(model: str) -> ModelGeometry:
    """A shipped model name (case-insensitive, ``default`` = SmolLM2-135M), a config.json or a model folder."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"{model!r} has no config.json: give a model folder with one, or a shipped name "
                             f"({', '.join(shipped_models())})")
    if path.suffix == ".json" and path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{model}: not valid JSON ({exc})") from None
        return geometry_from_config_dict(path.parent.name if path.name == "config.json" else path.stem, data, str(path))
    key = ALIASES.get(model.lower(), model)
    by_lower = {m.lower(): m for m in shipped_models()}
    if key.lower() not in by_lower:  # a hub id: meta-llama/Llama-3.1-8B-Instruct -> Llama-3.1-8B
        base = key.split("/")[-1].lower()
        for suffix in ("-instruct", "-it", "-chat"):
            base = base.removesuffix(suffix)
        key = ALIASES.get(base, base)
    if key.lower() not in by_lower:
        raise ValueError(f"unknown model {model!r} for kv-estimate: shipped configs are "
                         f"{', '.join(shipped_models())}; or give a config.json, a model folder, or "
                         "an explicit geometry (layers, kv_heads, head_dim)")
    name = by_lower[key.lower()]
    data = json.loads((MODELS_DIR / f"{name}.json").read_text(encoding="utf-8"))
    return geometry_from_config_dict(name, data, f"shipped config {name}.json")


@functools.lru_cache(maxsize=1)
def default_geometry() -> KVGeometry:
    """The default model's geometry (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64), from its shipped config.

    Read from the JSON's fields as they are (a plain llama config: no sliding window, no layer types, head_dim =
    hidden_size / heads), without transformers' ``AutoConfig``, so the preset table needs no transformers import;
    a test holds it equal to ``model_geometry("default")``."""
    data = json.loads((MODELS_DIR / f"{ALIASES['default']}.json").read_text(encoding="utf-8"))
    return KVGeometry.from_config(SimpleNamespace(**{k: v for k, v in data.items() if not k.startswith("_")}))


def explicit_geometry(layers: int, kv_heads: int, head_dim: int) -> ModelGeometry:
    for what, val in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim)):
        if val is None or val < 1:
            raise RequestError(what, val, "give a whole number >= 1")
    return ModelGeometry("explicit geometry",
                         KVGeometry(layers, kv_heads, head_dim), None, "explicit")
