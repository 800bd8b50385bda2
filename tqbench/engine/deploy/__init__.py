"""Deployment: a tqbench policy as the KV setting of llama.cpp, vLLM, SGLang or TensorRT-LLM.

``mapping.py`` (the closest setting an engine accepts, and what it cannot carry) and ``export.py`` (that
setting measured here next to the original). The engines' own KV formats are codecs
(``tqbench.engine.codecs.ggml`` / ``fp8``; their names in ``codecs.engine_formats``).
"""

from tqbench.engine.deploy.export import ExportReport, export_policy
from tqbench.engine.deploy.mapping import ENGINE_LABELS, EngineSetting, map_policy

__all__ = ["ENGINE_LABELS", "EngineSetting", "ExportReport", "export_policy", "map_policy"]
