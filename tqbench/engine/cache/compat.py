"""``CompressedDynamicCache``: the seed product's diagnostic wrapper, for users coming from it.

It patches a transformers ``DynamicCache`` in place: while enabled, every K/V row a layer receives is
TurboQuant-encoded into a packed side store and the ``DynamicCache`` keeps the *dequantized* rows, so the
model attends over quantized values. The side store of each layer is a ``TQLayer`` in the ``simulate``
mode of ``TQCache`` (no sinks, no recent window, uncentered keys), read the seed's way: the rows of a call
are dequantized for that same call (``TQLayer.append_read_quantized``). New code should use
``TQCache`` / ``Engine``; this class keeps the old surface working::

    cache = DynamicCache(config=model.config)
    with CompressedDynamicCache(cache, head_dim=64, k_bits=4, v_bits=3, model_config=model.config) as cdc:
        model.generate(**inputs, cache=cache, max_new_tokens=32)
        print(cdc.compression_stats())
"""

from __future__ import annotations

import torch

from tqbench.engine.cache.geometry import dense_fp16_bytes
from tqbench.engine.cache.tqcache import TQLayer
from tqbench.engine.policy.spec import LayerPlan, Policy


class CompressedDynamicCache:
    def __init__(self, cache, head_dim: int, bits: int | None = None, k_bits: int | None = None,
                 v_bits: int | None = None, model_config=None, rotation: str = "qr", seed: int = 0) -> None:
        if bits is not None and (k_bits is not None or v_bits is not None):
            raise ValueError("give either bits=... or k_bits=.../v_bits=..., not both")
        k_bits = bits if bits is not None else k_bits
        v_bits = bits if bits is not None else v_bits
        if k_bits is None or v_bits is None:
            raise ValueError("give bits=... (K and V) or both k_bits=... and v_bits=...")
        for name, b in (("k_bits", k_bits), ("v_bits", v_bits)):
            if b not in (1, 2, 3, 4):
                raise ValueError(f"{name}={b} is invalid: TurboQuant bits must be 1, 2, 3 or 4")
        if not isinstance(head_dim, int) or head_dim < 2:
            raise ValueError(f"head_dim={head_dim!r} is invalid: give the model's attention head size, e.g. 64")
        if not hasattr(cache, "update") or not hasattr(cache, "layers"):
            raise TypeError("CompressedDynamicCache wraps a transformers DynamicCache: pass one as `cache`")
        self.cache = cache
        self.head_dim = head_dim
        # the seed's codecs: uncentered turbo K and V, norm correction on, V seeded with seed + 1
        self.policy = Policy(k=f"turbo{k_bits}", v=f"turbo{v_bits}", rotation=rotation, center=False,
                             vcenter=False, seed=seed)
        self.k_codec = self.policy.build_codec(self.policy.k, "k")
        self.v_codec = self.policy.build_codec(self.policy.v, "v")
        self.bypassed: set[int] = set()
        types = getattr(model_config, "layer_types", None) if model_config is not None else None
        if types and {"sliding_attention", "full_attention"} <= set(types):
            self.bypassed = {i for i, t in enumerate(types) if t == "full_attention"}
        self.enabled = False
        self._patched = False
        self._orig_update = None
        self._layers: dict[int, TQLayer] = {}  # compressed layers: their packed stores
        self._dense_rows: dict[int, int] = {}  # bypassed layers: rows held in fp16

    # -- switching ------------------------------------------------------------------------------
    def enable(self) -> CompressedDynamicCache:
        if not self._patched:
            self._orig_update = self.cache.update
            self.cache.update = self._update
            self._patched = True
        self.enabled = True
        return self

    def disable(self) -> CompressedDynamicCache:
        """Stop compressing new rows (rows already stored stay as they are)."""
        self.enabled = False
        return self

    def restore(self) -> None:
        """Remove the patch: the DynamicCache behaves exactly as before wrapping."""
        if self._patched:
            del self.cache.update
            self._patched = False
        self.enabled = False

    def __enter__(self) -> CompressedDynamicCache:
        return self.enable()

    def __exit__(self, *exc) -> None:
        self.restore()

    # -- the patched update ------------------------------------------------------------------------
    def _check(self, x: torch.Tensor, what: str) -> None:
        if x.dim() != 4 or x.shape[-1] != self.head_dim:
            raise ValueError(
                f"{what} must be shaped [batch, heads, tokens, head_dim={self.head_dim}], got {tuple(x.shape)}"
            )

    def _update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self._check(key_states, "key_states")
        self._check(value_states, "value_states")
        if not self.enabled or layer_idx in self.bypassed:
            if layer_idx in self.bypassed:
                self._dense_rows[layer_idx] = self._dense_rows.get(layer_idx, 0) + key_states.shape[0] * key_states.shape[1] * key_states.shape[2]
            return self._orig_update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self._layers.get(layer_idx)
        if layer is None:
            plan = LayerPlan(layer_idx, self.policy.k, self.policy.v, sink=0, recent=0)
            layer = self._layers[layer_idx] = TQLayer(plan, "simulate", self.policy)
        k, v = layer.append_read_quantized(key_states, value_states)
        return self._orig_update(k, v, layer_idx, *args, **kwargs)

    # -- inspection ------------------------------------------------------------------------------------
    def get_compressed(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(packed key indices, key norms, packed value indices, value norms) of one layer."""
        if layer_idx in self.bypassed:
            raise ValueError(f"layer {layer_idx} is bypassed (full attention in a mixed model): it is not compressed")
        if layer_idx not in self._layers:
            raise KeyError(f"layer {layer_idx} holds no compressed rows yet")
        k, v = self._layers[layer_idx].k_store.packed, self._layers[layer_idx].v_store.packed
        return k["idx"].view(), k["norm"].view(), v["idx"].view(), v["norm"].view()

    def vram_bytes(self) -> int:
        """Bytes of the compressed representation (packed indices + norms), bypassed layers as fp16,
        plus rotations and codebooks once."""
        packed = sum(sum(store.bytes_breakdown().values())
                     for layer in self._layers.values() for store in (layer.k_store, layer.v_store))
        dense = dense_fp16_bytes(sum(self._dense_rows.values()), self.head_dim)
        shared = {}
        if self._layers:
            for c in (self.k_codec, self.v_codec):
                shared.update(c.shared_items(self.head_dim))
        return packed + dense + sum(shared.values())

    def baseline_vram_bytes(self) -> int:
        """Bytes an fp16 DynamicCache would hold for the same rows."""
        rows = 0
        for layer in self._layers.values():
            norm = layer.k_store.packed.get("norm")
            rows += norm.n * norm.data.shape[0] * norm.data.shape[1] if norm is not None and norm.data is not None else 0
        rows += sum(self._dense_rows.values())
        return dense_fp16_bytes(rows, self.head_dim)

    def compression_stats(self) -> dict:
        comp, base = self.vram_bytes(), self.baseline_vram_bytes()
        return {
            "compressed_bytes": comp,
            "baseline_fp16_bytes": base,
            "compression_ratio": round(base / comp, 3) if comp else 0.0,
            "memory_saved_pct": round(100 * (1 - comp / base), 2) if base else 0.0,
            "k_bits": self.k_codec.spec,
            "v_bits": self.v_codec.spec,
            "compressed_layers": sorted(self._layers),
            "bypassed_layers": sorted(self.bypassed),
            "tokens": max((layer.cumulative_length for layer in self._layers.values()), default=0),
        }
