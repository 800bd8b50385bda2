"""Capture real Q/K/V from a model: the recording attention implementation and ``capture_qkv``.

``capture_qkv`` runs one exact forward pass (no cache) over a prompt (optionally extended by greedily
generated tokens) with a recording attention implementation, and keeps, for the chosen layers, the query,
key and value tensors exactly as the attention function receives them (keys and queries after RoPE).
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field

import torch

from tqbench.engine.events import CancelFlag, OnEvent, QKVCaptured, emit, raise_if_cancelled
from tqbench.engine.policy.layers import select_layers
from tqbench.engine.request import RequestError, check_context

CAPTURE_ATTN = "tqbench_capture"
CAPTURE_ATTN_EAGER = "tqbench_capture_eager"
_lock = threading.Lock()
_active: dict = {}


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


def _base_attention(model) -> str | None:
    """The model's own attention implementation: under the fused mode's switch, the one it had before."""
    from tqbench.engine.cache.fused.install import ATTN_NAME
    from tqbench.engine.cache.fused.support import recorded_previous

    current = model.config._attn_implementation
    return recorded_previous(model.config) if current == ATTN_NAME else current


def resolve_layers(layers, num_layers: int) -> list[int]:
    """``None`` = all layers; a selector string (``0,3,-1`` or ``first2+last2``) or a list of indices."""
    if layers is None:
        return list(range(num_layers))
    if isinstance(layers, str):
        parts = [p.strip() for p in layers.replace(",", "+").split("+") if p.strip()]
        if not parts:
            raise RequestError("layers", layers, "give indices like 0,3,-1 or a selector like first2+last2")
        layers = "+".join(parts)
        return sorted(select_layers(layers, num_layers))
    out = set()
    for i in layers:
        out |= select_layers(str(int(i)), num_layers)
    return sorted(out)


def _forward_recording(model, ids: torch.Tensor, chosen: list[int]) -> tuple[dict[int, tuple], dict[int, float]]:
    """One exact forward pass through the recording attention: layer -> (q, k, v) and layer -> scaling."""
    _install_capture()
    raw: dict[int, tuple] = {}
    scaling: dict[int, float] = {}
    with _lock:
        previous = model.config._attn_implementation
        model.set_attn_implementation(CAPTURE_ATTN_EAGER if _base_attention(model) == "eager" else CAPTURE_ATTN)
        _active["capture"] = {"layers": set(chosen), "out": raw, "scaling": scaling}
        try:
            with torch.inference_mode():
                model(input_ids=ids.to(next(model.parameters()).device), use_cache=False)
        finally:
            _active["capture"] = None
            model.set_attn_implementation(previous)
    return raw, scaling


def capture_qkv(engine, prompt, layers=None, max_prompt_tokens: int = 512, generated_tokens: int = 0,
                chat: bool = True, *, on_event: OnEvent | None = None, cancel: CancelFlag | None = None) -> Capture:
    """Q/K/V of the chosen layers for ``prompt`` (text, messages or ids ``[1, T]``), truncated to the first
    ``max_prompt_tokens`` tokens, plus ``generated_tokens`` greedily generated ones (exact cache).
    ``QKVCaptured`` at the end; raises ``Cancelled`` when ``cancel()`` turns true."""
    if max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens={max_prompt_tokens} is invalid: use at least 1")
    if generated_tokens < 0:
        raise ValueError(f"generated_tokens={generated_tokens} is invalid: use 0 or more")
    n_layers = engine.geometry.num_layers
    chosen = resolve_layers(layers, n_layers)
    ids = prompt if isinstance(prompt, torch.Tensor) else engine.encode_prompt(prompt, chat, fit_context=False)
    truncated = ids.shape[1] > max_prompt_tokens
    ids = ids[:, :max_prompt_tokens]
    prompt_n = int(ids.shape[1])
    check_context(prompt_n, generated_tokens, engine.max_context, engine.name)  # what is kept must fit
    if generated_tokens:
        gen = engine.generate(ids, None, max_new_tokens=generated_tokens, stop_at_eos=False, cancel=cancel).token_ids
        ids = torch.cat([ids, torch.tensor([gen], dtype=ids.dtype)], dim=1)
    raise_if_cancelled(cancel, "capture")
    raw, scaling = _forward_recording(engine.model, ids, chosen)
    out = {i: LayerQKV(i, *raw[i], scaling[i]) for i in raw}
    missing = [i for i in chosen if i not in out]
    if missing:
        raise RuntimeError(f"layers {missing} were not captured: the model's attention did not go through "
                           "the attention interface")
    first = out[chosen[0]]
    emit(on_event, QKVCaptured(tuple(sorted(out)), int(ids.shape[1])))
    return Capture(engine.name, ids[0].tolist(), prompt_n, int(ids.shape[1]) - prompt_n, truncated, n_layers,
                   first.q.shape[0], first.k.shape[0], first.k.shape[-1], out)
