"""KVzip's context-reconstruction pass (Kim et al. 2025; kvpress ``KVzipPress``, written after it): the scores
``score=kvzip`` ranks rows by.

The context is prefilled into its own dense cache (exact attention); then, per chunk of ``CHUNK`` context tokens,
the model reads a repeat prompt ("Repeat the previous context exactly." and, after the first chunk, "... starting
with" the previous chunk's last 8 tokens), the chat template's end of user turn and start of answer, then the
chunk itself, as if reconstructing it. Each context row of the chunk is scored by the most attention any of those
queries (and any query head of its KV head) gives it, with the softmax over the first ``SINK`` rows, the chunk's
rows and the repeat's own rows (kvpress's subsampled keys); the first ``SINK`` rows score 1. The repeat rows are
cropped away after each chunk. Costs about twice the context's prefill (``GenerationResult.context_pass_seconds``).
"""

from __future__ import annotations

import sys
import time

import torch

from tqbench.engine.cache.evict.scores.attention import grouped

CHUNK = 2048  # context tokens reconstructed per pass (kvpress ``prepare(chunk_size=2048)``)
POSTFIX = 8  # tokens of the previous chunk that start the next repeat prompt (kvpress ``prev_postfix_size``)
SINK = 4  # kvpress ``n_sink``
FIRST = "\n\nRepeat the previous context exactly."
NEXT = "\n\nRepeat the part of the previous context exactly, starting with"
_Q_BLOCK = 512  # reconstruction queries per block (bounds the [queries x keys] matrix)
_ATTN = "tqbench_kvzip"
_state: dict = {"rec": None, "registered": False}


def suffix_ids(tokenizer) -> torch.Tensor:
    """The chat template's text between a user message and the answer (kvpress's split on a dummy context);
    ``"\\n"`` without a template."""
    if not getattr(tokenizer, "chat_template", None):
        text = "\n"
    else:
        dummy = "dummy context"
        sep = "\n" + "#" * len(dummy)
        full = tokenizer.apply_chat_template([{"role": "user", "content": dummy + sep}], add_generation_prompt=True,
                                             tokenize=False)
        text = full.split(sep)[-1]
    return tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]


def _encode(tokenizer, text: str) -> torch.Tensor:
    return tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]


def chunk_score(query: torch.Tensor, key: torch.Tensor, scaling: float, start: int, end: int) -> torch.Tensor:
    """[B, H, end - start]: the max over the ``q`` queries ([B, Hq, q, D], the call's, causal among themselves)
    and the query heads of each KV head of the softmax attention over ``key`` [B, H, n + q, D] restricted to the
    first ``min(SINK, start)`` rows, the rows ``start:end`` and the call's own ``q`` rows."""
    q = query.shape[2]
    sink = min(SINK, start)
    sub = torch.cat([key[:, :, :sink], key[:, :, start:end], key[:, :, -q:]], dim=2).float()
    qg = grouped(query.float(), key.shape[1])  # [B, H, r, q, D]
    best = None
    for a in range(0, q, _Q_BLOCK):
        blk = qg[:, :, :, a : a + _Q_BLOCK]
        logits = torch.einsum("bhrld,bhtd->bhrlt", blk, sub) * scaling
        rows = torch.arange(a, a + blk.shape[3], device=key.device)
        future = torch.arange(q, device=key.device)[None, :] > rows[:, None]  # [l, q]
        logits[..., -q:] = logits[..., -q:].masked_fill(future, float("-inf"))
        p = torch.softmax(logits, dim=-1)[..., sink : sink + end - start].amax(dim=(2, 3))
        best = p if best is None else torch.maximum(best, p)
    return best


def _hook(module, query, key, kwargs) -> None:
    rec = _state["rec"]
    layer = getattr(module, "layer_idx", None)
    if rec is None or layer is None:
        return
    n = rec["n"]
    if key.shape[2] != n + query.shape[2]:
        if getattr(module, "sliding_window", None):  # a sliding-window layer keeps its window and never evicts
            return  # (keep= evicts on full-attention layers only: a sliding layer has no evictor), so no score
        raise ValueError(f"score=kvzip reads every context row in each layer, and layer {layer} attends over "
                         f"{key.shape[2] - query.shape[2]} of {n} (a sliding-window layer): use another score")
    s = kwargs.get("scaling")
    scaling = float(s if s is not None else query.shape[-1] ** -0.5)
    rec["scores"][layer][..., rec["start"] : rec["end"]] = chunk_score(query, key, scaling, rec["start"],
                                                                       rec["end"]).to(rec["scores"][layer].dtype)


def _attend_sdpa(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    _hook(module, query, key, kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _attend_eager(module, query, key, value, attention_mask, **kwargs):
    _hook(module, query, key, kwargs)
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise RuntimeError(f"{type(module).__name__} has no eager_attention_forward to score through")
    return eager(module, query, key, value, attention_mask, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    if not _state["registered"]:
        AttentionInterface.register(_ATTN, _attend_sdpa)
        AttentionMaskInterface.register(_ATTN, sdpa_mask)
        AttentionInterface.register(_ATTN + "_eager", _attend_eager)
        AttentionMaskInterface.register(_ATTN + "_eager", eager_mask)
        _state["registered"] = True


def context_scores(model, tokenizer, ids: torch.Tensor, chunk: int = CHUNK,
                   base: str | None = None) -> tuple[list[torch.Tensor], float]:
    """(per layer ``[B, H, N]`` scores of the ``N`` context rows ``ids`` [B, N], seconds the pass took).
    ``base``: the model's own attention implementation (``sdpa`` or ``eager``; under the fused mode's switch the
    one it had before, ``scan.capture._base_attention``); None: the model's current one."""
    from transformers import DynamicCache

    t0 = time.perf_counter()
    _register()
    cfg = model.config
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    layers = text_cfg.num_hidden_layers
    kv_heads = getattr(text_cfg, "num_key_value_heads", None) or text_cfg.num_attention_heads
    device = next(model.parameters()).device
    ids = ids.to(device)
    b, n = ids.shape
    scores = [torch.zeros(b, kv_heads, n, dtype=torch.float32, device=device) for _ in range(layers)]
    suffix = suffix_ids(tokenizer).to(device)
    previous = cfg._attn_implementation
    base = base or previous
    cache = DynamicCache(config=cfg)
    model.set_attn_implementation(_ATTN + "_eager" if base == "eager" else _ATTN)  # (never the fused function)
    with torch.inference_mode():
        try:
            model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            for start in range(0, n, chunk):
                end = min(n, start + chunk)
                prompt = _encode(tokenizer, FIRST if start == 0 else NEXT).to(device)
                if start > 0:
                    prompt = torch.cat([prompt, ids[:, max(0, start - POSTFIX) : start]], dim=1)
                repeat = torch.cat([prompt.expand(b, -1), suffix.expand(b, -1), ids[:, start:end]], dim=1)
                _state["rec"] = {"n": n, "start": start, "end": end, "scores": scores}
                if hasattr(cache, "activate_past_recording"):  # sliding layers keep rows until the repeat is cropped
                    cache.activate_past_recording()
                model(input_ids=repeat, cache=cache, use_cache=True, logits_to_keep=1)
                cache.crop(-int(repeat.shape[1]))  # (transformers 5.x: a negative count removes rows)
        finally:
            _state["rec"] = None
            model.set_attn_implementation(previous)
    for s in scores:
        s[..., :SINK] = 1.0
    return scores, time.perf_counter() - t0
