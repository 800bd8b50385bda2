"""The tokens axis of an allocation: a keep fraction per layer (token eviction, ``policy.keep``) beside the codecs.

- ``parse_axes`` / ``parse_keeps``: which axes an allocation searches (``bits``: codec widths per unit;
  ``tokens``: the keep fraction of each layer) and the keep fractions offered.
- ``KeepCells``: what a cache that evicts at the end of the calibration prefill keeps, per (layer, keep) and KV
  head, chosen by the policy's prefill score (``score=``, default snapkv; the same ``cache.evict.scores`` object
  the store's ``Evictor`` ranks with, chunked the same way) from the exact prefill's queries (the last
  ``window`` of each layer, recorded once through transformers' attention interface) and keys, the way the
  store's ``Evictor`` chooses (``cache.evict.budgets.select_kept``; ``policy.keep.kept_rows`` says how many). The
  chunk forwards then attend over the kept rows only: every layer keeps its ``prefill`` rows in the cache (so
  positions and transformers' masks are the exact run's) and the evicted ones are masked out per KV head, which
  is the same softmax as attending over the gathered kept rows. The kept rows are quantized as a store holding
  only them would (``quantized_rows`` on the gathered rows, scattered back).

Keep choices are per layer (``cell``) or per (layer, KV head) (``head_cell``: only that head evicts, the layer's
other heads keep every row; its kept rows are the same ones the layer cell keeps for that head, since each head
chooses its own). A layer whose heads keep different fractions is a ragged store (``keep@L=f0|f1|f2``); the
per-head solve is ``head_keeps.solve_joint_heads``.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import replace

import torch

from tqbench.engine.allocate.chunk import quantized_rows
from tqbench.engine.cache.evict import scores
from tqbench.engine.cache.evict.budgets import select_kept
from tqbench.engine.cache.evict.compact import _take
from tqbench.engine.policy.keep import check_keep, evicts, kept_rows, protected_rows
from tqbench.engine.policy.spec import Policy
from tqbench.engine.request import RequestError

AXES = ("bits", "tokens")
#: the axes searched unless asked: bits alone (see docs/allocation.md, "Tokens axis", for why)
DEFAULT_AXES = ("bits",)
#: the keep fractions the tokens axis offers each layer by default
KEEP_CHOICES = (1.0, 0.75, 0.5, 0.25)
#: scores a prefill-time keep cell cannot use: those that accumulate decode-time attention (h2o) and those
#: that read a context pass (kvzip): the calibration prefill records neither
def cell_scores() -> tuple[str, ...]:
    return tuple(n for n, c in scores.REGISTRY.items() if not (c.accumulates or c.context_pass))
_ATTN, _ATTN_EAGER = "tqbench_allocate_keep", "tqbench_allocate_keep_eager"
_active: dict = {"record": None, "masks": None, "registered": False}


def parse_axes(value) -> tuple[str, ...]:
    """``bits``, ``tokens`` or both (text ``"bits,tokens"`` or a list); ``RequestError`` (field ``axes``)."""
    items = value.split(",") if isinstance(value, str) else list(value or ())
    items = [str(a).strip().lower() for a in items if str(a).strip()]
    bad = [a for a in items if a not in AXES]
    if bad or not items:
        raise RequestError("axes", value, f"{'unknown axis ' + repr(bad[0]) if bad else 'no axis'}: give bits "
                                          "(codec widths), tokens (keep fractions) or bits,tokens")
    return tuple(a for a in AXES if a in items)


def speed_rule(axes: tuple[str, ...], min_speed):
    """The minimum decode speed an allocation over ``axes`` applies, and a note when it drops the default one:
    the decode-cost model has no term for evicted rows, so with the tokens axis a given ratio is refused."""
    from tqbench.engine.allocate.budget import resolve_min_speed

    if "tokens" not in axes or min_speed is None:
        return min_speed, None
    if resolve_min_speed(min_speed)[1] == "given":
        raise RequestError("min_speed", min_speed, "the decode-cost model has no term for evicted rows: give none "
                                                   "with the tokens axis")
    return None, "decode speed not considered: the decode-cost model has no term for evicted rows (tokens axis)"


def parse_keeps(value) -> tuple[float, ...]:
    """Keep fractions offered per layer (``"1.0,0.5"`` or a list): each 0 < f <= 1, 1.0 always among them."""
    items = value.split(",") if isinstance(value, str) else list(value or ())
    out = []
    for item in items:
        try:
            f = check_keep(float(item))
        except (TypeError, ValueError):
            raise RequestError("keeps", value, f"{item!r} is not a fraction 0 < f <= 1: give e.g. "
                                               "1.0,0.75,0.5,0.25") from None
        out.append(f)
    if not out:
        raise RequestError("keeps", value, "give at least one fraction, e.g. 1.0,0.5")
    return tuple(sorted(set(out) | {1.0}, reverse=True))


def _ranking(score: str, window: int, chunk: int) -> str:
    return f"{score}.w{window}" + (f".c{chunk}" if chunk > 1 else "")


def keep_key(layer: int, score: str, window: int, keep: float, chunk: int = 1) -> str:
    """A keep cell's key in the partial results file: ``L/keep/<score>.w<window>[.c<chunk>].<keep>``."""
    return f"{layer}/keep/{_ranking(score, window, chunk)}.{keep:g}"


def head_keep_key(layer: int, head: int, score: str, window: int, keep: float, chunk: int = 1) -> str:
    """A per-head keep cell's key in the partial results file: ``L.h/keep/<score>.w<window>[.c<chunk>].<keep>``."""
    return f"{layer}.{head}/keep/{_ranking(score, window, chunk)}.{keep:g}"


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    if not _active["registered"]:
        AttentionInterface.register(_ATTN, _attend_sdpa)
        AttentionMaskInterface.register(_ATTN, sdpa_mask)
        AttentionInterface.register(_ATTN_EAGER, _attend_eager)
        AttentionMaskInterface.register(_ATTN_EAGER, eager_mask)
        _active["registered"] = True


def _hook(module, query, key, attention_mask, kwargs):
    layer = getattr(module, "layer_idx", None)
    rec = _active["record"]
    if rec is not None:
        rec["q"][layer] = query[:, :, -rec["window"]:].detach().clone()
        s = kwargs.get("scaling")
        rec["scaling"][layer] = float(s if s is not None else query.shape[-1] ** -0.5)
    masks = _active["masks"]
    if masks and layer in masks:
        attention_mask = _mask(attention_mask, masks[layer], query, key)
    return attention_mask


def _mask(attention_mask, keep: torch.Tensor, query, key) -> torch.Tensor:
    """The call's mask with the evicted history rows of each KV head (``keep`` [B, H, P] False) masked out."""
    b, hq, c = query.shape[0], query.shape[1], query.shape[2]
    n = key.shape[2]
    p = keep.shape[2]
    rows = keep.to(query.device).repeat_interleave(hq // keep.shape[1], dim=1)
    full = torch.cat([rows, rows.new_ones(b, hq, n - p)], dim=-1)[:, :, None, :]  # [B, Hq, 1, n]
    if attention_mask is None:  # causal over the history + the call's rows
        attention_mask = (torch.arange(n, device=query.device)[None, :]
                          <= torch.arange(n - c, n, device=query.device)[:, None])[None, None]
    attention_mask = attention_mask[..., :n]
    if attention_mask.dtype == torch.bool:
        return attention_mask & full
    return attention_mask.masked_fill(~full, torch.finfo(attention_mask.dtype).min)


def _attend_sdpa(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, _hook(module, query, key, attention_mask, kwargs),
                                  **kwargs)


def _attend_eager(module, query, key, value, attention_mask, **kwargs):
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise RuntimeError(f"{type(module).__name__} has no eager_attention_forward to evict through")
    return eager(module, query, key, value, _hook(module, query, key, attention_mask, kwargs), **kwargs)


@contextlib.contextmanager
def _through(model, **state):
    """Within the block the model attends through this module's function (recording, masking)."""
    from tqbench.engine.scan.capture import _base_attention

    _register()
    previous, base = model.config._attn_implementation, _base_attention(model)  # (under the fused mode's switch)
    if base not in ("sdpa", "eager"):
        raise ValueError(f"the tokens axis measures through the sdpa or eager attention; this model runs "
                         f"{base!r}: load it with sdpa")
    model.set_attn_implementation(_ATTN_EAGER if base == "eager" else _ATTN)
    _active.update(state)
    try:
        yield
    finally:
        _active.update(record=None, masks=None)
        model.set_attn_implementation(previous)


class KeepCells:
    """Kept rows per (layer, keep) for a ``ChunkRunner``'s calibration prefill under a policy's eviction
    options (score, window, chunk) and protection (sink, recent); the chunk KL with layers evicting."""

    def __init__(self, runner, score: str = "snapkv", window: int = 32, chunk: int = 1) -> None:
        if score not in cell_scores():
            raise RequestError("score", score, f"a keep cell is measured at prefill: use one of "
                                               f"{', '.join(cell_scores())} (h2o accumulates decode-time attention; "
                                               "kvzip reads a context pass)")
        if any(w is not None for w in runner.windows):
            raise ValueError("the tokens axis evicts full-attention layers only, and this model has sliding-window "
                             "layers the chunk runner reads through their own stores: allocate with bits alone")
        self.runner, self.score, self.window, self.chunk = runner, score, window, chunk
        self.ranker = scores.get_score(score, chunk)  # the Evictor's ranking: the same object
        self._idx: dict[tuple, torch.Tensor] = {}
        rec = {"q": {}, "scaling": {}, "window": window}
        with _through(runner.model, record=rec), torch.inference_mode():
            runner.model(input_ids=runner.ids[:, :runner.prefill], use_cache=False)
        self.queries, self.scaling = rec["q"], rec["scaling"]
        if len(self.queries) != len(runner.keys):
            raise ValueError(f"recorded the queries of {len(self.queries)} of {len(runner.keys)} layers: this model's "
                             "attention does not report its layer index")

    def index(self, layer: int, keep, sink: int, recent: int) -> torch.Tensor:
        """Ordinals [B, H, n] of the prefill rows each KV head of ``layer`` keeps (sorted)."""
        key = (layer, keep, sink, recent)
        if key not in self._idx:
            p = self.runner.prefill
            k, v = self.runner.keys[layer], self.runner.values[layer]
            target = kept_rows(p, keep, sink, self.window, recent)
            head, tail = protected_rows(p, sink, self.window, recent)
            with torch.inference_mode():
                self._idx[key] = select_kept(self._score(layer, k, v), p, target, head, tail)
        return self._idx[key]

    def _score(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The ranking's scores [B, H, P] of the calibration prefill's rows of ``layer`` (its last ``window``
        queries are both the call's and the window: the prefill is one call)."""
        q, p = self.queries[layer], self.runner.prefill
        pos = torch.arange(p, device=k.device).view(1, 1, p).expand(k.shape[0], k.shape[1], p)
        return self.ranker(scores.ScoreInput(q, k, lambda: v, self.scaling[layer], p, pos, window=q))

    def mask(self, idx: torch.Tensor) -> torch.Tensor:
        keep = torch.zeros(*idx.shape[:2], self.runner.prefill, dtype=torch.bool, device=idx.device)
        return keep.scatter_(2, idx, True)

    def quantized(self, policy, spec: str, role: str, layer: int, head: int | None, idx: torch.Tensor):
        """The prefill's ``role`` rows of ``layer`` (KV head ``head`` alone, or all) with the kept rows as a store
        holding only them gives them back (the evicted rows as they were: masked out anyway)."""
        src = (self.runner.keys if role == "k" else self.runner.values)[layer]
        if head is not None:
            src, idx = src[:, head:head + 1], idx[:, head:head + 1]
        rows = _take(src, idx)
        q = quantized_rows(policy, spec, role, rows, layer, None if head is None else (head,))
        out = src.clone()
        out.scatter_(2, idx.view(*idx.shape, 1).expand_as(q), q)
        return out

    def kl(self, keys: list, values: list, masks: dict[int, torch.Tensor], start: int = 0) -> float:
        """``ChunkRunner.kl`` with the layers in ``masks`` (layer -> kept rows [B, H, P]) attending over those."""
        if not masks:
            return self.runner.kl(keys, values, start=start)
        with _through(self.runner.model, masks=masks):
            return self.runner.kl(keys, values, start=start)

    def cell(self, layer: int, keep, sink: int, recent: int) -> float:
        """The chunk KL of ``layer`` alone evicting to ``keep`` (its kept rows exact)."""
        idx = self.index(layer, keep, sink, recent)
        return self.kl(list(self.runner.keys), list(self.runner.values), {layer: self.mask(idx)}, start=layer)

    def head_mask(self, layer: int, keeps, sink: int, recent: int) -> torch.Tensor:
        """Kept rows [B, H, P] of ``layer`` with KV head ``h`` keeping ``keeps[h]`` (1.0: every row)."""
        k = self.runner.keys[layer]
        out = torch.ones(k.shape[0], len(keeps), self.runner.prefill, dtype=torch.bool, device=k.device)
        for h, f in enumerate(keeps):
            if evicts(f):
                out[:, h] = self.mask(self.index(layer, f, sink, recent))[:, h]
        return out

    def head_cell(self, layer: int, head: int, keep, sink: int, recent: int) -> float:
        """The chunk KL of KV head ``head`` of ``layer`` alone evicting to ``keep`` (the layer's other heads and
        every other layer keep all their rows; the kept rows exact): one chunk forward, as ``cell``."""
        keeps = [1.0] * self.runner.keys[layer].shape[1]
        keeps[head] = keep
        return self.kl(list(self.runner.keys), list(self.runner.values),
                       {layer: self.head_mask(layer, keeps, sink, recent)}, start=layer)


def layer_keeps(policy, geometry) -> dict[int, float | int]:
    """Layer -> keep for the layers of ``policy`` that evict."""
    plans = policy.plan(geometry.num_layers, list(geometry.layer_types) if geometry.layer_types else None)
    return {p.layer: p.keep for p in plans if p.evicts and evicts(p.keep)}


def with_keeps(base: Policy, keeps: dict[int, float]) -> Policy:
    """``base`` with ``keep@layers=f`` for every layer whose keep differs from ``base.keep`` (codec overrides
    kept; earlier keep overrides replaced)."""
    groups: dict[float, list[int]] = {}
    for layer, f in sorted(keeps.items()):
        if f != base.keep:
            groups.setdefault(f, []).append(layer)
    rest = tuple(o for o in base.overrides if o[0] != "keep")
    new = tuple(("keep", "+".join(map(str, layers)), f"{f:g}") for f, layers in sorted(groups.items()))
    return replace(base, overrides=new + rest)
