"""``kv-estimate``: KV bytes of one or more policies for a model geometry, and the longest context that fits.

Geometry comes from a shipped config (``tqbench/data/models/<name>.json``: the attention fields of the model's
public ``config.json``), a local ``config.json`` or model folder (config only, no weights), or explicit
``layers / kv_heads / head_dim``. A config is read through transformers' own config class, so derived
fields match what the model does (Gemma-2's alternating sliding/global ``layer_types``; a ``sliding_window``
without ``layer_types`` means every layer slides, as transformers' ``DynamicCache`` treats it). Bytes come
from ``estimate.estimate_kv`` (exact: the same rules as the cache's report).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tqbench.constants import MODELS_DATA_DIR
from tqbench.engine.cache.estimate import KVGeometry, estimate_kv
from tqbench.engine.policy.spec import parse_policy

MODELS_DIR = MODELS_DATA_DIR
ALIASES = {"default": "SmolLM2-135M", "smollm2-135m-instruct": "SmolLM2-135M",
           "smollm2-1.7b-instruct": "SmolLM2-1.7B", "phi-3-mini-4k-instruct": "Phi-3-mini-4k"}


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
                "head_dim": g.head_dim, "sliding_window": g.sliding_window,
                "sliding_layers": sum(t == "sliding_attention" for t in g.layer_types) if g.layer_types else 0,
                "max_context": self.max_context}


def _from_config_dict(name: str, data: dict, source: str) -> ModelGeometry:
    from transformers import AutoConfig

    data = {k: v for k, v in data.items() if not k.startswith("_")}
    model_type = data.pop("model_type", None)
    if not model_type:
        raise ValueError(f"{source}: the config has no model_type: it is not a transformers config.json")
    try:
        cfg = AutoConfig.for_model(model_type, **data)
    except ValueError as exc:
        raise ValueError(f"{source}: model_type {model_type!r} is unknown to transformers ({exc})") from None
    geo = KVGeometry.from_config(cfg)
    if geo.layer_types is None and geo.sliding_window:
        geo = KVGeometry(geo.num_layers, geo.kv_heads, geo.head_dim, ("sliding_attention",) * geo.num_layers,
                         geo.sliding_window)
    text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    return ModelGeometry(name, geo, getattr(text, "max_position_embeddings", None), source)


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
        return _from_config_dict(path.parent.name if path.name == "config.json" else path.stem, data, str(path))
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
                         "--layers --kv-heads --head-dim")
    name = by_lower[key.lower()]
    data = json.loads((MODELS_DIR / f"{name}.json").read_text(encoding="utf-8"))
    return _from_config_dict(name, data, f"shipped config {name}.json")


def explicit_geometry(layers: int, kv_heads: int, head_dim: int) -> ModelGeometry:
    for what, val in (("--layers", layers), ("--kv-heads", kv_heads), ("--head-dim", head_dim)):
        if val is None or val < 1:
            raise ValueError(f"{what} {val} is invalid: give a whole number >= 1")
    return ModelGeometry("explicit geometry",
                         KVGeometry(layers, kv_heads, head_dim), None, "explicit")


def longest_context(policy, geometry: KVGeometry, budget_bytes: int, batch: int = 1,
                    limit: int | None = None) -> int:
    """The largest ``seq_len`` whose KV bytes fit ``budget_bytes`` (bytes grow with seq_len), capped at ``limit``."""
    if budget_bytes < 0:
        raise ValueError("the memory budget must be >= 0")
    cap = limit or (1 << 24)

    def fits(n: int) -> bool:
        return estimate_kv(policy, geometry, n, batch).total_bytes <= budget_bytes

    if not fits(1):
        return 0
    if fits(cap):
        return cap
    lo, hi = 1, cap  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class KVEstimateReport:
    model: ModelGeometry
    seq_len: int
    batch: int
    memory_budget_bytes: int | None
    rows: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"model": self.model.to_dict(), "seq_len": self.seq_len, "batch": self.batch,
                "memory_budget_bytes": self.memory_budget_bytes, "rows": self.rows}


def kv_estimate(model: ModelGeometry, policies: list[str], seq_len: int, batch: int = 1,
                memory_budget_bytes: int | None = None) -> KVEstimateReport:
    if seq_len < 1:
        raise ValueError(f"--seq-len {seq_len} is invalid: use at least 1 token")
    if batch < 1:
        raise ValueError(f"--batch {batch} is invalid: use at least 1")
    if not policies:
        raise ValueError("no policy given: use --kv-policy fp16,turbo4")
    rep = KVEstimateReport(model, seq_len, batch, memory_budget_bytes)
    for text in policies:
        pol = parse_policy(text)
        est = estimate_kv(pol, model.geometry, seq_len, batch)
        row = est.to_dict() | {"kv_policy_string": pol.to_string()}
        row.pop("layer_bytes")
        if model.max_context and seq_len > model.max_context:
            row["note"] = f"seq_len is beyond the model's context of {model.max_context} tokens"
        if memory_budget_bytes is not None:
            row["max_seq_len_in_budget"] = longest_context(pol, model.geometry, memory_budget_bytes, batch,
                                                           model.max_context)
            row["capped_by_model_context"] = bool(model.max_context and
                                                  row["max_seq_len_in_budget"] == model.max_context)
        rep.rows.append(row)
    return rep


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(text: str) -> int:
    """``24GiB``, ``80GB``, ``512MiB``, ``1e9``: a byte count (GB = 10^9, GiB = 2^30)."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text or "")
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"memory budget {text!r} is invalid: use a size like 24GiB, 80GB or 512MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
