"""The old home of ``kv-estimate`` (``from tqbench.engine.cache import kv_estimate as ke``), kept so that
existing importers still work: the estimate lives in ``estimate.py``, model geometries in ``geometry.py``."""

from tqbench.engine.cache.estimate import KVEstimateReport, kv_estimate, longest_context, parse_bytes
from tqbench.engine.cache.geometry import (
    ALIASES,
    MODELS_DIR,
    ModelGeometry,
    explicit_geometry,
    model_geometry,
    shipped_models,
)

__all__ = [
    "ALIASES",
    "MODELS_DIR",
    "KVEstimateReport",
    "ModelGeometry",
    "explicit_geometry",
    "kv_estimate",
    "longest_context",
    "model_geometry",
    "parse_bytes",
    "shipped_models",
]
