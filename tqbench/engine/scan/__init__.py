"""scan: capture real Q/K/V and measure, per layer and KV head, what each codec does to attention.

- ``capture``: ``capture_qkv`` (the recording attention), ``Capture``, ``LayerQKV``, ``resolve_layers``
- ``metrics``: ``head_metrics``, ``layer_stats``, ``roundtrip``, thresholds (``parse_thresholds``, ``passes``)
- ``run``: ``scan``, ``ScanResult`` (verdicts, cheapest codec, suggested policy), ``resolve_codecs``

``scan`` and ``capture_qkv`` take ``on_event=`` and ``cancel=`` and raise ``Cancelled`` (see
``tqbench.engine.generate``).
"""

from tqbench.engine.events import Cancelled
from tqbench.engine.scan.capture import Capture, LayerQKV, capture_qkv, resolve_layers
from tqbench.engine.scan.metrics import (
    DEFAULT_THRESHOLDS,
    OUTLIER_FACTOR,
    THRESHOLD_METRICS,
    head_metrics,
    layer_stats,
    parse_thresholds,
    passes,
    roundtrip,
)
from tqbench.engine.scan.run import CODEC_PRESETS, DEFAULT_CODECS, ScanResult, resolve_codecs, scan

__all__ = [
    "CODEC_PRESETS",
    "DEFAULT_CODECS",
    "DEFAULT_THRESHOLDS",
    "OUTLIER_FACTOR",
    "THRESHOLD_METRICS",
    "Cancelled",
    "Capture",
    "LayerQKV",
    "ScanResult",
    "capture_qkv",
    "head_metrics",
    "layer_stats",
    "parse_thresholds",
    "passes",
    "resolve_codecs",
    "resolve_layers",
    "roundtrip",
    "scan",
]
