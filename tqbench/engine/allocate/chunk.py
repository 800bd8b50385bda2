"""The chunk measurement every allocation step uses: exact prefill K/V once, then chunk forwards over edited K/V.

``ChunkRunner(engine, ids, prefill)`` prefills ``ids[:, :prefill]`` (``[batch, tokens]``, one calibration sequence
per row) once with exact attention, keeps every layer's dense K/V and the hidden state entering every decoder layer
on the chunk ``ids[:, prefill:]`` of that exact run, and the exact chunk's log-probabilities. ``kl(keys, values,
start)`` feeds the chunk over the given per-layer K/V histories and returns the mean KL(exact || candidate) of the
chunk's next-token distributions over every sequence and position.

Layer skipping: when only layers ``>= start`` differ from the exact K/V, the hidden state entering layer ``start``
is the exact run's (layers below read exact K/V), so the chunk runs from layer ``start`` on: the decoder's layer list
is cut to ``layers[start:]`` for the call and the captured hidden state goes in as ``inputs_embeds``. That is only
valid for decoders that feed ``inputs_embeds`` straight to the first layer (llama-like); the runner checks it once
(from a middle layer, against the full forward, on exact K/V: must agree to the last bit) and otherwise runs every
cell from layer 0 (``skip_note`` says so and why).
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

from tqbench.engine.allocate.gqa import grouped_sdpa
from tqbench.engine.cache.store import KVStore
from tqbench.engine.codecs.calibrated import is_calibrated_spec
from tqbench.engine.metrics import kl_rows


def quantized_rows(policy, spec: str, role: str, rows: torch.Tensor, layer: int | None = None,
                   heads: tuple[int, ...] | None = None) -> torch.Tensor:
    """``rows`` ([batch, heads, tokens, head_dim]) as a cache under ``policy`` with codec ``spec`` holds them;
    ``layer``/``heads``: the layer and KV heads the codec serves (calibrated codecs need them)."""
    codec = build_codec(policy, spec, role, layer, heads)
    store = KVStore(codec, policy.sink, policy.recent)
    store.append(rows)
    return store.dense(rows.dtype)


def build_codec(policy, spec: str, role: str, layer: int | None, heads: tuple[int, ...] | None = None):
    """``policy.build_codec`` for one layer and (when given) a subset of its KV heads."""
    if heads is None:
        return policy.build_codec(spec, role, layer=layer)
    if "heads" in inspect.signature(policy.build_codec).parameters:
        return policy.build_codec(spec, role, layer=layer, heads=tuple(heads))
    if is_calibrated_spec(spec):  # only calibrated codecs differ per head
        raise ValueError(f"{spec} per KV head needs Policy.build_codec(..., heads=...), which this build lacks")
    return policy.build_codec(spec, role, layer=layer)


def _decoder_layers(model):
    try:
        dec = model.get_decoder()
    except (AttributeError, NotImplementedError):
        return None, None
    layers = getattr(dec, "layers", None)
    return (dec, layers) if isinstance(layers, torch.nn.ModuleList) else (None, None)


class ChunkRunner:
    """Exact prefill K/V of a calibration batch and chunk forwards over edited K/V (see the module doc)."""

    def __init__(self, engine, ids: torch.Tensor, prefill: int) -> None:
        if ids.dim() != 2:
            raise ValueError(f"ids must be shaped [sequences, tokens], got {tuple(ids.shape)}")
        if prefill < 1 or ids.shape[1] - prefill < 1:
            raise ValueError(f"prefill={prefill} must leave at least one calibration step in {ids.shape[1]} tokens")
        self.engine = engine
        self.model = engine.model
        self.config = engine.config
        device = next(self.model.parameters()).device
        self.ids = ids.to(device)
        self.prefill = prefill
        self.chunk = self.ids[:, prefill:]
        self.calls = 0
        dec, layers = _decoder_layers(self.model)
        self._decoder, self._layers = dec, layers
        with torch.inference_mode():
            cache = DynamicCache(config=self.config)
            self.model(input_ids=self.ids[:, :prefill], cache=cache, use_cache=True)
            self.keys = [layer.keys.clone() for layer in cache.layers]
            self.values = [layer.values.clone() for layer in cache.layers]
            del cache
            self.inputs: list[torch.Tensor] = []
            hooks = []
            if layers is not None:
                for layer in layers:
                    hooks.append(layer.register_forward_pre_hook(self._capture, with_kwargs=True))
            try:
                self.base_lp = self._forward(self.keys, self.values, 0, full=True)
            finally:
                for h in hooks:
                    h.remove()
        self.skip_note = self._check_skip()

    def _capture(self, module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        self.inputs.append(hidden.detach().clone())

    def _check_skip(self) -> str | None:
        n = len(self.keys)
        if self._layers is None or len(self.inputs) != n:
            return "this model's decoder has no layer list to cut: every cell runs all layers"
        mid = n // 2
        with torch.inference_mode():
            lp = self._forward(self.keys, self.values, mid)
        if not torch.equal(lp, self.base_lp):
            self._layers = None
            return ("running from a middle layer did not reproduce the full forward on this model's decoder: "
                    "every cell runs all layers")
        return None

    @property
    def layer_skipping(self) -> bool:
        return self.skip_note is None

    def _cache(self, keys: list, values: list) -> DynamicCache:
        cache = DynamicCache(config=self.config)
        for layer, k, v in zip(cache.layers, keys, values):
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v  # the chunk's own K/V are concatenated to new tensors: ours stay intact
        return cache

    def _forward(self, keys: list, values: list, start: int, full: bool = False) -> torch.Tensor:
        with grouped_sdpa(self.ids.device):
            return self._forward_layers(keys, values, start, full)

    def _forward_layers(self, keys: list, values: list, start: int, full: bool = False) -> torch.Tensor:
        self.calls += 1
        cache = self._cache(keys, values)
        if full or start == 0 or self._layers is None:
            out = self.model(input_ids=self.chunk, cache=cache, use_cache=True)
        else:
            pos = torch.arange(self.prefill, self.ids.shape[1], device=self.ids.device)[None]
            self._decoder.layers = torch.nn.ModuleList(list(self._layers)[start:])
            try:
                out = self.model(inputs_embeds=self.inputs[start], position_ids=pos, cache=cache, use_cache=True)
            finally:
                self._decoder.layers = self._layers
        return torch.log_softmax(out.logits.float(), -1)

    def kl(self, keys: list, values: list, start: int = 0) -> float:
        """Mean KL(exact || candidate) over the chunk, with layers ``< start`` holding the exact K/V."""
        with torch.inference_mode():
            lp = self._forward(keys, values, start)
        return float(kl_rows(self.base_lp.flatten(0, 1), lp.flatten(0, 1)).mean())

    def logprobs(self, keys: list, values: list, start: int = 0) -> torch.Tensor:
        with torch.inference_mode():
            return self._forward(keys, values, start)
