"""The compressed KV cache: ``TQCache`` (``tqcache.py``) of ``TQLayer``s (``layer.py``) over per-layer stores
(``store.py``, rows in ``buffer.py``), what a layer hands attention (``handles.py``; per-query precision of a
speculative verification call: ``precision.py``), its byte report (``report.py``, built in ``layer_report.py``), byte estimates from a geometry alone (``estimate.py``, ``geometry.py``),
whether a policy saves bytes against a baseline at a length and from which length it does (``savings.py``),
the seed-compatible wrapper (``compat.py``) and the ``fused`` mode's attention (``fused/``).

Names load lazily: a byte estimate (``estimate_kv``, ``kv_estimate``: torch and the codecs) does not import
transformers, which the cache itself (``TQCache``, ``CompressedDynamicCache``) needs.
"""

from __future__ import annotations

from tqbench.engine.lazy import lazy_names

#: public name -> its module
_LAZY: dict[str, str] = {
    "CACHE_MODES": "tqbench.engine.cache.tqcache",
    "CacheReport": "tqbench.engine.cache.report",
    "CompressedDynamicCache": "tqbench.engine.cache.compat",
    "FusedKV": "tqbench.engine.cache.tqcache",
    "KVEstimate": "tqbench.engine.cache.estimate",
    "KVEstimateReport": "tqbench.engine.cache.estimate",
    "KVEstimateRow": "tqbench.engine.cache.estimate",
    "KVGeometry": "tqbench.engine.cache.geometry",
    "LayerBytes": "tqbench.engine.cache.report",
    "ModelGeometry": "tqbench.engine.cache.geometry",
    "TQCache": "tqbench.engine.cache.tqcache",
    "TQLayer": "tqbench.engine.cache.tqcache",
    "Savings": "tqbench.engine.cache.savings",
    "UnsupportedModelError": "tqbench.engine.cache.geometry",
    "break_even_tokens": "tqbench.engine.cache.savings",
    "check_mode": "tqbench.engine.cache.tqcache",
    "default_geometry": "tqbench.engine.cache.geometry",
    "estimate_kv": "tqbench.engine.cache.estimate",
    "explicit_geometry": "tqbench.engine.cache.geometry",
    "kv_estimate": "tqbench.engine.cache.estimate",
    "longest_context": "tqbench.engine.cache.estimate",
    "geometry_from_config_dict": "tqbench.engine.cache.geometry",
    "model_geometry": "tqbench.engine.cache.geometry",
    "parse_bytes": "tqbench.engine.cache.estimate",
    "savings": "tqbench.engine.cache.savings",
    "shipped_models": "tqbench.engine.cache.geometry",
    "store_bytes": "tqbench.engine.cache.estimate",
}

__all__ = list(_LAZY)

__getattr__, __dir__ = lazy_names(__name__, _LAZY)
