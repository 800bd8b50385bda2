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
a real continuation gets. A compressed sliding layer's candidate (``sliding_candidate``) is a real ``TQLayer``
(compressed mode, its window-bounded stores) given the exact prefill rows and then put in past recording: each
chunk query reads that layer as teacher-forced decoding one token at a time would (the chunk's own rows packed as
they age past the recent window; ``cache.precision``), since on a window the chunk's own rows are most of what a
query reads. Full-attention layers keep the cheaper form: the prefill history quantized, the chunk's rows exact.

Layer skipping: when only layers ``>= start`` differ from the exact K/V, the hidden state entering layer ``start``
is the exact run's (layers below read exact K/V), so the chunk runs from layer ``start`` on: for the call the
layers below ``start`` are replaced by pass-throughs (the decoder still embeds, builds its masks and position
embeddings, and indexes its per-layer types as usual) and a pre-hook hands layer ``start`` the captured hidden
state. The runner checks it once (from a middle layer, against the full forward, on exact K/V: must agree to the
last bit) and otherwise runs every cell from layer 0 (``skip_note`` says so and why).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from tqbench.engine.allocate.gqa import grouped_sdpa
from tqbench.engine.cache.layer import TQLayer
from tqbench.engine.cache.store import KVStore
from tqbench.engine.codecs.calibrated import is_calibrated_spec
from tqbench.engine.metrics import kl_from_logits
from tqbench.engine.policy.spec import Policy


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


@dataclass(frozen=True)
class SlidingCandidate:
    """A compressed sliding-window layer's candidate: the layer as ``policy`` plans it, with K and V specs ``k`` and
    ``v`` (per-KV-head lists allowed). Goes in the K (and V) list handed to ``ChunkRunner.kl`` at its layer."""

    policy: Policy
    k: str
    v: str


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
        #: the chunk positions whose KL ``kl`` averages (all; a retrieval probe scores its answer tokens only)
        self.scored = slice(None)
        dec, layers = _decoder_layers(self.model)
        self._decoder, self._layers = dec, layers
        self._start_hidden: torch.Tensor | None = None
        self._fused_ready = False
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
                self._base_logits = self._forward(self.keys, self.values, 0, full=True)
            finally:
                for h in hooks:
                    h.remove()
            self.base_lp = torch.log_softmax(self._base_logits, -1)
            # what every cell's KL reads of the exact side, computed once (``kl``)
            self._p = self.base_lp.exp()
            self._base_lse = torch.logsumexp(self._base_logits, -1)
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
                logits = self._forward(self.keys, self.values, mid)
            same = torch.equal(logits, self._base_logits)
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
        """The exact prefill's ``role`` rows of full-attention layer ``layer`` (of KV head ``head`` alone:
        ``[batch, 1, prefill, d]``) as a cache under ``policy`` with codec ``spec`` holds them (``quantized_rows``)."""
        if self.windows[layer] is not None:
            raise ValueError(f"layer {layer} is a sliding-window layer: its candidate is a sliding_candidate "
                             "(read per query as decoding would), not quantized rows")
        src = (self.keys if role == "k" else self.values)[layer]
        if head is None:
            return quantized_rows(policy, spec, role, src, layer)
        return quantized_rows(policy, spec, role, src[:, head:head + 1], layer, (head,))

    def cell(self, policy, layer: int, specs: dict[tuple[str, int | None], str]) -> tuple[list, list]:
        """(keys, values) for ``kl``: the exact prefill with ``layer``'s units as ``specs`` says, ``(role, head)``
        -> codec (head None: the whole role). A full-attention layer's rows quantized (``quantized``); a sliding
        layer as a ``sliding_candidate`` (roles and heads not in ``specs`` exact)."""
        ks, vs = list(self.keys), list(self.values)
        if self.windows[layer] is not None:
            kv_heads = self.engine.geometry.kv_heads
            per = {}
            for role in ("k", "v"):
                heads = [specs.get((role, None), specs.get((role, h), "fp16")) for h in range(kv_heads)]
                per[role] = heads[0] if len(set(heads)) == 1 else "|".join(heads)
            ks[layer] = vs[layer] = self.sliding_candidate(policy, layer, per["k"], per["v"])
            return ks, vs
        for role in ("k", "v"):
            by_head = {h: spec for (r, h), spec in specs.items() if r == role}
            target = ks if role == "k" else vs
            if None in by_head:
                target[layer] = self.quantized(policy, by_head[None], role, layer)
            elif by_head:
                rows = target[layer].clone()
                for h, spec in by_head.items():
                    rows[:, h:h + 1] = self.quantized(policy, spec, role, layer, h)
                target[layer] = rows
        return ks, vs

    def sliding_candidate(self, policy, layer: int, k: str, v: str) -> SlidingCandidate:
        """Sliding-window layer ``layer`` under ``policy`` with K spec ``k`` and V spec ``v`` (``fp16`` for a role
        left exact; a per-KV-head list ``a|b`` for head cells): put it at ``layer`` in both lists given to ``kl``."""
        if self.windows[layer] is None:
            raise ValueError(f"layer {layer} is not a sliding-window layer: quantize its rows (quantized())")
        return SlidingCandidate(policy, k, v)

    def _sliding_layer(self, cand: SlidingCandidate, layer: int) -> TQLayer:
        """A compressed-mode ``TQLayer`` that stored the exact prefill as the cache does, past recording from there
        (each chunk query reads it as decoding one token at a time would)."""
        geo = self.engine.geometry
        plan = cand.policy.plan(geo.num_layers, list(geo.layer_types) if geo.layer_types else None)[layer]
        if not plan.sliding:
            raise ValueError(f"layer {layer} is not compressed in a window-bounded store under "
                             f"{cand.policy.to_string()!r} (sliding=compress, or auto when every layer slides)")
        if not self._fused_ready:  # a verification call's per-query precision runs in tqbench's attention function
            self.engine.enable_fused()
            self._fused_ready = True
        tq = TQLayer(replace(plan, k=cand.k, v=cand.v), "compressed", cand.policy, geo.sliding_window, geo.kv_heads)
        tq.update(self.keys[layer], self.values[layer])
        tq.activate_past_recording(self.prefill)
        return tq

    def _cache(self, keys: list, values: list) -> DynamicCache:
        """A cache as transformers' holds it after the prefill: every row of a full-attention layer, the last
        ``window - 1`` of a sliding one (``prefill`` tokens seen); a ``SlidingCandidate``'s ``TQLayer``."""
        cache = DynamicCache(config=self.config)
        for i, (k, v, w) in enumerate(zip(keys, values, self.windows)):
            if isinstance(k, SlidingCandidate) or isinstance(v, SlidingCandidate):
                if k is not v:
                    raise ValueError(f"layer {i}: a sliding candidate goes in both the K and the V list")
                cache.layers[i] = self._sliding_layer(k, i)
                continue
            cl = cache.layers[i]
            if w is not None:
                k, v = k[:, :, max(0, k.shape[2] - w):], v[:, :, max(0, v.shape[2] - w):]
            cl.lazy_initialization(k, v)
            cl.keys, cl.values = k, v  # the chunk's own K/V are concatenated to new tensors: ours stay intact
            if w is not None:
                cl.cumulative_length = self.prefill
        return cache

    def _enter_start(self, module, args, kwargs):
        hidden = self._start_hidden
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    def _forward(self, keys: list, values: list, start: int, full: bool = False) -> torch.Tensor:
        cache = self._cache(keys, values)  # (before the switch: a compressed sliding layer installs fused attention)
        with grouped_sdpa(self.engine.model, self.ids.device):
            return self._forward_layers(cache, start, full)

    def _forward_layers(self, cache, start: int, full: bool = False) -> torch.Tensor:
        self.calls += 1
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
        return out.logits.to(torch.promote_types(out.logits.dtype, torch.float32))

    def kl(self, keys: list, values: list, start: int = 0) -> float:
        """Mean KL(exact || candidate) over the chunk, with layers ``< start`` holding the exact K/V
        (``metrics.kl_from_logits``: the exact side's probabilities and log-normalizer computed once)."""
        with torch.inference_mode():
            logits = self._forward(keys, values, start)
            at = (slice(None), self.scored)
            return float(kl_from_logits(self._p[at], self._base_logits[at], self._base_lse[at], logits[at]).mean())

    def logprobs(self, keys: list, values: list, start: int = 0) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(self._forward(keys, values, start), -1)
