"""Needle in a haystack: hide a random passphrase in filler text, ask for it, score recall per policy.

The haystack is built from the shipped corpus texts (``tqbench/data/corpus``), sentence by sentence, up to
``length`` tokens; the needle sentence ("The secret passphrase is amber-falcon-4721.") goes in after the
sentence nearest ``depth`` (0 = start, 1 = end). The question follows the haystack. A cell is recalled
when the generated answer contains the passphrase (case-insensitive); ``score`` gives partial credit per
passphrase part. The baseline runs every cell too: what matters is candidate vs baseline on the same cells.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from tqbench.constants import CORPUS_DIR
from tqbench.engine.events import (
    CancelFlag,
    GenerationFinished,
    NiahCell,
    OnEvent,
    Progress,
    emit,
    raise_if_cancelled,
)
from tqbench.engine.policy.checked import CheckedPolicy
from tqbench.engine.policy.spec import Policy
from tqbench.engine.request import RequestError, check_max_new_tokens

WORDS = ("amber", "falcon", "copper", "meadow", "violet", "harbor", "lantern", "cobalt", "juniper", "marble",
         "orchid", "saffron", "thistle", "walnut", "zephyr", "granite", "indigo", "kestrel", "larch", "quartz")
QUESTION = "What is the secret passphrase mentioned in the text above? Answer with the passphrase only."


def make_passphrase(seed: int) -> str:
    rng = random.Random(seed)
    return f"{rng.choice(WORDS)}-{rng.choice(WORDS)}-{rng.randint(1000, 9999)}"


def _sentences() -> list[str]:
    text = " ".join(p.read_text(encoding="utf-8") for p in sorted(CORPUS_DIR.glob("*.txt")))
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if s.strip()]


def build_haystack(tokenizer, length: int, depth: float, passphrase: str) -> tuple[str, int]:
    """(text, needle sentence index) of about ``length`` tokens of filler with the needle at ``depth``."""
    text, (at,) = build_haystack_needles(tokenizer, length, [(depth, f"The secret passphrase is {passphrase}.")])
    return text, at


def build_haystack_needles(tokenizer, length: int, needles: list[tuple[float, str]],
                           pool: list[str] | None = None) -> tuple[str, list[int]]:
    """(text, sentence index of each needle) of about ``length`` tokens of filler sentences (``pool``, default the
    shipped corpus, cycled) with each needle sentence inserted at its depth (0 = start, 1 = end), in order."""
    if length < 16:
        raise ValueError(f"haystack length {length} is too short: use at least 16 tokens")
    for depth, _ in needles:
        if not 0 <= depth <= 1:
            raise ValueError(f"depth {depth} is invalid: use a fraction between 0 and 1")
    pool = pool or _sentences()
    chosen, n, i = [], 0, 0
    while n < length:
        s = pool[i % len(pool)]
        n += len(tokenizer(" " + s, add_special_tokens=False)["input_ids"])
        chosen.append(s)
        i += 1
    slots = [round(depth * len(chosen)) for depth, _ in needles]
    order = sorted(range(len(needles)), key=lambda k: (slots[k], k))
    for k in reversed(order):  # from the end, so earlier slots stay where they were counted
        chosen.insert(slots[k], needles[k][1])
    at = [0] * len(needles)
    for rank, k in enumerate(order):
        at[k] = slots[k] + rank
    return " ".join(chosen), at


def score_answer(answer: str, passphrase: str) -> tuple[bool, float]:
    a = answer.lower()
    parts = passphrase.lower().split("-")
    return passphrase.lower() in a, sum(p in a for p in parts) / len(parts)


@dataclass
class NiahResult:
    model: str
    baseline: str
    policies: list[str]
    lengths: list[int]
    depths: list[float]
    cache_mode: str
    cells: list[dict] = field(default_factory=list)

    def recall(self, policy: str) -> list[list[bool]]:
        """[length][depth] recall matrix of one policy (or the baseline)."""
        grid = {(c["length"], c["depth"]): c["recalled"] for c in self.cells if c["policy"] == policy}
        return [[grid.get((n, d), False) for d in self.depths] for n in self.lengths]

    def summary(self) -> list[dict]:
        base = {(c["length"], c["depth"]): c["recalled"] for c in self.cells if c["policy"] == self.baseline}
        rows = []
        for pol in [self.baseline, *self.policies]:
            cells = [c for c in self.cells if c["policy"] == pol]
            n = len(cells) or 1
            agree = sum(c["recalled"] == base.get((c["length"], c["depth"])) for c in cells)
            rows.append({"policy": pol, "recall": sum(c["recalled"] for c in cells) / n,
                         "mean_score": sum(c["score"] for c in cells) / n, "agreement_with_baseline": agree / n})
        return rows

    def to_dict(self) -> dict:
        return {
            "model": self.model, "baseline": self.baseline, "policies": self.policies, "lengths": self.lengths,
            "depths": self.depths, "cache_mode": self.cache_mode, "cells": self.cells,
            "recall": {p: self.recall(p) for p in [self.baseline, *self.policies]}, "summary": self.summary(),
        }


def _prompts(engine, lengths, depths, chat: bool, max_new_tokens: int, max_context: int | None,
             seed: int) -> dict:
    """(length, depth) -> (prompt ids, passphrase); refuses a cell whose prompt + answer exceed the limit."""
    limit = min(x for x in (max_context, engine.max_context) if x) if (max_context or engine.max_context) else None
    prompts = {}
    for n in lengths:
        for d in depths:
            phrase = make_passphrase(seed * 1000003 + n * 101 + round(d * 1000))
            hay, _ = build_haystack(engine.tokenizer, n, d, phrase)
            ids = engine.encode_prompt(f"{hay}\n\n{QUESTION}", chat, max_new_tokens)
            if limit and ids.shape[1] + max_new_tokens > limit:
                raise ValueError(f"length {n} needs {ids.shape[1]} prompt tokens + {max_new_tokens} new, over the "
                                 f"{limit}-token limit: use shorter lengths or a larger max_context")
            prompts[(n, d)] = (ids, phrase)
    return prompts


def _answer(engine, ids, pol: CheckedPolicy, cache_mode: str, max_new_tokens: int, cancel: CancelFlag | None) -> str:
    res = None
    for ev in engine.stream(ids, pol, cache_mode, max_new_tokens=max_new_tokens, cancel=cancel):
        if isinstance(ev, GenerationFinished):
            res = ev.result
    raise_if_cancelled(cancel, "niah")  # a cut-off answer is not scored
    return res.text


def needle_in_haystack(
    engine,
    policies: list[Policy | str],
    lengths: list[int],
    depths: list[float],
    *,
    baseline: Policy | str = "fp16",
    cache_mode: str = "compressed",
    chat: bool = True,
    max_new_tokens: int = 24,
    max_context: int | None = None,
    seed: int = 0,
    on_event: OnEvent | None = None,
    cancel: CancelFlag | None = None,
) -> NiahResult:
    """Recall of the baseline and each policy on every (length, depth) cell; ``NiahCell`` per cell.
    Raises ``Cancelled`` when ``cancel()`` turns true."""
    check_max_new_tokens(max_new_tokens)
    for what, values in (("lengths", lengths), ("depths", depths)):
        if not values:
            raise RequestError(what, list(values), "give at least one")
    base_pol = engine.check_policy(baseline)  # checked once: every cell's cache takes it as it is
    pols = [engine.check_policy(p) for p in policies]
    prompts = _prompts(engine, lengths, depths, chat, max_new_tokens, max_context, seed)
    result = NiahResult(engine.name, base_pol.label, [p.label for p in pols], list(lengths), list(depths), cache_mode)
    total = len(prompts) * (1 + len(pols))
    done = 0
    for pol in [base_pol, *pols]:
        for (n, d), (ids, phrase) in prompts.items():
            raise_if_cancelled(cancel, "niah")
            emit(on_event, Progress("niah", done, total, f"{pol.label}: {n} tokens, depth {d:g}"))
            answer = _answer(engine, ids, pol, cache_mode, max_new_tokens, cancel)
            recalled, score = score_answer(answer, phrase)
            result.cells.append({"policy": pol.label, "length": n, "depth": d, "prompt_tokens": int(ids.shape[1]),
                                 "passphrase": phrase, "answer": answer, "recalled": recalled, "score": score})
            done += 1
            emit(on_event, NiahCell(pol.label, n, d, recalled, answer))
    emit(on_event, Progress("niah", done, total, "done"))
    return result
