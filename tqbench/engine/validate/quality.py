"""Teacher-forced quality: feed the same tokens through a baseline and a candidate cache, compare logits.

Prefill ``prefill`` tokens of a text (exact attention, then the cache quantizes them), then feed the
following tokens one at a time through the cache. After each step compare the candidate's next-token
distribution with the baseline's (a plain ``DynamicCache``): KL(baseline || candidate), top-1 agreement,
and the perplexity of the real next token under each (``metrics.teacher_forced_stats``). One early flip
cannot cascade, as both runs see the same tokens.

``teacher_forced_quality`` takes its tokens from a shipped corpus text or from a prompt plus the baseline's
own greedy continuation. Each run emits one ``TeacherForcedStep`` per fed token and checks ``cancel`` before
each: a cancelled run raises ``Cancelled``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tqbench.constants import CORPUS_DIR, auto_prefill_chunk
from tqbench.engine.cache.report import bits_vs_fp16
from tqbench.engine.events import CancelFlag, OnEvent, TeacherForcedStep, emit, raise_if_cancelled
from tqbench.engine.generate import prefill as prefill_ids
from tqbench.engine.metrics import teacher_forced_stats
from tqbench.engine.policy.files import parse_policy
from tqbench.engine.policy.spec import Policy
from tqbench.engine.request import RequestError
from tqbench.engine.validate.steps import check_generation_args

JOB = "teacher-forced quality"


def corpus_path(name: str) -> Path:
    """A shipped corpus text's file (``tqbench/data/corpus/<name>.txt``); ValueError naming the shipped ones."""
    path = CORPUS_DIR / f"{name}.txt"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in CORPUS_DIR.glob("*.txt")))
        raise ValueError(f"unknown corpus text {name!r}: shipped texts are {names}")
    return path


def check_teacher_forced_args(corpus: str | None, context_tokens: int, eval_tokens: int) -> None:
    """What ``teacher_forced_quality`` checks before any work (front ends call it before a model loads): a shipped
    corpus name, and at least 1 prefill and 1 scored token (``RequestError`` naming ``context_tokens`` or
    ``eval_tokens``, which a front end may spell as its own field)."""
    if corpus is not None:
        corpus_path(corpus)
    for name, value in (("context_tokens", context_tokens), ("eval_tokens", eval_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RequestError(name, value, "give at least 1 token")


def corpus_ids(tokenizer, name: str, n: int) -> torch.Tensor:
    """The first ``n`` token ids ``[1, n]`` of a shipped corpus text (``tqbench/data/corpus/<name>.txt``)."""
    path = corpus_path(name)
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


@dataclass
class TeacherForcedReport:
    model: str
    source: str  # "corpus:<name>" or "prompt+baseline-continuation"
    cache_mode: str
    prefill_tokens: int
    steps: int
    results: list = field(default_factory=list)  # TeacherForcedResult, one per candidate

    def to_dict(self) -> dict:
        return {
            "model": self.model, "source": self.source, "cache_mode": self.cache_mode,
            "prefill_tokens": self.prefill_tokens, "steps": self.steps,
            "baseline": "dense DynamicCache (fp16-equivalent, exact K/V)",
            "results": [r.to_dict() for r in self.results],
        }


def _run(model, ids: torch.Tensor, prefill: int, cache, run: str, kv_policy: str, on_event: OnEvent | None,
         cancel: CancelFlag | None, chunk: int = 0, after_prefill=None) -> torch.Tensor:
    """Log-softmax rows ``[batch, steps, vocab]`` (float32, on the CPU) predicting tokens prefill+1 .. len-1 of every
    sequence of ``ids`` ([batch, N], equal lengths), one single-token step each through ``cache``; the prefill in
    forward calls of ``chunk`` tokens (0: one call; ``generate.prefill``). ``after_prefill(cache)`` runs between the
    prefill and the first step."""
    out = []
    steps = ids.shape[1] - 1 - prefill
    device = next(model.parameters()).device
    ids = ids.to(device)
    raise_if_cancelled(cancel, JOB)
    with torch.inference_mode():
        if ids.shape[0] == 1:
            prefill_ids(model, ids[:, :prefill], cache, chunk=chunk)
        else:  # generate.prefill reads one sequence; a batch of equal lengths prefills the same way
            step = chunk if chunk > 0 else prefill
            for a in range(0, prefill, step):
                model(input_ids=ids[:, a : min(a + step, prefill)], cache=cache, use_cache=True)
        if after_prefill is not None:
            after_prefill(cache)
        for t in range(prefill, ids.shape[1] - 1):
            raise_if_cancelled(cancel, JOB)
            logits = model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True).logits[:, -1]
            out.append(torch.log_softmax(logits.float(), -1).cpu())
            emit(on_event, TeacherForcedStep(run, t - prefill + 1, steps, kv_policy=kv_policy))
    return torch.stack(out, 1)


def _keeps_logits(model) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def dense_logprobs(engine, ids: torch.Tensor, prefill: int, on_event: OnEvent | None = None, *,
                   cancel: CancelFlag | None = None) -> torch.Tensor:
    """The dense baseline's log-softmax rows ``[batch, steps, vocab]`` for ``ids`` ([batch, N]) after ``prefill``
    tokens: ONE causal forward over ``ids[:, :-1]`` (exact attention over every earlier token: the same math as a
    prefill then single-token steps through a ``DynamicCache``, up to float summation order), the vocabulary
    projection on the last ``steps`` positions only. One ``TeacherForcedStep`` per fed token afterwards (``cancel``
    checked before each), as a stepped run gives."""
    if ids.dim() != 2:
        raise ValueError(f"ids must be shaped [sequences, tokens], got {tuple(ids.shape)}")
    steps = ids.shape[1] - 1 - prefill
    if prefill < 1 or steps < 1:
        raise ValueError(f"prefill={prefill} must leave at least one step in {ids.shape[1]} tokens")
    model = engine.model
    device = next(model.parameters()).device
    raise_if_cancelled(cancel, JOB)
    with torch.inference_mode():
        x = ids[:, :-1].to(device)
        if _keeps_logits(model):
            logits = model(input_ids=x, use_cache=False, logits_to_keep=steps).logits[:, -steps:]
        else:
            logits = model(input_ids=x, use_cache=False).logits[:, prefill:]
        lp = torch.log_softmax(logits.float(), -1).cpu()
    for i in range(steps):
        raise_if_cancelled(cancel, JOB)
        emit(on_event, TeacherForcedStep("baseline", i + 1, steps, kv_policy="dynamic-cache"))
    return lp


def baseline_logprobs(engine, ids: torch.Tensor, prefill: int, on_event: OnEvent | None = None, *,
                      cancel: CancelFlag | None = None) -> list[torch.Tensor]:
    """The dense baseline's log-softmax rows for ``ids`` ([1, N]) after ``prefill`` tokens (one per fed token;
    ``dense_logprobs``)."""
    return list(dense_logprobs(engine, ids, prefill, on_event, cancel=cancel)[0])


def teacher_forced_batch(
    engine,
    ids: torch.Tensor,
    prefill: int,
    policy,
    cache_mode: str = "simulate",
    baseline: torch.Tensor | list | None = None,
    on_event: OnEvent | None = None,
    cancel: CancelFlag | None = None,
    prefill_chunk: int | None = None,
    after_prefill=None,
) -> list[TeacherForcedResult]:
    """``teacher_forced`` for every sequence of ``ids`` ([batch, N], equal lengths) in ONE cache of that batch (one
    single-token step feeds every sequence): one result per sequence, equal to running each alone (a cache treats
    the sequences of a batch independently; ``tests/unit/test_allocate_verify_batch.py``). ``baseline``:
    ``dense_logprobs`` of the same ids (a list of rows when the batch is one sequence). A result's byte fields are
    one sequence's: the layers' bytes split evenly (equal lengths store equal bytes) plus the shared objects once.
    ``after_prefill(cache)``: see ``_run``."""
    if ids.dim() != 2:
        raise ValueError(f"ids must be shaped [sequences, tokens], got {tuple(ids.shape)}")
    if not 0 < prefill < ids.shape[1] - 1:
        raise ValueError(f"prefill={prefill} must leave at least one step in {ids.shape[1]} tokens")
    if baseline is None:
        baseline = dense_logprobs(engine, ids, prefill, on_event, cancel=cancel)
    elif isinstance(baseline, list):
        baseline = torch.stack(baseline)[None]
    cache = engine.make_cache(policy, cache_mode)
    chunk = auto_prefill_chunk(prefill, cache_mode, prefill_chunk)
    cand = _run(engine.model, ids, prefill, cache, "candidate", parse_policy(policy).label, on_event, cancel, chunk,
                after_prefill)
    rep = per_sequence(cache.report(), ids.shape[0])
    out = []
    for b in range(ids.shape[0]):
        stats = teacher_forced_stats(list(baseline[b]), list(cand[b]), ids[b, prefill + 1 :].cpu())
        out.append(TeacherForcedResult(
            kv_policy=rep["kv_policy"],
            cache_mode=cache_mode,
            prefill_tokens=prefill,
            steps=stats.steps,
            kl_mean=stats.kl_mean,
            kl_max=stats.kl_max,
            top1_agreement=stats.top1_agreement,
            ppl_baseline=stats.ppl_baseline,
            ppl_candidate=stats.ppl_candidate,
            bits_per_element=rep["bits_per_element"],
            memory_saved_pct=rep["memory_saved_pct"],
            compressed_storage_bytes=rep["compressed_storage_bytes"],
            dense_fp16_bytes=rep["dense_fp16_bytes"],
        ))
    return out


def per_sequence(rep, batch: int) -> dict:
    """One sequence's share of a ``CacheReport`` of ``batch`` equal-length sequences: the layers' bytes / batch,
    the shared objects (rotations, codebooks, calibrated bases) once; bits and saving recomputed from those."""
    if batch == 1:
        return {"kv_policy": rep.kv_policy, "bits_per_element": rep.bits_per_element,
                "memory_saved_pct": rep.memory_saved_pct, "compressed_storage_bytes": rep.compressed_storage_bytes,
                "dense_fp16_bytes": rep.dense_fp16_bytes}
    shared = rep.shared_bytes
    layers = rep.compressed_storage_bytes - shared
    if layers % batch or rep.dense_fp16_bytes % batch:
        raise ValueError(f"a cache of {batch} sequences stored {layers} layer bytes: not an equal share each")
    storage, dense = layers // batch + shared, rep.dense_fp16_bytes // batch
    return {"kv_policy": rep.kv_policy, "bits_per_element": round(bits_vs_fp16(storage, dense), 4),
            "memory_saved_pct": round(100.0 * (1 - storage / dense), 2) if dense else 0.0,
            "compressed_storage_bytes": storage, "dense_fp16_bytes": dense}


def teacher_forced(
    engine,
    ids: torch.Tensor,
    prefill: int,
    policy,
    cache_mode: str = "simulate",
    baseline: list[torch.Tensor] | None = None,
    on_event: OnEvent | None = None,
    cancel: CancelFlag | None = None,
    prefill_chunk: int | None = None,
) -> TeacherForcedResult:
    """Compare ``policy`` against a dense baseline on ``ids`` ([1, N]): N-1-prefill single-token steps; the
    candidate's prefill in calls of ``prefill_chunk`` tokens (None: by length, ``constants.auto_prefill_chunk``;
    the baseline is one forward over exact K/V, ``dense_logprobs``). ``teacher_forced_batch`` with one sequence."""
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"ids must be shaped [1, tokens], got {tuple(ids.shape)}")
    (r,) = teacher_forced_batch(engine, ids, prefill, policy, cache_mode, baseline, on_event, cancel, prefill_chunk)
    return r


def _tokens(engine, prompt, corpus, context_tokens, eval_tokens, chat, max_new_tokens,
            cancel: CancelFlag | None) -> tuple[torch.Tensor, int, str]:
    """(ids [1, N], prefill, source) from a corpus text, or from the prompt plus the baseline's continuation."""
    if corpus is not None:
        return corpus_ids(engine.tokenizer, corpus, context_tokens + eval_tokens + 1), context_tokens, \
            f"corpus:{corpus}"
    if prompt is None:
        raise ValueError("teacher-forced quality needs a prompt or a corpus name")
    check_generation_args(max_new_tokens)
    ids = engine.encode_prompt(prompt, chat, max_new_tokens)
    cont = engine.generate(ids, None, max_new_tokens=max_new_tokens + 1, stop_at_eos=False, cancel=cancel).token_ids
    raise_if_cancelled(cancel, JOB)
    ids = torch.cat([ids, torch.tensor([cont], dtype=ids.dtype)], dim=1)
    return ids, int(ids.shape[1]) - len(cont), "prompt+baseline-continuation"


def teacher_forced_quality(
    engine,
    candidates: list[Policy | str] | Policy | str,
    *,
    prompt=None,
    corpus: str | None = None,
    context_tokens: int = 256,
    eval_tokens: int = 128,
    cache_mode: str = "compressed",
    chat: bool = True,
    max_new_tokens: int = 64,
    on_event: OnEvent | None = None,
    cancel: CancelFlag | None = None,
    prefill_chunk: int | None = None,
) -> TeacherForcedReport:
    """Teacher-forced quality of each candidate against a dense baseline.

    With ``corpus``: prefill ``context_tokens`` of a shipped text, then feed its next ``eval_tokens`` tokens.
    With ``prompt``: prefill the prompt, then feed the baseline's own greedy continuation
    (``max_new_tokens``) through both caches. ``TeacherForcedStep`` per fed token; ``Cancelled`` when
    ``cancel()`` turns true.
    """
    if isinstance(candidates, (str, Policy)):
        candidates = [candidates]
    check_teacher_forced_args(corpus, context_tokens, eval_tokens)
    pols = [engine.check_policy(c) for c in candidates]  # checked once, before the baseline runs
    ids, prefill, source = _tokens(engine, prompt, corpus, context_tokens, eval_tokens, chat, max_new_tokens, cancel)
    base = baseline_logprobs(engine, ids, prefill, on_event, cancel=cancel)
    results = [teacher_forced(engine, ids, prefill, p, cache_mode, baseline=base, on_event=on_event, cancel=cancel,
                              prefill_chunk=prefill_chunk) for p in pols]
    for r, p in zip(results, pols):
        object.__setattr__(r, "kv_policy", p.label)
    return TeacherForcedReport(engine.name, source, cache_mode, prefill, len(base), results)
