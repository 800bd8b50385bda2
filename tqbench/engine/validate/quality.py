"""Teacher-forced quality: feed the same tokens through a baseline and a candidate cache, compare logits.

Prefill ``prefill`` tokens of a text (exact attention, then the cache quantizes them), then feed the
following tokens one at a time through the cache. After each step compare the candidate's next-token
distribution with the baseline's (a plain ``DynamicCache``): KL(baseline || candidate), top-1 agreement,
and the perplexity of the real next token under each. One early flip cannot cascade, as both runs see
the same tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tqbench.constants import CORPUS_DIR
from tqbench.engine.events import Progress


def corpus_ids(tokenizer, name: str, n: int) -> torch.Tensor:
    """The first ``n`` token ids ``[1, n]`` of a shipped corpus text (``tqbench/data/corpus/<name>.txt``)."""
    path = CORPUS_DIR / f"{name}.txt"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in CORPUS_DIR.glob("*.txt")))
        raise ValueError(f"unknown corpus text {name!r}: shipped texts are {names}")
    ids = tokenizer(path.read_text(encoding="utf-8"), return_tensors="pt")["input_ids"]
    if ids.shape[1] < n:
        raise ValueError(f"{name}.txt has {ids.shape[1]} tokens, fewer than the {n} needed")
    return ids[:, :n]


@dataclass(frozen=True)
class TeacherForcedResult:
    kv_policy: str
    cache_mode: str
    prefill_tokens: int
    steps: int
    kl_mean: float
    kl_max: float
    top1_agreement: float
    ppl_baseline: float
    ppl_candidate: float
    bits_per_element: float
    memory_saved_pct: float
    compressed_storage_bytes: int
    dense_fp16_bytes: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _run(model, ids: torch.Tensor, prefill: int, cache, on_step: Callable[[int], None] | None) -> list[torch.Tensor]:
    """Log-softmax rows predicting tokens prefill+1 .. len-1 (one per single-token step)."""
    out = []
    device = next(model.parameters()).device
    ids = ids.to(device)
    with torch.inference_mode():
        model(input_ids=ids[:, :prefill], cache=cache, use_cache=True)
        for t in range(prefill, ids.shape[1] - 1):
            logits = model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True).logits[0, -1]
            out.append(torch.log_softmax(logits.float(), -1).cpu())
            if on_step is not None:
                on_step(t - prefill)
    return out


def baseline_logprobs(engine, ids: torch.Tensor, prefill: int, on_event=None) -> list[torch.Tensor]:
    steps = ids.shape[1] - 1 - prefill
    cb = (lambda i: on_event(Progress("baseline", i + 1, steps))) if on_event else None
    return _run(engine.model, ids, prefill, engine.make_cache(None), cb)


def teacher_forced(
    engine,
    ids: torch.Tensor,
    prefill: int,
    policy,
    cache_mode: str = "simulate",
    baseline: list[torch.Tensor] | None = None,
    on_event: Callable[[object], None] | None = None,
) -> TeacherForcedResult:
    """Compare ``policy`` against a dense baseline on ``ids`` ([1, N]): N-1-prefill single-token steps."""
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"ids must be shaped [1, tokens], got {tuple(ids.shape)}")
    if not 0 < prefill < ids.shape[1] - 1:
        raise ValueError(f"prefill={prefill} must leave at least one step in {ids.shape[1]} tokens")
    if baseline is None:
        baseline = baseline_logprobs(engine, ids, prefill, on_event)
    steps = len(baseline)
    cache = engine.make_cache(policy, cache_mode)
    cb = (lambda i: on_event(Progress("candidate", i + 1, steps))) if on_event else None
    cand = _run(engine.model, ids, prefill, cache, cb)
    targets = ids[0, prefill + 1 :].cpu()
    kls, agree, nll_b, nll_c = [], 0, 0.0, 0.0
    for i, (lp, lq) in enumerate(zip(baseline, cand)):
        kls.append(float(torch.sum(lp.exp() * (lp - lq))))
        agree += int(torch.argmax(lp) == torch.argmax(lq))
        nll_b -= float(lp[targets[i]])
        nll_c -= float(lq[targets[i]])
    rep = cache.report()
    return TeacherForcedResult(
        kv_policy=rep.kv_policy,
        cache_mode=cache_mode,
        prefill_tokens=prefill,
        steps=steps,
        kl_mean=sum(kls) / steps,
        kl_max=max(kls),
        top1_agreement=agree / steps,
        ppl_baseline=math.exp(nll_b / steps),
        ppl_candidate=math.exp(nll_c / steps),
        bits_per_element=rep.bits_per_element,
        memory_saved_pct=rep.memory_saved_pct,
        compressed_storage_bytes=rep.compressed_storage_bytes,
        dense_fp16_bytes=rep.dense_fp16_bytes,
    )
