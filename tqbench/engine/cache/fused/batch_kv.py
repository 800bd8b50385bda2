"""``FusedBatch``: what one attention layer of a batched fused decode step hands the attention function.

Each sequence of the batch keeps its own packed store; the batch's layer (``engine.batch``) passes every
sequence's own ``FusedKV`` handle, in batch order, and ``fused_attention_forward`` answers each from its own
store, its own length and its own row of the call's mask: no codes are padded to the longest sequence and
no dense history is built. On the native CPU kernel one ragged kernel call per layer covers every sequence
(``install.fused_batch_attention``); on other implementations each sequence runs its own fused call inside
the one forward call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class FusedBatch:
    members: list  # FusedKV per sequence, in batch order
    width: int  # the longest stored history in the batch (the mask's columns are width + new rows)

    @property
    def shape(self) -> torch.Size:
        b, h, t, d = self.members[0].new_k.shape
        return torch.Size((len(self.members), h, self.width + t, d))
