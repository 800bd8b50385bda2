"""KV byte estimates from a model config alone (no weights), exact to the byte.

The rules mirror ``store.KVStore``: sinks and the recent window stay full precision (counted as fp16),
the rest is packed in whole codec units, per-layer codec state is counted per layer and shared objects
(rotations, codebooks) once. ``TQCache.report()`` after a run over ``seq_len`` tokens gives the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tqbench.engine.cache.store import FP_BYTES
from tqbench.engine.policy.spec import Policy, parse_policy


@dataclass(frozen=True)
class KVGeometry:
    num_layers: int
    kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None

    @classmethod
    def from_config(cls, config) -> KVGeometry:
        cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        lt = getattr(cfg, "layer_types", None)
        return cls(
            num_layers=cfg.num_hidden_layers,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            layer_types=tuple(lt) if lt else None,
            sliding_window=getattr(cfg, "sliding_window", None),
        )


@dataclass
class KVEstimate:
    policy: str
    seq_len: int
    batch: int
    total_bytes: int
    dense_fp16_bytes: int
    shared_bytes: int
    layer_bytes: list[int] = field(default_factory=list)

    @property
    def bits_per_element(self) -> float:
        elements = self.dense_fp16_bytes // FP_BYTES
        return self.total_bytes * 8 / elements if elements else 0.0

    @property
    def saved_pct(self) -> float:
        return 100.0 * (1 - self.total_bytes / self.dense_fp16_bytes) if self.dense_fp16_bytes else 0.0

    def to_dict(self) -> dict:
        return {
            "kv_policy": self.policy, "seq_len": self.seq_len, "batch": self.batch,
            "total_bytes": self.total_bytes, "dense_fp16_bytes": self.dense_fp16_bytes,
            "shared_bytes": self.shared_bytes, "bits_per_element": round(self.bits_per_element, 4),
            "saved_pct": round(self.saved_pct, 2), "layer_bytes": list(self.layer_bytes),
        }


def _state_bytes(codec, batch: int, heads: int, head_dim: int) -> int:
    probe = torch.randn(batch, heads, max(codec.tokens_per_unit, 2), head_dim)
    return codec.state_bytes(codec.calibrate(probe))


def store_bytes(codec, sink: int, recent: int, tokens: int, batch: int, heads: int, head_dim: int) -> tuple[int, int]:
    """(bytes, packed_tokens) of one K or V store holding ``tokens`` rows."""
    rows = batch * heads
    if codec.lossless:
        return tokens * rows * codec.unit_bytes(head_dim), 0
    head = min(sink, tokens)
    rest = tokens - head
    tpu = codec.tokens_per_unit
    packed = max(0, (rest - recent) // tpu) * tpu
    fp = (tokens - packed) * rows * head_dim * FP_BYTES
    if not packed:
        return fp, 0
    units = packed // tpu
    return fp + units * rows * codec.unit_bytes(head_dim) + _state_bytes(codec, batch, heads, head_dim), packed


def estimate_kv(policy: Policy | str, geometry: KVGeometry, seq_len: int, batch: int = 1) -> KVEstimate:
    if seq_len < 0 or batch < 1:
        raise ValueError("seq_len must be >= 0 and batch >= 1")
    pol = parse_policy(policy)
    g = geometry
    plans = pol.plan(g.num_layers, list(g.layer_types) if g.layer_types else None)
    shared: dict[str, int] = {}
    per_layer = []
    dense_total = 0
    for plan in plans:
        if plan.dense_window:
            # transformers' DynamicSlidingWindowLayer keeps the last window - 1 tokens between calls
            held = min(seq_len, (g.sliding_window - 1) if g.sliding_window else seq_len)
            dense = 2 * batch * g.kv_heads * held * g.head_dim * FP_BYTES
            per_layer.append(dense)
            dense_total += dense
            continue
        total = 0
        for spec, role in ((plan.k, "k"), (plan.v, "v")):
            codec = pol.build_codec(spec, role)
            nbytes, packed = store_bytes(codec, plan.sink, plan.recent, seq_len, batch, g.kv_heads, g.head_dim)
            total += nbytes
            if packed:
                shared.update(codec.shared_items(g.head_dim))
        per_layer.append(total)
        dense_total += 2 * batch * g.kv_heads * seq_len * g.head_dim * FP_BYTES
    sb = sum(shared.values())
    return KVEstimate(pol.label, seq_len, batch, sum(per_layer) + sb, dense_total, sb, per_layer)
