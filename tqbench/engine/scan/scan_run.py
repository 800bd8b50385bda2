"""Capture real Q/K/V from a model and measure, per layer and per KV head, what each codec does to attention.

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

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tqbench.engine.codecs import CODEC_SPECS
from tqbench.engine.events import Progress, ScanLayerDone
from tqbench.engine.generate import Cancelled
from tqbench.engine.policy.layers import select_layers
from tqbench.engine.policy.spec import Policy

CAPTURE_ATTN = "tqbench_capture"
CAPTURE_ATTN_EAGER = "tqbench_capture_eager"
OUTLIER_FACTOR = 4.0
DEFAULT_CODECS = ("int8", "int4", "turbo4", "turbo3.5", "turbo3", "turbo2.5", "turbo2")
CODEC_PRESETS = {
    "safe": ("int8", "turbo4", "turbo3.5", "int4"),
    "aggressive": ("turbo3", "turbo2.5", "turbo2", "int2", "turbo1.5"),
    "all": DEFAULT_CODECS + ("int2", "turbo1.5", "turbo1", "turbo4-qjl", "turbo3-qjl"),
}
#: default pass limits; a codec passes a head when every thresholded metric is on the right side
DEFAULT_THRESHOLDS = {"softmax_kl": 0.02, "attn_out_rel_err": 0.15}
#: metric -> "max" (a ceiling) or "min" (a floor)
THRESHOLD_METRICS = {
    "softmax_kl": "max", "attn_out_rel_err": "max", "score_rel_err": "max", "k_rel_mse": "max",
    "v_rel_mse": "max", "score_cosine": "min",
}
_lock = threading.Lock()
_active: dict = {}


# ---- capture -------------------------------------------------------------------------------------------
@dataclass
class LayerQKV:
    layer: int
    q: torch.Tensor  # [q_heads, tokens, head_dim], after RoPE, float32
    k: torch.Tensor  # [kv_heads, tokens, head_dim], after RoPE
    v: torch.Tensor  # [kv_heads, tokens, head_dim]
    scaling: float


@dataclass
class Capture:
    model: str
    token_ids: list[int]
    prompt_tokens: int
    generated_tokens: int
    truncated: bool
    num_layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    layers: dict[int, LayerQKV] = field(default_factory=dict)

    def metadata(self) -> dict:
        return {
            "model": self.model, "tokens": len(self.token_ids), "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens, "truncated": self.truncated,
            "num_layers": self.num_layers, "q_heads": self.q_heads, "kv_heads": self.kv_heads,
            "head_dim": self.head_dim, "layers": sorted(self.layers),
        }


def _capture(module, query, key, value) -> None:
    rec = _active.get("capture")
    layer = getattr(module, "layer_idx", None)
    if rec is not None and layer in rec["layers"]:
        rec["out"][layer] = (query[0].detach().float().cpu(), key[0].detach().float().cpu(),
                             value[0].detach().float().cpu())


def _capture_sdpa(module, query, key, value, attention_mask, **kwargs):
    """Record, then attend exactly as transformers' SDPA does (models loaded with sdpa, flash or fused)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    _capture(module, query, key, value)
    _record_scaling(module, query, kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _capture_eager(module, query, key, value, attention_mask, **kwargs):
    """Record, then attend with the model's own eager function (soft-capping and all)."""
    _capture(module, query, key, value)
    _record_scaling(module, query, kwargs)
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise RuntimeError(f"{type(module).__name__} has no eager_attention_forward to capture through")
    return eager(module, query, key, value, attention_mask, **kwargs)


def _record_scaling(module, query, kwargs) -> None:
    rec = _active.get("capture")
    layer = getattr(module, "layer_idx", None)
    if rec is not None and layer in rec["layers"]:
        s = kwargs.get("scaling")
        rec["scaling"][layer] = float(s if s is not None else query.shape[-1] ** -0.5)


def _install_capture() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    if not _active.get("registered"):
        AttentionInterface.register(CAPTURE_ATTN, _capture_sdpa)
        AttentionMaskInterface.register(CAPTURE_ATTN, sdpa_mask)
        AttentionInterface.register(CAPTURE_ATTN_EAGER, _capture_eager)
        AttentionMaskInterface.register(CAPTURE_ATTN_EAGER, eager_mask)
        _active["registered"] = True


def resolve_layers(layers, num_layers: int) -> list[int]:
    """``None`` = all layers; a selector string (``0,3,-1`` or ``first2+last2``) or a list of indices."""
    if layers is None:
        return list(range(num_layers))
    if isinstance(layers, str):
        parts = [p.strip() for p in layers.replace(",", "+").split("+") if p.strip()]
        if not parts:
            raise ValueError("empty --layers: give indices like 0,3,-1 or a selector like first2+last2")
        layers = "+".join(parts)
        return sorted(select_layers(layers, num_layers))
    out = set()
    for i in layers:
        out |= select_layers(str(int(i)), num_layers)
    return sorted(out)


def capture_qkv(engine, prompt, layers=None, max_prompt_tokens: int = 512, generated_tokens: int = 0,
                chat: bool = True) -> Capture:
    """Q/K/V of the chosen layers for ``prompt`` (text, messages or ids ``[1, T]``), truncated to the first
    ``max_prompt_tokens`` tokens, plus ``generated_tokens`` greedily generated ones (exact cache)."""
    if max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens={max_prompt_tokens} is invalid: use at least 1")
    if generated_tokens < 0:
        raise ValueError(f"generated_tokens={generated_tokens} is invalid: use 0 or more")
    cfg = engine.config.get_text_config(decoder=True) if hasattr(engine.config, "get_text_config") else engine.config
    n_layers = cfg.num_hidden_layers
    chosen = resolve_layers(layers, n_layers)
    ids = prompt if isinstance(prompt, torch.Tensor) else engine.encode_prompt(prompt, chat)
    truncated = ids.shape[1] > max_prompt_tokens
    ids = ids[:, :max_prompt_tokens]
    prompt_n = int(ids.shape[1])
    if generated_tokens:
        gen = engine.generate(ids, None, max_new_tokens=generated_tokens, stop_at_eos=False).token_ids
        ids = torch.cat([ids, torch.tensor([gen], dtype=ids.dtype)], dim=1)
    model = engine.model
    _install_capture()
    raw: dict[int, tuple] = {}
    scaling: dict[int, float] = {}
    with _lock:
        previous = model.config._attn_implementation
        model.set_attn_implementation(CAPTURE_ATTN_EAGER if previous == "eager" else CAPTURE_ATTN)
        _active["capture"] = {"layers": set(chosen), "out": raw, "scaling": scaling}
        try:
            with torch.inference_mode():
                model(input_ids=ids.to(next(model.parameters()).device), use_cache=False)
        finally:
            _active["capture"] = None
            model.set_attn_implementation(previous)
    out = {i: LayerQKV(i, *raw[i], scaling[i]) for i in raw}
    missing = [i for i in chosen if i not in out]
    if missing:
        raise RuntimeError(f"layers {missing} were not captured: the model's attention did not go through "
                           "the attention interface")
    first = out[chosen[0]]
    return Capture(engine.name, ids[0].tolist(), prompt_n, int(ids.shape[1]) - prompt_n, truncated, n_layers,
                   first.q.shape[0], first.k.shape[0], first.k.shape[-1], out)


# ---- metrics -------------------------------------------------------------------------------------------
def roundtrip(spec: str, role: str, x: torch.Tensor, policy: Policy | None = None) -> torch.Tensor:
    """``x`` [H, T, D] through a codec as a policy builds it; a partial token block stays exact (as in the cache)."""
    codec = (policy or Policy()).build_codec(spec, role)
    xb = x[None]
    if codec.lossless:
        return codec.decode(codec.encode(xb, {}), {}, x.dtype)[0]
    state = codec.calibrate(xb)
    n = (x.shape[1] // codec.tokens_per_unit) * codec.tokens_per_unit
    if n == 0:
        return x.clone()
    deq = codec.decode(codec.encode(xb[:, :, :n], state), state, x.dtype)[0]
    return torch.cat([deq, x[:, n:]], dim=1)


def _causal_scores(q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    """q [G, T, D], k [T, D] -> masked scores [G, T, T] (-inf above the diagonal)."""
    s = torch.einsum("gtd,sd->gts", q.double(), k.double()) * scaling
    t = k.shape[0]
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    return s.masked_fill(~mask, float("-inf"))


def head_metrics(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kq: torch.Tensor, vq: torch.Tensor,
                 scaling: float) -> dict:
    """Errors of quantized ``kq``/``vq`` ([T, D]) against exact ``k``/``v`` for the group's queries ``q`` [G, T, D]."""
    k64, v64, kq64, vq64 = k.double(), v.double(), kq.double(), vq.double()
    s, sq = _causal_scores(q, k, scaling), _causal_scores(q, kq, scaling)
    valid = torch.isfinite(s)
    a, b = s[valid], sq[valid]
    lp, lq = torch.log_softmax(s, -1), torch.log_softmax(sq, -1)
    p = lp.exp()
    kl = torch.where(valid, p * (lp - lq), torch.zeros_like(p)).sum(-1)
    o = p @ v64
    oq = lq.exp() @ vq64
    return {
        "k_rel_mse": float(((k64 - kq64) ** 2).sum() / (k64**2).sum().clamp_min(1e-30)),
        "v_rel_mse": float(((v64 - vq64) ** 2).sum() / (v64**2).sum().clamp_min(1e-30)),
        "score_cosine": float(torch.nn.functional.cosine_similarity(a, b, dim=0)),
        "score_rel_err": float((a - b).norm() / a.norm().clamp_min(1e-30)),
        "softmax_kl": float(kl.clamp_min(0).mean()),
        "attn_out_rel_err": float((o - oq).norm() / o.norm().clamp_min(1e-30)),
    }


def layer_stats(k: torch.Tensor, v: torch.Tensor) -> dict:
    """Per KV head: norms, per-channel means and outlier channels of K and V ([H, T, D])."""
    out: dict[str, list] = {"k_norm": [], "v_norm": [], "kv_norm_ratio": [], "k_channel_mean": [],
                            "v_channel_mean": [], "k_outlier_channels": [], "v_outlier_channels": []}
    for h in range(k.shape[0]):
        kn, vn = float(k[h].norm(dim=-1).mean()), float(v[h].norm(dim=-1).mean())
        out["k_norm"].append(kn)
        out["v_norm"].append(vn)
        out["kv_norm_ratio"].append(kn / vn if vn else float("inf"))
        for name, x in (("k", k[h]), ("v", v[h])):
            out[f"{name}_channel_mean"].append([round(float(m), 5) for m in x.mean(0)])
            mag = x.abs().mean(0)
            med = float(mag.median())
            out[f"{name}_outlier_channels"].append(
                [int(i) for i in torch.nonzero(mag > OUTLIER_FACTOR * med).flatten()] if med > 0 else []
            )
    return out


def parse_thresholds(text: str | dict | None) -> dict[str, float]:
    """``softmax_kl=0.02,attn_out_rel_err=0.15`` (short names ``kl``, ``out``, ``cos`` work too)."""
    if text is None:
        return dict(DEFAULT_THRESHOLDS)
    if isinstance(text, dict):
        items = list(text.items())
    else:
        items = []
        for part in (p.strip() for p in text.split(",") if p.strip()):
            if "=" not in part:
                raise ValueError(f"threshold {part!r} is not metric=value: e.g. kl=0.02,out=0.15")
            key, val = part.split("=", 1)
            try:
                items.append((key.strip(), float(val)))
            except ValueError:
                raise ValueError(f"threshold {part!r}: {val!r} is not a number") from None
    alias = {"kl": "softmax_kl", "out": "attn_out_rel_err", "cos": "score_cosine", "score": "score_rel_err",
             "kmse": "k_rel_mse", "vmse": "v_rel_mse"}
    out = {}
    for key, val in items:
        key = alias.get(key, key)
        if key not in THRESHOLD_METRICS:
            raise ValueError(f"unknown threshold metric {key!r}: valid metrics are {', '.join(THRESHOLD_METRICS)} "
                             f"(or kl, out, cos, score, kmse, vmse)")
        out[key] = float(val)
    if not out:
        raise ValueError("no thresholds given: e.g. --thresholds kl=0.02,out=0.15")
    return out


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


def codec_bits(spec: str, head_dim: int) -> float:
    """Packed bits per element of K and V through ``spec`` (per-unit metadata included), averaged."""
    pol = Policy()
    return (pol.build_codec(spec, "k").bits_per_element(head_dim) + pol.build_codec(spec, "v").bits_per_element(head_dim)) / 2


def _passes(metrics_by_head: list[dict], thresholds: dict[str, float]) -> bool:
    for m in metrics_by_head:
        for key, limit in thresholds.items():
            if THRESHOLD_METRICS[key] == "max" and not m[key] <= limit:
                return False
            if THRESHOLD_METRICS[key] == "min" and not m[key] >= limit:
                return False
    return True


# ---- the scan ------------------------------------------------------------------------------------------
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
    on_event: Callable[[object], None] | None = None,
    cancel: Callable[[], bool] | None = None,
) -> ScanResult:
    """Capture (unless ``capture`` is given) and measure every chosen layer; ``ScanLayerDone`` per layer."""
    import time

    t0 = time.perf_counter()
    codec_list = resolve_codecs(codecs)
    limits = parse_thresholds(thresholds)
    if on_event is not None:
        on_event(Progress("scan", 0, None, "capturing Q/K/V"))
    cap = capture or capture_qkv(engine, prompt, layers, max_prompt_tokens, generated_tokens, chat)
    chosen = sorted(cap.layers)
    bits = {c: round(codec_bits(c, cap.head_dim), 4) for c in codec_list}
    res = ScanResult(cap.metadata(), chosen, cap.kv_heads, codec_list, bits, limits)
    res.metrics = {m: {c: [] for c in codec_list} for m in THRESHOLD_METRICS}
    res.norms = {}
    group = cap.q_heads // cap.kv_heads
    for idx, layer in enumerate(chosen):
        if cancel is not None and cancel():
            raise Cancelled("scan cancelled")
        d = cap.layers[layer]
        stats = layer_stats(d.k, d.v)
        for key, val in stats.items():
            res.norms.setdefault(key, []).append(val)
        passing = []
        row = {"layer": layer, "stats": stats, "codecs": {}}
        for c in codec_list:
            kq, vq = roundtrip(c, "k", d.k), roundtrip(c, "v", d.v)
            per_head = [head_metrics(d.q[h * group:(h + 1) * group], d.k[h], d.v[h], kq[h], vq[h], d.scaling)
                        for h in range(cap.kv_heads)]
            for m in THRESHOLD_METRICS:
                res.metrics[m][c].append([round(x[m], 7) for x in per_head])
            row["codecs"][c] = per_head
            if _passes(per_head, limits):
                passing.append(c)
        cheapest = min(passing, key=lambda c: bits[c]) if passing else None
        verdict = {"layer": layer, "passing": passing, "cheapest": cheapest,
                   "verdict": "ok" if passing else "sensitive",
                   "worst_kl": {c: max(res.metrics["softmax_kl"][c][-1]) for c in codec_list}}
        res.verdicts.append(verdict)
        if on_event is not None:
            on_event(ScanLayerDone(layer, idx, len(chosen), row))
    res.seconds = time.perf_counter() - t0
    return res
