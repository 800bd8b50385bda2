"""Capture real Q/K/V from a model (``capture.py``) and measure, per layer and per KV head, what each codec does to attention.

``capture_qkv`` runs one exact forward pass (no cache) over a prompt (optionally extended by greedily
generated tokens) with a recording attention implementation, and keeps, for the chosen layers, the query,
key and value tensors exactly as the attention function receives them (keys and queries after RoPE).

``scan`` then computes per layer and per KV head:
- statistics: mean K and V row norms, K/V norm ratio, per-channel means and outlier channels
  (mean |x| of a channel above ``OUTLIER_FACTOR`` x the median channel);
- for each codec (K and V both through that codec, built as a policy builds it: keys centered, norm fix):
  relative MSE of K and V, cosine and relative error of the causal attention scores with the real
  queries, softmax KL(exact || quantized) averaged over query positions, and the relative error of the
  attention output.
A codec passes a layer when every head meets the thresholds; a layer's ``cheapest`` codec is the passing
codec with the fewest bits per element. The codec sees every captured row (no sink or recent window, as a
policy would keep): the scan measures the codec, the policy only does better. Scores use the scaling the
model passed to its attention function and a plain causal mask (a sliding window or logit soft-capping, as
in Gemma-2, is not applied).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tqbench.engine.codecs import CODEC_SPECS, codec_bits_per_element
from tqbench.engine.events import CancelFlag, OnEvent, Progress, ScanLayerDone, emit, raise_if_cancelled
from tqbench.engine.scan.capture import Capture, LayerQKV, capture_qkv
from tqbench.engine.scan.metrics import (
    THRESHOLD_METRICS,
    head_metrics,
    layer_stats,
    parse_thresholds,
    passes,
    roundtrip,
)

DEFAULT_CODECS = ("int8", "int4", "turbo4", "turbo3.5", "turbo3", "turbo2.5", "turbo2")
CODEC_PRESETS = {
    "safe": ("int8", "turbo4", "turbo3.5", "int4"),
    "aggressive": ("turbo3", "turbo2.5", "turbo2", "int2", "turbo1.5"),
    "all": DEFAULT_CODECS + ("int2", "turbo1.5", "turbo1", "turbo4-qjl", "turbo3-qjl"),
}


def resolve_codecs(codecs=None, preset: str | None = None) -> list[str]:
    if codecs is not None and preset is not None:
        raise ValueError("give either --codecs or --preset, not both")
    if preset is not None:
        if preset not in CODEC_PRESETS:
            raise ValueError(f"unknown codec preset {preset!r}: valid presets are {', '.join(CODEC_PRESETS)}")
        return list(CODEC_PRESETS[preset])
    if codecs is None:
        return list(DEFAULT_CODECS)
    if isinstance(codecs, str):
        codecs = [c.strip() for c in codecs.split(",") if c.strip()]
    if not codecs:
        raise ValueError("empty --codecs: give codec names like int8,turbo4,turbo3")
    for c in codecs:
        if c not in CODEC_SPECS:
            raise ValueError(f"unknown codec {c!r}: valid codecs are {', '.join(CODEC_SPECS)}")
    return list(dict.fromkeys(codecs))


@dataclass
class ScanResult:
    capture: dict  # Capture.metadata()
    layers: list[int]
    kv_heads: int
    codecs: list[str]
    codec_bits: dict[str, float]
    thresholds: dict[str, float]
    metrics: dict = field(default_factory=dict)  # metric -> codec -> [[per head] per layer]
    norms: dict = field(default_factory=dict)  # stat -> [[per head] per layer]
    verdicts: list[dict] = field(default_factory=list)  # per layer
    seconds: float = 0.0

    @property
    def cheapest(self) -> dict:
        per_layer = {v["layer"]: v["cheapest"] for v in self.verdicts}
        everywhere = [c for c in sorted(self.codecs, key=lambda c: self.codec_bits[c])
                      if all(c in v["passing"] for v in self.verdicts)]
        return {"per_layer": per_layer, "all_layers": everywhere[0] if everywhere else None}

    def suggest_policy(self, sink: int = 4, recent: int = 16) -> str:
        """A compact policy: the most common per-layer cheapest codec as default, the other layers overridden
        (``kv@L=codec``; ``fp16`` where no codec met the thresholds)."""
        choice = {v["layer"]: (v["cheapest"] or "fp16") for v in self.verdicts}
        counts: dict[str, int] = {}
        for c in choice.values():
            counts[c] = counts.get(c, 0) + 1
        base = max(counts, key=lambda c: (counts[c], self.codec_bits.get(c, 16.0)))
        parts = [f"k={base}", f"v={base}"]
        if base != "fp16":
            parts += [f"sink={sink}", f"recent={recent}"]
        groups: dict[str, list[int]] = {}
        for layer, c in sorted(choice.items()):
            if c != base:
                groups.setdefault(c, []).append(layer)
        for c, layers in groups.items():
            parts.append(f"kv@{'+'.join(str(i) for i in layers)}={c}")
        return ",".join(parts)

    def to_dict(self) -> dict:
        return {
            "capture": self.capture, "layers": self.layers, "kv_heads": self.kv_heads, "codecs": self.codecs,
            "codec_bits": self.codec_bits, "thresholds": self.thresholds, "metrics": self.metrics,
            "norms": self.norms, "verdicts": self.verdicts, "cheapest": self.cheapest,
            "suggested_policy": self.suggest_policy(), "seconds": round(self.seconds, 3),
        }

    @classmethod
    def from_dict(cls, d: dict) -> ScanResult:
        """The inverse of ``to_dict()`` (a saved session's scan): ``cheapest`` and ``suggested_policy`` are
        recomputed from the verdicts; a missing field raises KeyError."""
        return cls(capture=dict(d["capture"]), layers=list(d["layers"]), kv_heads=d["kv_heads"],
                   codecs=list(d["codecs"]), codec_bits=dict(d["codec_bits"]), thresholds=dict(d["thresholds"]),
                   metrics=dict(d["metrics"]), norms=dict(d["norms"]), verdicts=list(d["verdicts"]),
                   seconds=d["seconds"])


def _measure_layer(d: LayerQKV, codecs: list[str], group: int, cancel: CancelFlag | None) -> dict[str, list[dict]]:
    """codec -> per-KV-head metrics of one captured layer (K and V both through the codec)."""
    out = {}
    for c in codecs:
        raise_if_cancelled(cancel, "scan")
        kq, vq = roundtrip(c, "k", d.k), roundtrip(c, "v", d.v)
        out[c] = [head_metrics(d.q[h * group:(h + 1) * group], d.k[h], d.v[h], kq[h], vq[h], d.scaling)
                  for h in range(d.k.shape[0])]
    return out


def _add_layer(res: ScanResult, layer: int, d: LayerQKV, group: int, cancel: CancelFlag | None) -> dict:
    """Measure one layer into ``res`` (metrics, norms, verdict); the layer's JSON-safe row."""
    stats = layer_stats(d.k, d.v)
    for key, val in stats.items():
        res.norms.setdefault(key, []).append(val)
    per_codec = _measure_layer(d, res.codecs, group, cancel)
    for c, per_head in per_codec.items():
        for m in THRESHOLD_METRICS:
            res.metrics[m][c].append([round(x[m], 7) for x in per_head])
    passing = [c for c, per_head in per_codec.items() if passes(per_head, res.thresholds)]
    cheapest = min(passing, key=lambda c: res.codec_bits[c]) if passing else None
    res.verdicts.append({"layer": layer, "passing": passing, "cheapest": cheapest,
                         "verdict": "ok" if passing else "sensitive",
                         "worst_kl": {c: max(res.metrics["softmax_kl"][c][-1]) for c in res.codecs}})
    return {"layer": layer, "stats": stats, "codecs": per_codec}


def scan(
    engine,
    prompt,
    *,
    layers=None,
    codecs=None,
    thresholds=None,
    max_prompt_tokens: int = 512,
    generated_tokens: int = 0,
    chat: bool = True,
    capture: Capture | None = None,
    on_event: OnEvent | None = None,
    cancel: CancelFlag | None = None,
) -> ScanResult:
    """Capture (unless ``capture`` is given) and measure every chosen layer; ``ScanLayerDone`` per layer.
    Raises ``Cancelled`` when ``cancel()`` turns true."""
    t0 = time.perf_counter()
    codec_list = resolve_codecs(codecs)
    limits = parse_thresholds(thresholds)
    emit(on_event, Progress("scan", 0, None, "capturing Q/K/V"))
    cap = capture or capture_qkv(engine, prompt, layers, max_prompt_tokens, generated_tokens, chat,
                                 on_event=on_event, cancel=cancel)
    chosen = sorted(cap.layers)
    bits = {c: round(codec_bits_per_element(c, cap.head_dim), 4) for c in codec_list}
    res = ScanResult(cap.metadata(), chosen, cap.kv_heads, codec_list, bits, limits)
    res.metrics = {m: {c: [] for c in codec_list} for m in THRESHOLD_METRICS}
    res.norms = {}
    group = cap.q_heads // cap.kv_heads
    for idx, layer in enumerate(chosen):
        raise_if_cancelled(cancel, "scan")
        row = _add_layer(res, layer, cap.layers[layer], group, cancel)
        emit(on_event, ScanLayerDone(layer, idx, len(chosen), row))
    res.seconds = time.perf_counter() - t0
    return res
