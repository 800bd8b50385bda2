"""The compressed KV cache: ``TQCache`` (``tqcache.py``) of ``TQLayer``s (``layer.py``) over per-layer stores
(``store.py``, rows in ``buffer.py``), what a layer hands attention (``handles.py``; per-query precision of a
speculative verification call: ``precision.py``), its byte report (``report.py``, built in ``layer_report.py``), byte estimates from a geometry alone (``estimate.py``, ``geometry.py``),
whether a policy saves bytes against a baseline at a length and from which length it does (``savings.py``),
the seed-compatible wrapper (``compat.py``) and the ``fused`` mode's attention (``fused/``).
"""

from tqbench.engine.cache.compat import CompressedDynamicCache
from tqbench.engine.cache.estimate import (
    KVEstimate,
    KVEstimateReport,
    KVEstimateRow,
    estimate_kv,
    kv_estimate,
    longest_context,
    parse_bytes,
    store_bytes,
)
from tqbench.engine.cache.geometry import (
    KVGeometry,
    ModelGeometry,
    UnsupportedModelError,
    default_geometry,
    explicit_geometry,
    model_geometry,
    shipped_models,
)
from tqbench.engine.cache.report import CacheReport, LayerBytes
from tqbench.engine.cache.savings import Savings, break_even_tokens, savings
from tqbench.engine.cache.tqcache import CACHE_MODES, FusedKV, TQCache, TQLayer, check_mode

__all__ = [
    "CACHE_MODES",
    "CacheReport",
    "CompressedDynamicCache",
    "FusedKV",
    "KVEstimate",
    "KVEstimateReport",
    "KVEstimateRow",
    "KVGeometry",
    "LayerBytes",
    "ModelGeometry",
    "TQCache",
    "TQLayer",
    "Savings",
    "UnsupportedModelError",
    "break_even_tokens",
    "check_mode",
    "default_geometry",
    "estimate_kv",
    "explicit_geometry",
    "kv_estimate",
    "longest_context",
    "model_geometry",
    "parse_bytes",
    "savings",
    "shipped_models",
    "store_bytes",
]
