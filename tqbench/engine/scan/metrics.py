"""What a codec does to one layer's attention, per KV head, and the pass rule of a scan.

Per KV head: statistics of the real K and V (row norms, per-channel means, outlier channels: mean |x| of a
channel above ``OUTLIER_FACTOR`` x the median channel) and, for K and V through a codec, relative MSE,
cosine and relative error of the causal attention scores with the real queries, softmax KL(exact ||
quantized) averaged over query positions (``metrics.kl_rows``), and the relative error of the attention
output. A codec passes a layer when every head meets the thresholds.
"""

from __future__ import annotations

import torch

from tqbench.engine.metrics import kl_rows
from tqbench.engine.policy.spec import Policy

OUTLIER_FACTOR = 4.0
#: default pass limits; a codec passes a head when every thresholded metric is on the right side
DEFAULT_THRESHOLDS = {"softmax_kl": 0.02, "attn_out_rel_err": 0.15}
#: metric -> "max" (a ceiling) or "min" (a floor)
THRESHOLD_METRICS = {
    "softmax_kl": "max", "attn_out_rel_err": "max", "score_rel_err": "max", "k_rel_mse": "max",
    "v_rel_mse": "max", "score_cosine": "min",
}


def roundtrip(spec: str, role: str, x: torch.Tensor, policy: Policy | None = None,
              layer: int | None = None) -> torch.Tensor:
    """``x`` [H, T, D] through a codec as a policy builds it for ``layer`` (calibrated codecs need it); a partial
    token block stays exact (as in the cache)."""
    codec = (policy or Policy()).build_codec(spec, role, layer=layer)
    xb = x[None]
    if codec.lossless:
        return codec.decode(codec.encode(xb, {}), {}, x.dtype)[0]
    state = codec.calibrate(xb)
    n = (x.shape[1] // codec.tokens_per_unit) * codec.tokens_per_unit
    if n == 0:
        return x.clone()
    deq = codec.decode(codec.encode(xb[:, :, :n], state), state, x.dtype)[0]
    return torch.cat([deq, x[:, n:]], dim=1)


def _causal_scores(q: torch.Tensor, k: torch.Tensor, scaling: float, window: int | None = None) -> torch.Tensor:
    """q [G, T, D], k [T, D] -> masked scores [G, T, T] (-inf above the diagonal; with a sliding ``window``,
    also where the key is ``window`` or more positions back: query t reads keys t - window + 1 .. t, as
    transformers' sliding-window mask)."""
    s = torch.einsum("gtd,sd->gts", q.double(), k.double()) * scaling
    t = k.shape[0]
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    if window is not None:
        mask &= ~torch.ones(t, t, dtype=torch.bool).tril(-window)
    return s.masked_fill(~mask, float("-inf"))


def head_metrics(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kq: torch.Tensor, vq: torch.Tensor,
                 scaling: float, window: int | None = None) -> dict:
    """Errors of quantized ``kq``/``vq`` ([T, D]) against exact ``k``/``v`` for the group's queries ``q`` [G, T, D];
    ``window``: a sliding-window layer's (each query reads its last ``window`` keys, itself included)."""
    k64, v64, kq64, vq64 = k.double(), v.double(), kq.double(), vq.double()
    s, sq = _causal_scores(q, k, scaling, window), _causal_scores(q, kq, scaling, window)
    valid = torch.isfinite(s)
    a, b = s[valid], sq[valid]
    lp, lq = torch.log_softmax(s, -1), torch.log_softmax(sq, -1)
    p = lp.exp()
    kl = kl_rows(lp, lq, valid)
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
        raise ValueError("no thresholds given: e.g. kl=0.02,out=0.15")
    return out


def passes(metrics_by_head: list[dict], thresholds: dict[str, float]) -> bool:
    """True when every head meets every threshold (``THRESHOLD_METRICS`` says which side)."""
    for m in metrics_by_head:
        for key, limit in thresholds.items():
            if THRESHOLD_METRICS[key] == "max" and not m[key] <= limit:
                return False
            if THRESHOLD_METRICS[key] == "min" and not m[key] >= limit:
                return False
    return True
