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

from tqbench.engine.codecs import (
    CODEC_SPECS,
    canonical_spec,
    codec_bits_per_element,
    is_calibrated_spec,
    is_valid_spec,
    nominal_bits,
)
from tqbench.engine.events import CancelFlag, OnEvent, Progress, ScanLayerDone, emit, raise_if_cancelled
from tqbench.engine.policy.spec import Policy
from tqbench.engine.request import RequestError
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
#: calibrated key codecs a default scan adds beside the random rotation when the shipped fit is this model's
CALIBRATED_DEFAULTS = ("pcaq4", "pcaq3", "pcaq2.5", "pcaq2")


def value_partner(spec: str) -> str:
    """The value codec a key-only (calibrated) codec is scanned with: turbo at the same width (or the next
    lower width turbo has), so that ``pcaq{b}`` and ``turbo{b}`` differ only in their keys."""
    bits = nominal_bits(spec)
    for cand in (f"turbo{bits:g}", f"turbo{int(bits)}"):
        if is_valid_spec(cand):
            return canonical_spec(cand)
    return "turbo1"


def default_codecs(engine, calib: str = "") -> list[str]:
    """``DEFAULT_CODECS``, plus ``CALIBRATED_DEFAULTS`` when the transforms (``calib``, "" = the shipped fit)
    were fitted on this model."""
    from tqbench.engine.codecs.transforms_file import DEFAULT_TRANSFORMS, load_transforms

    out = list(DEFAULT_CODECS)
    fingerprint = getattr(getattr(engine, "loaded", None), "fingerprint", None)
    if fingerprint and (calib or DEFAULT_TRANSFORMS.is_file()) and load_transforms(calib).fingerprint == fingerprint:
        out += list(CALIBRATED_DEFAULTS)
    return out


def resolve_codecs(codecs=None, preset: str | None = None) -> list[str]:
    if codecs is not None and preset is not None:
        raise ValueError("give either codecs or a codec preset, not both")
    if preset is not None:
        if preset not in CODEC_PRESETS:
            raise ValueError(f"unknown codec preset {preset!r}: valid presets are {', '.join(CODEC_PRESETS)}")
        return list(CODEC_PRESETS[preset])
    if codecs is None:
        return list(DEFAULT_CODECS)
    if isinstance(codecs, str):
        codecs = [c.strip() for c in codecs.split(",") if c.strip()]
    if not codecs:
        raise RequestError("codecs", codecs, "give codec names like int8,turbo4,turbo3")
    for c in codecs:
        if c not in CODEC_SPECS and not is_calibrated_spec(c):
            raise ValueError(f"unknown codec {c!r}: valid codecs are {', '.join(CODEC_SPECS)} "
                             "(and the calibrated key codecs pcaq2, pcaq2.5, pcaq3 ...)")
    return list(dict.fromkeys(canonical_spec(c) if is_calibrated_spec(c) else c for c in codecs))


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
    #: key-only (calibrated) codec -> the value codec it was scanned with (``value_partner``)
    value_codecs: dict = field(default_factory=dict)

    @property
    def cheapest(self) -> dict:
        per_layer = {v["layer"]: v["cheapest"] for v in self.verdicts}
        everywhere = [c for c in sorted(self.codecs, key=lambda c: self.codec_bits[c])
                      if all(c in v["passing"] for v in self.verdicts)]
        return {"per_layer": per_layer, "all_layers": everywhere[0] if everywhere else None}

    @property
    def unmeasured(self) -> int:
        """How many of the model's layers the scan did not measure (0: every layer; 0 when the count is unknown)."""
        total = self.capture.get("num_layers")
        return max(0, total - len(self.verdicts)) if isinstance(total, int) else 0

    def suggest_policy(self, sink: int = 4, recent: int = 16) -> str:
        """A compact policy: the most common per-layer cheapest codec as default, the other layers overridden
        (``kv@L=codec``; ``fp16`` where no codec met the thresholds). A scan of some layers suggests codecs for those
        layers only: the default stays fp16 for the layers it never measured."""
        choice = {v["layer"]: (v["cheapest"] or "fp16") for v in self.verdicts}
        counts: dict[str, int] = {}
        for c in choice.values():
            counts[c] = counts.get(c, 0) + 1
        base = max(counts, key=lambda c: (counts[c], self.codec_bits.get(c, 16.0)))
        if self.unmeasured:
            base = "fp16"
        parts = [f"k={base}", f"v={self.value_codecs.get(base, base)}"]
        if any(c != "fp16" for c in choice.values()):
            parts += [f"sink={sink}", f"recent={recent}"]
        groups: dict[str, list[int]] = {}
        for layer, c in sorted(choice.items()):
            if c != base:
                groups.setdefault(c, []).append(layer)
        for c, layers in groups.items():
            sel = "+".join(str(i) for i in layers)
            if c in self.value_codecs:  # a key-only codec: its layers' values get the codec it was scanned with
                parts += [f"k@{sel}={c}", f"v@{sel}={self.value_codecs[c]}"]
            else:
                parts.append(f"kv@{sel}={c}")
        return ",".join(parts)

    def to_dict(self) -> dict:
        return {
            "capture": self.capture, "layers": self.layers, "kv_heads": self.kv_heads, "codecs": self.codecs,
            "codec_bits": self.codec_bits, "thresholds": self.thresholds, "metrics": self.metrics,
            "norms": self.norms, "verdicts": self.verdicts, "cheapest": self.cheapest,
            "suggested_policy": self.suggest_policy(), "seconds": round(self.seconds, 3),
            "value_codecs": self.value_codecs,
        }

    @classmethod
    def from_dict(cls, d: dict) -> ScanResult:
        """The inverse of ``to_dict()`` (a saved session's scan): ``cheapest`` and ``suggested_policy`` are
        recomputed from the verdicts; a missing field raises KeyError."""
        return cls(capture=dict(d["capture"]), layers=list(d["layers"]), kv_heads=d["kv_heads"],
                   codecs=list(d["codecs"]), codec_bits=dict(d["codec_bits"]), thresholds=dict(d["thresholds"]),
                   metrics=dict(d["metrics"]), norms=dict(d["norms"]), verdicts=list(d["verdicts"]),
                   seconds=d["seconds"], value_codecs=dict(d.get("value_codecs", {})))


def sliding_windows(geometry) -> dict[int, int]:
    """layer -> its sliding window (tokens a query reads, itself included) for a geometry's sliding-window
    layers (none without a geometry)."""
    if geometry is None or not geometry.sliding_window or not geometry.layer_types:
        return {}
    return {i: geometry.sliding_window for i, t in enumerate(geometry.layer_types) if t == "sliding_attention"}


def _measure_layer(d: LayerQKV, codecs: list[str], group: int, cancel: CancelFlag | None,
                   policy: Policy | None = None, window: int | None = None) -> dict[str, list[dict]]:
    """codec -> per-KV-head metrics of one captured layer (K and V both through the codec; a key-only codec's
    values through its ``value_partner``); ``window``: the layer's sliding window (its queries' mask)."""
    out = {}
    for c in codecs:
        raise_if_cancelled(cancel, "scan")
        kq = roundtrip(c, "k", d.k, policy, layer=d.layer)
        vq = roundtrip(value_partner(c) if is_calibrated_spec(c) else c, "v", d.v, policy, layer=d.layer)
        out[c] = [head_metrics(d.q[h * group:(h + 1) * group], d.k[h], d.v[h], kq[h], vq[h], d.scaling,
                               window) for h in range(d.k.shape[0])]
    return out


def _add_layer(res: ScanResult, layer: int, d: LayerQKV, group: int, cancel: CancelFlag | None,
               policy: Policy | None = None, window: int | None = None) -> dict:
    """Measure one layer into ``res`` (metrics, norms, verdict); the layer's JSON-safe row."""
    stats = layer_stats(d.k, d.v)
    for key, val in stats.items():
        res.norms.setdefault(key, []).append(val)
    per_codec = _measure_layer(d, res.codecs, group, cancel, policy, window)
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
    calib: str = "",
    on_event: OnEvent | None = None,
    cancel: CancelFlag | None = None,
) -> ScanResult:
    """Capture (unless ``capture`` is given) and measure every chosen layer; ``ScanLayerDone`` per layer.
    ``calib``: the transforms file of the calibrated (``pcaq``) codecs ("" = the shipped fit).
    Raises ``Cancelled`` when ``cancel()`` turns true."""
    t0 = time.perf_counter()
    codec_list = default_codecs(engine, calib) if codecs is None else resolve_codecs(codecs)
    if any(is_calibrated_spec(c) for c in codec_list):
        from tqbench.engine.codecs.transforms_file import load_transforms

        load_transforms(calib).check_model(getattr(getattr(engine, "loaded", None), "fingerprint", None), engine.name)
    policy = Policy(calib=calib)
    limits = parse_thresholds(thresholds)
    emit(on_event, Progress("scan", 0, None, "capturing Q/K/V"))
    cap = capture or capture_qkv(engine, prompt, layers, max_prompt_tokens, generated_tokens, chat,
                                 on_event=on_event, cancel=cancel)
    chosen = sorted(cap.layers)
    partners = {c: value_partner(c) for c in codec_list if is_calibrated_spec(c)}
    bits = {c: round((codec_bits_per_element(c, cap.head_dim) + codec_bits_per_element(partners[c], cap.head_dim)) / 2
                     if c in partners else codec_bits_per_element(c, cap.head_dim), 4) for c in codec_list}
    res = ScanResult(cap.metadata(), chosen, cap.kv_heads, codec_list, bits, limits, value_codecs=partners)
    res.metrics = {m: {c: [] for c in codec_list} for m in THRESHOLD_METRICS}
    res.norms = {}
    group = cap.q_heads // cap.kv_heads
    windows = sliding_windows(getattr(engine, "geometry", None))
    for idx, layer in enumerate(chosen):
        raise_if_cancelled(cancel, "scan")
        row = _add_layer(res, layer, cap.layers[layer], group, cancel, policy, windows.get(layer))
        emit(on_event, ScanLayerDone(layer, idx, len(chosen), row))
    res.seconds = time.perf_counter() - t0
    return res
