"""The chunk measurement every allocation step uses: exact prefill K/V once, then chunk forwards over edited K/V.

``ChunkRunner(engine, ids, prefill)`` prefills ``ids[:, :prefill]`` (``[batch, tokens]``, one calibration sequence
per row) once with exact attention, keeps every layer's dense K/V (all ``prefill`` rows, sliding-window layers
included) and the hidden state entering every decoder layer on the chunk ``ids[:, prefill:]`` of that exact run,
and the exact chunk's log-probabilities. ``kl(keys, values, start)`` feeds the chunk over the given per-layer K/V
histories and returns the mean KL(exact || candidate) of the chunk's next-token distributions over every sequence
and position.

Sliding-window layers (the config's per-layer types, as ``DynamicCache(config=...)`` builds them): the chunk's
cache holds what transformers' ``DynamicSlidingWindowLayer`` holds after the prefill, the last ``window - 1`` rows
of the given history with ``prefill`` tokens seen, so the chunk's positions and per-layer-type masks are the ones
a real continuation gets. ``quantized(...)`` gives a sliding layer's candidate the way a window-bounded ``KVStore``
(``sliding=compress|dense``) holds it after that prefill: the rows it evicted were never readable, the rest
packed past the recent window (no sinks). A proxy caveat: the chunk's own rows stay exact, so on a sliding layer
only the first ``window - 1`` chunk positions read quantized rows (full-attention layers read them all).

Layer skipping: when only layers ``>= start`` differ from the exact K/V, the hidden state entering layer ``start``
is the exact run's (layers below read exact K/V), so the chunk runs from layer ``start`` on: for the call the
layers below ``start`` are replaced by pass-throughs (the decoder still embeds, builds its masks and position
embeddings, and indexes its per-layer types as usual) and a pre-hook hands layer ``start`` the captured hidden
state. The runner checks it once (from a middle layer, against the full forward, on exact K/V: must agree to the
last bit) and otherwise runs every cell from layer 0 (``skip_note`` says so and why).
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from tqbench.engine.cache.store import KVStore
from tqbench.engine.codecs.calibrated import is_calibrated_spec
from tqbench.engine.metrics import kl_rows


def quantized_rows(policy, spec: str, role: str, rows: torch.Tensor, layer: int | None = None,
                   heads: tuple[int, ...] | None = None, window: int | None = None) -> torch.Tensor:
    """``rows`` ([batch, heads, tokens, head_dim]) as a cache under ``policy`` with codec ``spec`` holds them;
    ``layer``/``heads``: the layer and KV heads the codec serves (calibrated codecs need them). ``window``: a
    sliding-window layer's readable rows (its ``sliding_window - 1``): the store is window-bounded as the cache's
    (no sinks; rows before the window evicted); the result keeps ``rows``' shape, the evicted rows as given (no
    attention reads them)."""
    codec = build_codec(policy, spec, role, layer, heads)
    if window is None:
        store = KVStore(codec, policy.sink, policy.recent)
        store.append(rows)
        return store.dense(rows.dtype)
    store = KVStore(codec, policy.sink, policy.recent, window, codec.tokens_per_unit)
    store.append(rows)
    out = rows.clone()
    out[:, :, store.dropped:] = store.dense(rows.dtype)
    return out


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


class _PassThrough(torch.nn.Module):
    """A skipped decoder layer: hands its hidden state on unchanged (and touches no cache layer)."""

    def forward(self, hidden_states=None, *args, **kwargs):
        return hidden_states


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
        self._start_hidden: torch.Tensor | None = None
        with torch.inference_mode():
            cache = DynamicCache(config=self.config)
            #: per layer: the rows a sliding-window layer reads besides a call's own (``sliding_window - 1``), or None
            self.windows: list[int | None] = []
            for i, layer in enumerate(cache.layers):
                if isinstance(layer, DynamicSlidingWindowLayer):
                    self.windows.append(layer.sliding_window - 1)
                    layer.activate_past_recording()  # keep every prefill row (the candidates' stores see them all)
                elif type(layer) is DynamicLayer:
                    self.windows.append(None)
                else:
                    raise ValueError(f"{engine.name}: layer {i}'s cache is a {type(layer).__name__}; the allocation "
                                     "chunk runner handles DynamicLayer and DynamicSlidingWindowLayer caches only")
            self.model(input_ids=self.ids[:, :prefill], cache=cache, use_cache=True)
            self.keys = [layer.keys.clone() for layer in cache.layers]
            self.values = [layer.values.clone() for layer in cache.layers]
            held = {k.shape[2] for k in self.keys}
            if held != {prefill}:
                raise RuntimeError(f"{engine.name}: the prefill cache holds {sorted(held)} rows per layer, expected "
                                   f"all {prefill}")
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
        try:
            with torch.inference_mode():
                lp = self._forward(self.keys, self.values, mid)
            same = torch.equal(lp, self.base_lp)
            why = "did not reproduce the full forward"
        except Exception as e:  # a decoder that does more between layers than hand the hidden state on
            same, why = False, f"failed ({type(e).__name__}: {e})"
        if not same:
            self._layers = None
            return f"running from a middle layer {why} on this model's decoder: every cell runs all layers"
        return None

    @property
    def layer_skipping(self) -> bool:
        return self.skip_note is None

    def quantized(self, policy, spec: str, role: str, layer: int, head: int | None = None) -> torch.Tensor:
        """The exact prefill's ``role`` rows of ``layer`` (of KV head ``head`` alone: ``[batch, 1, prefill, d]``)
        as a cache under ``policy`` with codec ``spec`` holds them (``quantized_rows``; window-bounded on a
        sliding-window layer)."""
        src = (self.keys if role == "k" else self.values)[layer]
        if head is None:
            return quantized_rows(policy, spec, role, src, layer, window=self.windows[layer])
        return quantized_rows(policy, spec, role, src[:, head:head + 1], layer, (head,), self.windows[layer])

    def _cache(self, keys: list, values: list) -> DynamicCache:
        """A cache as transformers' holds it after the prefill: every row of a full-attention layer, the last
        ``window - 1`` of a sliding one (``prefill`` tokens seen)."""
        cache = DynamicCache(config=self.config)
        for layer, k, v, w in zip(cache.layers, keys, values, self.windows):
            if w is not None:
                k, v = k[:, :, max(0, k.shape[2] - w):], v[:, :, max(0, v.shape[2] - w):]
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v  # the chunk's own K/V are concatenated to new tensors: ours stay intact
            if w is not None:
                layer.cumulative_length = self.prefill
        return cache

    def _enter_start(self, module, args, kwargs):
        hidden = self._start_hidden
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    def _forward(self, keys: list, values: list, start: int, full: bool = False) -> torch.Tensor:
        self.calls += 1
        cache = self._cache(keys, values)
        if full or start == 0 or self._layers is None:
            out = self.model(input_ids=self.chunk, cache=cache, use_cache=True)
        else:
            layers = list(self._layers)
            self._start_hidden = self.inputs[start]
            hook = layers[start].register_forward_pre_hook(self._enter_start, with_kwargs=True)
            self._decoder.layers = torch.nn.ModuleList([_PassThrough() for _ in range(start)] + layers[start:])
            try:
                out = self.model(input_ids=self.chunk, cache=cache, use_cache=True)
            finally:
                self._decoder.layers = self._layers
                hook.remove()
                self._start_hidden = None
        return torch.log_softmax(out.logits.to(torch.promote_types(out.logits.dtype, torch.float32)), -1)

    def kl(self, keys: list, values: list, start: int = 0) -> float:
        """Mean KL(exact || candidate) over the chunk, with layers ``< start`` holding the exact K/V."""
        with torch.inference_mode():
            lp = self._forward(keys, values, start)
        return float(kl_rows(self.base_lp.flatten(0, 1), lp.flatten(0, 1)).mean())

    def logprobs(self, keys: list, values: list, start: int = 0) -> torch.Tensor:
        with torch.inference_mode():
            return self._forward(keys, values, start)
