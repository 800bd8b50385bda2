"""The bytes an evicting layer holds beside its K/V rows, counted in its KV bytes (as a store's norms are): each
held row's token position per KV head (int32; scores read it to mask a key after a query, the kept-token map
reads it), and with a score that accumulates (``score=h2o``) the attention mass each held row received (float32). The window of past queries
that ``snapkv``/``expected`` keep with ``every`` is working memory of one layer (it does not grow with the
context) and is not counted, like attention's transient buffers."""

from __future__ import annotations

import torch

__all__ = ["MASS_DTYPE", "POSITION_DTYPE", "bookkeeping_bytes"]

POSITION_DTYPE = torch.int32
MASS_DTYPE = torch.float32


def _row_bytes(score: str) -> int:
    from tqbench.engine.cache.evict.scores import score_class

    n = torch.empty((), dtype=POSITION_DTYPE).element_size()
    if score_class(score).accumulates:  # (h2o's mass)
        n += torch.empty((), dtype=MASS_DTYPE).element_size()
    return n


def bookkeeping_bytes(score: str, batch: int, heads: int, held: int) -> int:
    """Bytes of the positions (and h2o's mass) of ``held`` rows per KV head of one layer."""
    return batch * heads * held * _row_bytes(score)
