"""The compressed transformers cache: one ``TQLayer`` per attention layer, four modes.

| mode          | attention reads                                 | dense K/V resident during decode |
| dense-shadow  | exact K/V (the packed store is built for the report) | full                          |
| simulate      | dequantized rows kept in a dense buffer          | full                             |
| compressed    | dequantized from the packed store per layer/step | one layer, transient             |
| fused         | the packed store directly (see ``fused/``)       | none                             |

In every mode the rows of the current forward call attend exactly (prefill reads exact K/V and is
quantized afterwards); history is read as stored. Speculative decoding (transformers' assisted generation
and prompt-lookup decoding) works in every mode: ``crop`` is exact, and a verification call's draft tokens
read every key at the precision they would have read decoding one at a time (``layer.py``, ``precision.py``).
The layer lives in ``layer.py``, its stores in ``store.py``, the byte report in ``layer_report.py``.
"""

from __future__ import annotations

import sys
import warnings

import torch
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

from tqbench.constants import CACHE_MODES
from tqbench.engine.cache.evict.state import EVICT_NO_CROP
from tqbench.engine.cache.geometry import KVGeometry, UnsupportedModelError, check_supported, model_label
from tqbench.engine.cache.handles import ATTN_NAME, FusedKV
from tqbench.engine.cache.layer import TQLayer, check_mode
from tqbench.engine.cache.layer_report import build_report
from tqbench.engine.cache.report import CacheReport
from tqbench.engine.policy.artifact import artifact_warning_for
from tqbench.engine.policy.checked import CheckedPolicy
from tqbench.engine.policy.files import parse_policy
from tqbench.engine.policy.spec import Policy

__all__ = ["CACHE_MODES", "FusedKV", "TQCache", "TQLayer", "check_mode"]


class TQCache(Cache):
    """A transformers ``Cache`` that compresses K/V under a ``Policy``.

    Pass it as ``cache=`` to ``model(...)`` or ``model.generate(...)``; read ``report()`` afterwards.
    """

    def __init__(self, policy: Policy | str | CheckedPolicy, config, mode: str = "compressed") -> None:
        self.policy = parse_policy(policy)
        self.mode = check_mode(mode)
        check_supported(config)
        geo = KVGeometry.from_config(config)
        #: set when ``policy`` is a saved artifact fitted on another model (also warned); a ``CheckedPolicy`` was
        #: checked at the door (``Engine.check_policy``, which warned): its warning is taken, not found again
        if isinstance(policy, CheckedPolicy):
            self.policy_warning = policy.warning
        else:
            self.policy_warning = artifact_warning_for(self.policy, geometry=geo)
            if self.policy_warning:
                warnings.warn(self.policy_warning, stacklevel=2)
        self.num_layers, self.num_kv_heads, self.head_dim = geo.num_layers, geo.kv_heads, geo.head_dim
        self.v_head_dim = geo.v_dim
        self.sliding_window = geo.sliding_window
        self._config = config
        self._label = model_label(config)
        self._shape_checked = False
        layer_types = list(geo.layer_types) if geo.layer_types else None
        # a CheckedPolicy was planned at the door on these layers: its plan is taken, not made again
        self.plans = (policy.plans_for(self.num_layers, layer_types) if isinstance(policy, CheckedPolicy)
                      else self.policy.plan(self.num_layers, layer_types))
        layers = []
        for plan in self.plans:
            if plan.dense_window:
                layers.append(DynamicSlidingWindowLayer(sliding_window=geo.sliding_window))
            else:
                layers.append(TQLayer(plan, self.mode, self.policy, geo.sliding_window, geo.kv_heads))
        super().__init__(layers=layers)
        if self.policy.budget == "global":  # one budget over every evicting layer and KV head
            from tqbench.engine.cache.evict.global_budget import GlobalBudget

            members = [la for la in layers if isinstance(la, TQLayer) and la.evictor is not None]
            shared = GlobalBudget(members, geo.head_dim, geo.v_dim)
            for la in members:
                la.shared_budget = la.evictor.shared = shared

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

    def activate_past_recording(self, prompt_tokens: int | None = None, **kwargs) -> None:
        """Speculative decoding from here on (transformers' assisted generation calls this before its first
        forward call): every call can be cropped back exactly, and a call's rows after the prompt are verified
        as draft tokens, each reading keys at the precision of one-at-a-time decoding.

        ``prompt_tokens``: how many of the next call's rows are prompt (a prefill: they attend exactly among
        themselves). transformers' first assisted call feeds the prompt and the first draft together, so when
        called from its ``_assisted_decoding`` the prompt length is read from that function's ``input_ids``;
        otherwise it defaults to 0 (every row from now on is a decode row). Other keywords (transformers 5.25's
        ``recurrent_states_to_keep``, for linear-attention layers) go to the layers that are not tqbench's."""
        if any(isinstance(la, TQLayer) and la.evictor is not None for la in self.layers):
            raise ValueError(EVICT_NO_CROP)
        lossy = any(isinstance(la, TQLayer) and not la.lossless for la in self.layers)
        if (lossy and self.mode in ("compressed", "simulate")
                and getattr(self._config, "_attn_implementation", None) != ATTN_NAME):
            raise ValueError(
                f"speculative decoding with a {self.mode}-mode TQCache needs tqbench's attention function (a draft "
                "token must read the rows packed during the verification call at its own precision): call "
                "tqbench.engine.cache.fused.install_fused_attention(model) first (it keeps the model's own "
                "attention for every other call), or use cache mode dense-shadow or fused")
        if prompt_tokens is None:
            prompt_tokens = _assisted_prompt_tokens(sys._getframe(1))
            if prompt_tokens is None:
                prompt_tokens = 0
        held = self.get_seq_length()
        for layer in self.layers:
            if isinstance(layer, TQLayer):
                layer.activate_past_recording(held + prompt_tokens)
            elif hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording(**kwargs)

    @property
    def evicts(self) -> bool:
        """True when a layer evicts tokens (``policy.keep``): its eviction points are the ends of calls of more
        than one row, so a prompt fed in chunks must not end with a one-row call (``generate.prefill``)."""
        return any(isinstance(la, TQLayer) and la.evictor is not None for la in self.layers)

    @property
    def needs_context_pass(self) -> bool:
        """True when a layer ranks rows by a context-pass score (``score=kvzip``): its scores must be handed to
        ``set_context_scores`` before the prefill (``evict.reconstruct.context_scores``)."""
        return any(isinstance(la, TQLayer) and la.evictor is not None and la.evictor.ranker.context_pass
                   for la in self.layers)

    def set_context_scores(self, scores) -> None:
        """Per-position scores ``[B, H, N]`` per layer (a list indexed by layer) for the layers whose score reads
        a context pass; read at their next eviction point."""
        for i, la in enumerate(self.layers):
            if isinstance(la, TQLayer) and la.evictor is not None and la.evictor.ranker.context_pass:
                la.evictor.set_rows(scores[i])

    def freeze_eviction(self, frozen: bool = True) -> None:
        """From here on a call of more than one row is no eviction point: rows appended to a compressed context
        (a question) are kept (query-agnostic compression: ``Engine.compress``)."""
        for la in self.layers:
            if isinstance(la, TQLayer) and la.evictor is not None:
                la.evictor.freeze(frozen)

    def peak_dense_kv_bytes(self) -> int:
        """The sum over layers (K and V) of the most dense rows each store held at once (``KVStore.peak_dense_bytes``):
        an upper bound on the dense K/V the compressed layers ever held together. A prompt prefilled in one call
        reaches its whole dense K/V per layer; in chunks, one chunk + the recent window."""
        return sum(la.k_store.peak_dense_bytes + la.v_store.peak_dense_bytes for la in self.layers
                   if isinstance(la, TQLayer))

    def report(self) -> CacheReport:
        return build_report(self)


def _assisted_prompt_tokens(frame) -> int | None:
    """The prompt length when ``frame`` is transformers' ``_assisted_decoding`` (its ``input_ids``), else None.
    transformers gives the cache no other way to tell where its first call's prompt ends and its draft begins."""
    if frame is None or frame.f_code.co_name != "_assisted_decoding":
        return None
    ids = frame.f_locals.get("input_ids")
    return int(ids.shape[-1]) if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None
