"""The compressed transformers cache: one ``TQLayer`` per attention layer, four modes.

| mode          | attention reads                                 | dense K/V resident during decode |
| dense-shadow  | exact K/V (the packed store is built for the report) | full                          |
| simulate      | dequantized rows kept in a dense buffer          | full                             |
| compressed    | dequantized from the packed store per layer/step | one layer, transient             |
| fused         | the packed store directly (see ``fused/``)       | none                             |

In every mode the rows of the current forward call attend exactly (prefill reads exact K/V and is
quantized afterwards); history is read as stored.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from tqbench.constants import CACHE_MODES
from tqbench.engine.cache.geometry import KVGeometry, UnsupportedModelError, check_supported, model_label
from tqbench.engine.cache.report import CacheReport, LayerBytes
from tqbench.engine.cache.store import FP_BYTES, KVStore
from tqbench.engine.codecs import AffineChannelCodec, AffineTokenCodec, TurboCodec
from tqbench.engine.policy.artifact import artifact_warning_for
from tqbench.engine.policy.spec import LayerPlan, Policy, parse_policy

__all__ = ["CACHE_MODES", "FusedKV", "TQCache", "TQLayer", "check_mode", "fused_reference_peak_bytes"]


def check_mode(mode: str) -> str:
    if mode not in CACHE_MODES:
        raise ValueError(f"unknown cache mode {mode!r}: valid modes are {', '.join(CACHE_MODES)}")
    return mode


@dataclass
class FusedKV:
    """What a fused-mode layer hands to the attention function instead of dense K/V."""

    k_store: KVStore
    v_store: KVStore
    new_k: torch.Tensor
    new_v: torch.Tensor
    # stored rows as of this call (captured before the new rows were appended)
    k_parts: tuple
    v_parts: tuple
    layer: TQLayer

    @property
    def shape(self) -> torch.Size:  # what code that inspects key.shape expects
        b, h, t, d = self.new_k.shape
        return torch.Size((b, h, self.k_store_tokens + t, d))

    @property
    def k_store_tokens(self) -> int:
        return sum(p[1] for p in self.k_parts)

    # a handle that reaches a plain attention function (fused mode without the fused attention installed)
    # says what to do instead of failing deep inside torch
    _MISUSE = ("a fused-mode TQCache handed its packed store to {name}, which needs dense K/V: the model's "
               "attention is not the fused one; call tqbench.engine.cache.fused.install_fused_attention(model) "
               "(Engine.make_cache does) before generating, or use cache mode compressed")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise TypeError(cls._MISUSE.format(name=getattr(func, "__name__", str(func))))

    def __getitem__(self, item):
        raise TypeError(self._MISUSE.format(name="an attention function"))


def _put_dequantized(rows: torch.Tensor | None, store: KVStore, packed: list, offset: int = 0) -> None:
    """Write the dequantized values of ``packed`` (``(start_token, encoded)`` chunks from ``store.append``) over
    their rows in ``rows``, whose first row is the store's token ``offset``: the simulate mode's one rule."""
    for start, enc in packed:
        deq = store.codec.decode(enc, store.state, rows.dtype)
        rows[:, :, start - offset : start - offset + deq.shape[2]] = deq


def _snapshot(store: KVStore) -> tuple:
    """(kind, n_tokens, payload) parts in token order, for the fused attention path."""
    parts = []
    if store.head.n:
        parts.append(("dense", store.head.n, store.head.view()))
    if store.n_packed:
        parts.append(("packed", store.n_packed, store.packed_view()))
    if store.tail.n:
        parts.append(("dense", store.tail.n, store.tail.view()))
    return tuple(parts)


class TQLayer(CacheLayerMixin):
    """One attention layer's compressed cache."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, plan: LayerPlan, mode: str, policy: Policy, sliding_window: int | None = None) -> None:
        super().__init__()
        self.plan = plan
        self.mode = check_mode(mode)
        self.policy = policy
        self.k_codec = policy.build_codec(plan.k, "k", layer=plan.layer)
        self.v_codec = policy.build_codec(plan.v, "v", layer=plan.layer)
        # a sliding-window layer: attention reads the last window - 1 stored rows (as transformers'
        # DynamicSlidingWindowLayer keeps them), the stores hold at most a codec unit more
        self.window = sliding_window - 1 if (plan.sliding and sliding_window) else None
        self.is_sliding = self.window is not None
        self.align = math.lcm(self.k_codec.tokens_per_unit, self.v_codec.tokens_per_unit)
        self.cumulative_length = 0
        self._new_stores()
        self.fused_calls = 0
        self.fallbacks: dict[str, int] = {}
        self.fused_impl: dict[str, int] = {}  # "native-cpu" / "triton" / "torch-reference (why)" -> calls
        self.native_workspace = 0  # largest transient bytes of one native call (partials + full-precision rows)
        self.sparse_v_rows = [0, 0]  # Sparse-V: value rows skipped, value rows with weight (native kernel)

    def _new_stores(self) -> None:
        self.k_store = KVStore(self.k_codec, self.plan.sink, self.plan.recent, self.window, self.align)
        self.v_store = KVStore(self.v_codec, self.plan.sink, self.plan.recent, self.window, self.align)
        self._sim_k = self._sim_v = None
        self._sim_pending: dict[str, list] = {}

    @property
    def lossless(self) -> bool:
        return self.k_codec.lossless and self.v_codec.lossless

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.keys = key_states.new_empty((0,))
        self.values = value_states.new_empty((0,))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        mode = "compressed" if (self.lossless and self.mode != "dense-shadow") else self.mode
        # rows attention reads: the stored history (the last window - 1 on a sliding layer) + this call's
        visible = key_states.shape[2] + (self.cumulative_length if self.window is None
                                         else min(self.cumulative_length, self.window))
        if mode == "dense-shadow":
            keys = torch.cat([self.keys.view(*key_states.shape[:2], -1, key_states.shape[3]), key_states], 2)
            values = torch.cat([self.values.view(*value_states.shape[:2], -1, value_states.shape[3]), value_states], 2)
            self.k_store.append(key_states)
            self.v_store.append(value_states)
            out = (keys[:, :, -visible:], values[:, :, -visible:])
            self.keys, self.values = (keys, values) if self.window is None else out
        elif mode == "simulate":
            out = (self._simulate(key_states, "k")[:, :, -visible:], self._simulate(value_states, "v")[:, :, -visible:])
        elif mode == "compressed":
            out = (self._with_history(self.k_store, key_states)[:, :, -visible:],
                   self._with_history(self.v_store, value_states)[:, :, -visible:])
            self.k_store.append(key_states)
            self.v_store.append(value_states)
        else:  # fused
            handle = FusedKV(
                self.k_store, self.v_store, key_states, value_states,
                _snapshot(self.k_store), _snapshot(self.v_store), self,
            )
            self.k_store.append(key_states)
            self.v_store.append(value_states)
            out = (handle, handle)
        self.cumulative_length += key_states.shape[2]
        return out

    def _with_history(self, store: KVStore, new: torch.Tensor) -> torch.Tensor:
        hist = store.dense(new.dtype)
        return new if hist is None else torch.cat([hist, new], dim=2)

    def _simulate(self, new: torch.Tensor, role: str) -> torch.Tensor:
        """Dense buffer of what attention reads. Rows packed by this call are swapped for their dequantized
        values at the start of the next call (this call still reads them exact, as the other modes do), so
        the buffer is never copied."""
        store = self.k_store if role == "k" else self.v_store
        buf = getattr(self, f"_sim_{role}")
        _put_dequantized(buf, store, self._sim_pending.pop(role, ()))
        out = new if buf is None else torch.cat([buf, new], dim=2)
        packed = store.append(new)
        if packed:
            self._sim_pending[role] = packed
        # the buffer follows the store's rows (a window-bounded store evicts its oldest)
        setattr(self, f"_sim_{role}", out[:, :, store.last_evicted:] if store.last_evicted else out)
        return out

    def append_read_quantized(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """The seed wrapper's simulate (``CompressedDynamicCache``): append this call's rows to the stores and
        return them as stored, every row packed by this call already dequantized (so this call, prefill
        included, reads quantized values). No dense buffer is kept: the caller holds the returned rows."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        out = []
        for store, new in ((self.k_store, key_states), (self.v_store, value_states)):
            offset = store.n_tokens
            packed = store.append(new)
            rows = new.clone() if packed else new
            _put_dequantized(rows, store, packed, offset)
            out.append(rows)
        self.cumulative_length += key_states.shape[2]
        return out[0], out[1]

    # -- transformers layer protocol ------------------------------------------------------------
    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.window is not None:  # as transformers' DynamicSlidingWindowLayer: the last window - 1 rows
            return min(self.cumulative_length, self.window) + query_length, max(self.cumulative_length - self.window, 0)
        return self.cumulative_length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.cumulative_length = 0
        self._new_stores()
        self.keys = self.values = None
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        for store in (self.k_store, self.v_store):
            store.select_batch(indices)
        for name in ("_sim_k", "_sim_v"):
            buf = getattr(self, name)
            if buf is not None:
                setattr(self, name, buf.index_select(0, indices.to(buf.device)))
        if self.keys.dim() == 4:
            self.keys = self.keys.index_select(0, indices.to(self.keys.device))
            self.values = self.values.index_select(0, indices.to(self.values.device))

    def offload(self) -> None:  # the packed store stays where it is
        return None

    def prefetch(self) -> None:
        return None

    def note_fallback(self, case: str) -> None:
        self.fallbacks[case] = self.fallbacks.get(case, 0) + 1


class TQCache(Cache):
    """A transformers ``Cache`` that compresses K/V under a ``Policy``.

    Pass it as ``cache=`` to ``model(...)`` or ``model.generate(...)``; read ``report()`` afterwards.
    """

    def __init__(self, policy: Policy | str, config, mode: str = "compressed") -> None:
        self.policy = parse_policy(policy)
        self.mode = check_mode(mode)
        check_supported(config)
        geo = KVGeometry.from_config(config)
        #: set when ``policy`` is a saved artifact fitted on a model of another KV geometry (also warned)
        self.policy_warning = artifact_warning_for(policy, geometry=geo)
        if self.policy_warning:
            warnings.warn(self.policy_warning, stacklevel=2)
        self.num_layers, self.num_kv_heads, self.head_dim = geo.num_layers, geo.kv_heads, geo.head_dim
        self.v_head_dim = geo.v_dim
        self.sliding_window = geo.sliding_window
        self._label = model_label(config)
        self._shape_checked = False
        layer_types = list(geo.layer_types) if geo.layer_types else None
        self.plans = self.policy.plan(self.num_layers, layer_types)
        layers = []
        for plan in self.plans:
            if plan.dense_window:
                layers.append(DynamicSlidingWindowLayer(sliding_window=geo.sliding_window))
            else:
                layers.append(TQLayer(plan, self.mode, self.policy, geo.sliding_window))
        super().__init__(layers=layers)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if not self._shape_checked:  # bytes are counted from the config's geometry: it must be the model's
            got = (key_states.shape[1], key_states.shape[-1], value_states.shape[-1])
            if got != (self.num_kv_heads, self.head_dim, self.v_head_dim):
                raise UnsupportedModelError(
                    f"{self._label}: its attention hands the cache K/V with {got[0]} heads, K head dim {got[1]} and "
                    f"V head dim {got[2]}, but its config reads as {self.num_kv_heads} KV heads, K head dim "
                    f"{self.head_dim} and V head dim {self.v_head_dim}: the compressed cache cannot count its "
                    "bytes; run it with the plain fp16 DynamicCache baseline"
                )
            self._shape_checked = True
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def peak_dense_kv_bytes(self) -> int:
        """The sum over layers (K and V) of the most dense rows each store held at once (``KVStore.peak_dense_bytes``):
        an upper bound on the dense K/V the compressed layers ever held together. A prompt prefilled in one call
        reaches its whole dense K/V per layer; in chunks, one chunk + the recent window."""
        return sum(la.k_store.peak_dense_bytes + la.v_store.peak_dense_bytes for la in self.layers
                   if isinstance(la, TQLayer))

    def report(self) -> CacheReport:
        rows = []
        shared: dict[str, int] = {}
        max_layer_dense = 0
        batch = 0
        for plan, layer in zip(self.plans, self.layers):
            if isinstance(layer, TQLayer):
                kb = layer.k_store.bytes_breakdown()
                vb = layer.v_store.bytes_breakdown()
                tokens = layer.k_store.n_tokens  # rows held (a window-bounded store holds its window)
                # the fp16 basis holds what transformers' cache would: a sliding layer's last window - 1 rows
                fp16_tokens = tokens if layer.window is None else min(layer.cumulative_length, layer.window)
                batch = batch or _batch_of(layer)
                for store, dim in ((layer.k_store, self.head_dim), (layer.v_store, self.v_head_dim)):
                    if store.n_packed:
                        shared.update(store.codec.shared_items(dim))
                rows.append(
                    LayerBytes(
                        layer=plan.layer, k_codec=plan.k, v_codec=plan.v, tokens=tokens,
                        k_bytes=sum(kb.values()), v_bytes=sum(vb.values()),
                        full_precision_bytes=kb["full_precision"] + vb["full_precision"],
                        packed_bytes=kb["packed"] + vb["packed"], state_bytes=kb["state"] + vb["state"],
                        k_packed_tokens=layer.k_store.n_packed, v_packed_tokens=layer.v_store.n_packed,
                        dense_fp16_bytes=batch * self.num_kv_heads * fp16_tokens * (self.head_dim + self.v_head_dim)
                        * FP_BYTES,
                        reason=plan.reason,
                    )
                )
                max_layer_dense = max(max_layer_dense, rows[-1].dense_fp16_bytes)
            else:  # transformers' sliding window layer: dense, bounded
                held = layer.keys.shape[2] if layer.is_initialized and layer.keys.dim() == 4 else 0
                b = layer.keys.shape[0] if held else 0
                k_dense = b * self.num_kv_heads * held * self.head_dim * FP_BYTES
                v_dense = b * self.num_kv_heads * held * self.v_head_dim * FP_BYTES
                dense = k_dense + v_dense
                rows.append(
                    LayerBytes(
                        layer=plan.layer, k_codec="fp16", v_codec="fp16", tokens=held, k_bytes=k_dense,
                        v_bytes=v_dense, full_precision_bytes=dense, packed_bytes=0, state_bytes=0,
                        k_packed_tokens=0, v_packed_tokens=0, dense_fp16_bytes=dense, reason=plan.reason,
                    )
                )
        fallbacks: dict[str, int] = {}
        impls: dict[str, int] = {}
        fused_calls = 0
        sparse = [0, 0]
        for layer in self.layers:
            if isinstance(layer, TQLayer):
                fused_calls += layer.fused_calls
                sparse = [sparse[0] + layer.sparse_v_rows[0], sparse[1] + layer.sparse_v_rows[1]]
                for case, n in layer.fallbacks.items():
                    fallbacks[case] = fallbacks.get(case, 0) + n
                for case, n in layer.fused_impl.items():
                    impls[case] = impls.get(case, 0) + n
        if self.mode == "fused":
            if impls and all(k in ("triton", "native-cpu") for k in impls) and not fallbacks:
                # the kernels keep split-K partials (+ the native call's joined full-precision rows), nothing decoded
                max_layer_dense = max((getattr(la, "native_workspace", 0) for la in self.layers), default=0)
            else:  # the torch reference's peak: one side of one layer decoded, with its int32 code index
                max_layer_dense = max(
                    (fused_reference_peak_bytes(layer, self.num_kv_heads, self.head_dim, self.v_head_dim)
                     for layer in self.layers if isinstance(layer, TQLayer)),
                    default=0,
                )
        windowed = [la.plan.layer for la in self.layers if isinstance(la, TQLayer) and la.window is not None]
        rep = CacheReport.build(
            mode=self.mode, policy=self.policy, layers=rows, shared=shared,
            transient_layer_bytes=max_layer_dense, fused_calls=fused_calls, fallbacks=fallbacks, fused_impl=impls,
            sparse_v=_sparse_v_summary(self.policy, sparse) if self.mode == "fused" else None,
            held_dtype=str(getattr(self.layers[0], "dtype", "")).replace("torch.", ""),
        )
        slow = sorted({why for la in self.layers if isinstance(la, TQLayer)
                       for c in (la.k_codec, la.v_codec) if (why := getattr(c, "encoder_fallback", None))})
        rep.notes.extend(slow)  # the append path's fast path did not run: say so, and why
        if windowed:
            rep.notes.append(
                f"{len(windowed)} sliding-window layers hold only their window ({self.sliding_window - 1} tokens, "
                f"plus up to one codec unit): their bytes and tokens stay bounded at any context"
            )
        return rep


def _sparse_v_summary(policy: Policy, rows: list[int]) -> dict | None:
    """What Sparse-V skipped (value rows, over the rows with any softmax weight), or None when it is off."""
    if not policy.sparsev:
        return None
    skipped, visited = rows
    return {"threshold": policy.sparsev, "skipped_rows": skipped, "weighted_rows": visited,
            "skipped_share": round(skipped / visited, 4) if visited else 0.0}


def fused_reference_peak_bytes(layer: TQLayer, kv_heads: int, head_dim: int, v_head_dim: int | None = None) -> int:
    """Transient bytes the fused torch reference holds while reading one side of ``layer``: the decoded rows
    (rotated-domain or dequantized, compute dtype), the int32 copy of the codes that indexes the byte table
    (plus the unpacked codes for widths that do not divide 8), and the concatenated full-precision rows.
    Codecs decoded by ``codec.decode`` (fallback) are counted at twice their rows."""
    if not layer.is_initialized:
        return 0
    elem = torch.promote_types(layer.dtype, torch.float32).itemsize
    bh = _batch_of(layer) * kv_heads
    peak = 0
    for store, dim in ((layer.k_store, head_dim), (layer.v_store, v_head_dim or head_dim)):
        fp_rows = bh * (store.n_full_precision + 1) * dim * elem
        rows = bh * store.n_packed * dim * elem
        codec = store.codec
        if not store.n_packed:
            side = 0
        elif type(codec) in (TurboCodec, AffineChannelCodec, AffineTokenCodec):
            code_bytes = store.packed["idx" if type(codec) is TurboCodec else "q"].view().numel()
            if codec.bits == 8:
                side = rows
            elif 8 % codec.bits == 0:
                side = rows + 4 * code_bytes
            else:
                side = rows + 5 * bh * store.n_packed * dim
        else:
            side = 2 * rows
        peak = max(peak, side + fp_rows)
    return peak


def _batch_of(layer: TQLayer) -> int:
    for buf in (layer.k_store.head, layer.k_store.tail, *layer.k_store.packed.values()):
        if buf.data is not None:
            return buf.data.shape[0]
    return 0
