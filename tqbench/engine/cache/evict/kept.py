"""``kept_positions``: which token positions each KV head of each evicting layer still holds, read from a cache.

What the workbench draws as "which tokens each head kept" and what a test can check: the positions come from
each layer's ``Evictor.positions`` (the token position of every held row, kept in step with the stores by every
eviction), so they are the rows attention reads, not a recomputation of the scores.
"""

from __future__ import annotations

from dataclasses import dataclass

from tqbench.engine.cache.evict.ragged import PAD_POSITION


@dataclass(frozen=True)
class LayerKept:
    """One evicting layer: the sorted positions each KV head holds, and the rows each head dropped."""

    layer: int
    heads: tuple[tuple[int, ...], ...]  # [kv head] -> sorted token positions held
    evicted_prefill: int
    evicted_decode: int
    demote: str = ""  # the codec this layer's rows not kept were demoted to (its plan's), "" when dropped


@dataclass(frozen=True)
class KeptPositions:
    """The kept rows of a cache's evicting layers after ``seen`` tokens (positions ``0 .. seen-1``), of which
    the first ``prompt_tokens`` came in prefill calls. ``policy``: the cache policy's compact form; ``demote``:
    the codec the rows not kept were demoted to (``policy.demote``), "" when they were dropped."""

    policy: str
    seen: int
    prompt_tokens: int
    layers: tuple[LayerKept, ...]
    demote: str = ""

    def layer(self, layer: int) -> LayerKept:
        for la in self.layers:
            if la.layer == layer:
                return la
        raise KeyError(f"layer {layer} does not evict: evicting layers are {[la.layer for la in self.layers]}")

    def mask(self, layer: int, head: int) -> list[bool]:
        """``seen`` booleans: True where ``head`` of ``layer`` holds the token at that position."""
        out = [False] * self.seen
        for p in self.layer(layer).heads[head]:
            out[p] = True
        return out

    def to_dict(self) -> dict:
        return {"kv_policy": self.policy, "seen": self.seen, "prompt_tokens": self.prompt_tokens, "demote": self.demote,
                "layers": [{"layer": la.layer, "kept": [list(h) for h in la.heads],
                            "evicted_prefill": la.evicted_prefill, "evicted_decode": la.evicted_decode,
                            "demote": la.demote}
                           for la in self.layers]}


def kept_positions(cache, batch: int = 0) -> KeptPositions | None:
    """The kept positions of sequence ``batch`` in ``cache`` (a ``TQCache``); None when no layer evicts."""
    layers, seen, prompt = [], 0, 0
    for plan, layer in zip(cache.plans, cache.layers):
        ev = getattr(layer, "evictor", None)  # a TQLayer's; dense or sliding pass-through layers have none
        if ev is None:
            continue
        seen = max(seen, layer.cumulative_length)
        prompt = max(prompt, ev.prefill_end)
        pos = ev.held_positions()  # [B, H, held] (heads=ada: each head's own rows, padded)
        heads = () if pos is None else tuple(tuple(sorted(int(p) for p in row if p != PAD_POSITION))
                                             for row in pos[batch].tolist())
        layers.append(LayerKept(plan.layer, heads, ev.evicted_prefill, ev.evicted_decode, plan.demote))
    if not layers:
        return None
    return KeptPositions(cache.policy.to_string(), seen, prompt, tuple(layers), cache.policy.demote)
