"""How much a greedy comparison saw, and whether that is enough to call a policy safe.

One rule: a sample is **enough** when it compared at least ``MIN_TOKENS`` generated tokens in all and at least
``MIN_TOKENS_PER_PROMPT`` on every prompt (one prompt of 64 tokens is enough; 1 prompt x 12 tokens, or four
prompts of 16, is not). Below that an exact match says little (a 12-token greedy run of a 2-bit cache can
match by luck), so validate and compare-policies attach ``Evidence.caveat`` and never give an unqualified
"safe". The teacher-forced measurement (``quality.py``) scores every position and is the stronger check.

Messages here name no front-end flag: each front end says how to get more evidence in its own terms.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["MIN_TOKENS", "MIN_TOKENS_PER_PROMPT", "Evidence", "evidence"]

MIN_TOKENS = 64
MIN_TOKENS_PER_PROMPT = 32


@dataclass(frozen=True)
class Evidence:
    """The sample behind a verdict: prompts and generated tokens compared per prompt."""

    prompts: int
    tokens_per_prompt: tuple[int, ...]
    min_tokens: int = MIN_TOKENS
    min_tokens_per_prompt: int = MIN_TOKENS_PER_PROMPT

    @property
    def tokens(self) -> int:
        return sum(self.tokens_per_prompt)

    @property
    def enough(self) -> bool:
        """The rule (module docstring)."""
        return (self.prompts > 0 and self.tokens >= self.min_tokens
                and min(self.tokens_per_prompt) >= self.min_tokens_per_prompt)

    @property
    def summary(self) -> str:
        """``1 prompt x 12 tokens`` / ``3 prompts x 40-48 tokens``."""
        lo, hi = (min(self.tokens_per_prompt), max(self.tokens_per_prompt)) if self.tokens_per_prompt else (0, 0)
        span = f"{lo}" if lo == hi else f"{lo}-{hi}"
        return f"{self.prompts} prompt{'s' if self.prompts != 1 else ''} x {span} tokens"

    @property
    def caveat(self) -> str | None:
        """None when the sample is enough; else what it was and what it would take."""
        if self.enough:
            return None
        return (f"evidence: {self.summary}; too little to call it safe (needs {self.min_tokens} generated tokens "
                f"in all, {self.min_tokens_per_prompt} per prompt): measure teacher-forced quality, or compare on "
                "more prompts and tokens")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tokens_per_prompt"] = list(self.tokens_per_prompt)
        d.update(tokens=self.tokens, enough=self.enough, caveat=self.caveat)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Evidence:
        return cls(d["prompts"], tuple(d["tokens_per_prompt"]), d.get("min_tokens", MIN_TOKENS),
                   d.get("min_tokens_per_prompt", MIN_TOKENS_PER_PROMPT))


def evidence(tokens_per_prompt: list[int]) -> Evidence:
    """The ``Evidence`` of a comparison that generated ``tokens_per_prompt[i]`` tokens on prompt i."""
    return Evidence(len(tokens_per_prompt), tuple(int(n) for n in tokens_per_prompt))
