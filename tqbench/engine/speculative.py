"""Prompt-lookup decoding in the engine's own loop (``Engine.stream(prompt_lookup=N)``).

The compressed cache's side of speculation (exact ``crop``, per-query precision of a verification call) is in
``cache/``; this module only drafts, verifies and feeds the accepted tokens' logits to a ``generate.Sequence``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

__all__ = ["PromptLookup", "SpeculationStats"]


@dataclass
class SpeculationStats:
    """What prompt-lookup decoding did: draft tokens proposed, drafts accepted, verification forward calls."""

    drafted: int = 0
    accepted: int = 0
    verify_calls: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


class PromptLookup:
    """Prompt-lookup decoding over a ``generate.Sequence`` (``seq``; ``forward(model, ids, cache)`` its forward call): transformers' n-gram drafter (``PromptLookupCandidateGenerator``)
    proposes up to ``n`` tokens that followed the last tokens earlier in the text; one forward call verifies
    them; the logits of every accepted draft are fed to the sequence without another call; a rejected draft's
    rows are cropped from the cache. Greedy decoding only (the tokens are exactly greedy decoding's)."""

    def __init__(self, n: int, seq, eos_ids: set[int] | None, forward: Callable) -> None:
        from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

        if n < 0:
            raise ValueError(f"prompt_lookup={n} is invalid: give the most draft tokens per step (0: off)")
        if not seq.sampling.greedy:
            raise ValueError("prompt_lookup needs greedy decoding (temperature 0): sampled tokens are not verified "
                             "against drafts here")
        eos = torch.tensor(sorted(eos_ids)) if eos_ids else None
        self.drafter = PromptLookupCandidateGenerator(eos_token_id=eos, num_output_tokens=n, max_length=1 << 30)
        self.seq, self.forward = seq, forward
        self.text = seq.ids.cpu()  # prompt + tokens fed so far
        self.queue: list[tuple[int, torch.Tensor]] = []  # (draft token, the logits after it) verified, unused
        self.stats = SpeculationStats()

    def step(self, cache) -> list:
        events = self.seq.step()
        if self.seq.done:  # the cache holds what greedy decoding's would: the prompt and every token but the last
            extra = cache.get_seq_length() - (self.seq.result.input_tokens + self.seq.result.output_tokens - 1)
            if extra > 0:
                cache.crop(-extra)
                if self.seq.report is not None:  # the report of the cache as greedy decoding leaves it
                    self.seq.result.cache_report = self.seq.report()
            self.queue = []
            self.seq.result.speculation = self.stats
        return events

    def feed(self, model, cache) -> None:
        tok = self.seq.next_token
        self.text = torch.cat([self.text, torch.tensor([[tok]])], 1)
        if self.queue:
            draft, logits = self.queue.pop(0)
            if draft == tok:  # verified by the last call: its logits are this token's
                self.stats.accepted += 1
                self.seq.feed(logits, 0.0)
                return
            cache.crop(-(len(self.queue) + 1))
            self.queue = []
        left = self.seq.max_new_tokens - self.seq.result.output_tokens - 1
        cand, _ = self.drafter.get_candidates(self.text)
        drafts = cand[0, self.text.shape[1]:][: max(0, left)].tolist()
        t0 = time.perf_counter()
        logits = self.forward(model, torch.tensor([[tok, *drafts]], device=self.seq.device), cache).logits[0]
        self.stats.drafted += len(drafts)
        self.stats.verify_calls += 1
        self.queue = list(zip(drafts, logits[1:]))
        self.seq.feed(logits[0], time.perf_counter() - t0)
