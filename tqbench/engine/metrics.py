"""Every comparison metric of a baseline/candidate pair, defined once.

validate, compare-policies, the workbench's Run strip, saved sessions and the server all call these, so one
run gets one number wherever it is shown.

- ``kl_rows``: KL(p || q) over the last dimension of two log-probability tensors (masked entries skipped):
  the one KL formula; the per-step, teacher-forced and attention (scan) KLs all call it.
- ``kl_divergence`` / ``logit_stats``: KL(baseline || candidate) of one step's softmax, in nats (computed in
  float64, clamped at 0 against rounding), and the largest |logit delta|.
- ``log_probs`` / ``token_logprobs``: the log-softmax of logits (in at least float32) and, per position, the
  log-probability of a given token plus the top-N alternatives: what the server's ``logprobs`` report, for
  generated tokens and for echoed prompt tokens alike.
- ``match_ratio``: the fraction of steps that agree (token match, top-1 agreement).
- ``perplexity`` / ``teacher_forced_stats``: teacher-forced quality of a candidate fed the baseline's tokens
  (KL of the float32 log-softmax rows, top-1 agreement, perplexity of the real next token under each).
- ``compare_tokens``: exact match, first divergence, position-wise token match ratio and prefix ratio.
- ``same_context_kl``: KL averaged over the steps where both runs had seen the same tokens, i.e. up to
  and including the first divergence; after it the two runs condition on different histories, so their
  KL measures the divergence, not the cache. This is *the* ``kl_mean`` of a run.
- ``pair_summary``: the summary of a run's per-step arrays (what a session and the Run strip show). A cancelled
  run compares only the steps both sides produced (the cancel cut the rest, not a divergence); cancelled
  before the candidate (or the baseline) produced a token, it has no divergence and no match ratio, only a note.
- ``decide_verdict`` / ``worst_verdict``: the verdict rules (below).

Verdicts (``decide_verdict``), with ``n = max(len(baseline), len(candidate))``:

- ``exact-match``: the two token sequences are identical (same ids, same length).
- ``near-stable``: not identical, but the runs agree on at least ``quality_threshold`` (default 0.9) of
  the tokens: the first divergence comes after ``quality_threshold * n`` tokens (``prefix_match_ratio``),
  or position-wise ``token_match_ratio >= quality_threshold``.
- ``prefix-stable-then-diverged``: the first divergence comes after at least ``stable_prefix`` (default
  0.25) of the tokens (and at least one token matched), then the texts go their own ways.
- ``diverged``: the runs part within the first ``stable_prefix`` of the tokens.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from tqbench.engine.request import check_quality_threshold

VERDICTS = ("exact-match", "near-stable", "prefix-stable-then-diverged", "diverged")
DEFAULT_QUALITY_THRESHOLD = 0.9
DEFAULT_STABLE_PREFIX = 0.25


# ---- one step's logits ---------------------------------------------------------------------------
def kl_rows(lp, lq, valid=None):
    """KL(p || q) in nats over the last dimension of log-probabilities ``lp`` / ``lq`` (torch, any shape);
    entries where ``valid`` is False (a causal mask's -inf) count 0, so ``0 * inf`` never appears."""
    import torch

    terms = lp.exp() * (lp - lq)
    if valid is not None:
        terms = torch.where(valid, terms, torch.zeros_like(terms))
    return terms.sum(-1)


def kl_from_logits(p, base_logits, base_lse, logits):
    """``kl_rows(log_softmax(base_logits), log_softmax(logits))`` for many candidates against one exact side:
    ``p`` = its probabilities, ``base_lse`` its logsumexp (computed once). KL = (lse(logits) - base_lse) -
    sum p (logits - base_logits): two passes over the vocabulary instead of a log-softmax and four, on the
    differences of the logits (small where the candidate is close), in the logits' precision."""
    import torch

    return (torch.logsumexp(logits, -1) - base_lse) - (p * (logits - base_logits)).sum(-1)


def logit_stats(base_logits, cand_logits) -> tuple[float, float]:
    """(KL(baseline || candidate) in nats, max |delta logit|) of one step (torch tensors, any dtype)."""
    import torch

    lp = torch.log_softmax(base_logits.double(), -1)
    lq = torch.log_softmax(cand_logits.double(), -1)
    kl = float(kl_rows(lp, lq))
    return max(kl, 0.0), float((base_logits.double() - cand_logits.double()).abs().max())


def kl_divergence(base_logits, cand_logits) -> float:
    """KL(baseline || candidate) of the softmax distributions of one step, in nats."""
    return logit_stats(base_logits, cand_logits)[0]


def log_probs(logits):
    """log-softmax over the last dimension, in ``promote_types(dtype, float32)`` (a float64 model stays float64)."""
    import torch

    return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)


def token_logprobs(logits, targets, top: int = 0) -> list:
    """One ``TokenLogprob`` per row of ``logits`` ([T, V]): the log-probability of ``targets[t]`` under row t and
    the ``top`` most likely tokens of that row (best first; ties keep the lower id first, as ``torch.topk``)."""
    import torch

    from tqbench.engine.events import TokenLogprob

    lp = log_probs(logits.detach()).cpu()
    ids = torch.as_tensor(targets, dtype=torch.long).view(-1)
    chosen = lp.gather(-1, ids.view(-1, 1)).view(-1).tolist()
    if top > 0:
        values, indices = lp.topk(min(top, lp.shape[-1]), dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    else:
        tops = [()] * len(chosen)
    return [TokenLogprob(int(t), float(c), tp) for t, c, tp in zip(ids.tolist(), chosen, tops)]


def match_ratio(agree: list[bool], empty: float | None = 1.0) -> float | None:
    """The fraction of steps that agree; ``empty`` when there are no steps."""
    return sum(agree) / len(agree) if agree else empty


# ---- teacher-forced quality ----------------------------------------------------------------------------
def perplexity(nll: float, steps: int) -> float:
    """exp(mean negative log-likelihood) of ``steps`` tokens whose NLLs sum to ``nll``."""
    return math.exp(nll / steps)


@dataclass(frozen=True)
class TeacherForcedStats:
    steps: int
    kl_mean: float
    kl_max: float
    top1_agreement: float
    ppl_baseline: float
    ppl_candidate: float


def teacher_forced_stats(baseline: list, candidate: list, targets) -> TeacherForcedStats:
    """Baseline vs candidate log-softmax rows (one per fed token, float32) and the real next tokens
    ``targets``: KL(baseline || candidate) per step (not clamped), top-1 agreement, both perplexities."""
    import torch

    kls, agree, nll_b, nll_c = [], [], 0.0, 0.0
    for i, (lp, lq) in enumerate(zip(baseline, candidate)):
        kls.append(float(kl_rows(lp, lq)))
        agree.append(bool(torch.argmax(lp) == torch.argmax(lq)))
        nll_b -= float(lp[targets[i]])
        nll_c -= float(lq[targets[i]])
    steps = len(baseline)
    return TeacherForcedStats(steps, sum(kls) / steps, max(kls), match_ratio(agree),
                              perplexity(nll_b, steps), perplexity(nll_c, steps))


# ---- token sequences -------------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenComparison:
    exact_match: bool
    first_divergence_index: int | None  # None when the sequences are identical
    token_match_ratio: float  # position-wise equal tokens / max(len)
    prefix_match_ratio: float  # tokens before the first divergence / max(len)
    baseline_tokens: int
    candidate_tokens: int

    def to_dict(self) -> dict:
        return asdict(self)


def compare_tokens(baseline: list[int], candidate: list[int]) -> TokenComparison:
    n = max(len(baseline), len(candidate))
    if n == 0:
        return TokenComparison(True, None, 1.0, 1.0, 0, 0)
    first = None
    for i in range(n):
        if i >= len(baseline) or i >= len(candidate) or baseline[i] != candidate[i]:
            first = i
            break
    same = sum(1 for b, c in zip(baseline, candidate) if b == c)
    prefix = n if first is None else first
    return TokenComparison(first is None, first, same / n, prefix / n, len(baseline), len(candidate))


def first_divergence(same_token: list[bool]) -> int | None:
    """The first step whose tokens differ, or None."""
    return next((i for i, same in enumerate(same_token) if not same), None)


# ---- KL over a run -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class KLSummary:
    steps_compared: int  # steps up to and including the first divergence that carry a KL
    kl_mean: float | None
    kl_max: float | None
    after_divergence_steps: int
    after_divergence_kl_mean: float | None


def same_context_kl(kl: list[float | None], first_div: int | None) -> KLSummary:
    """KL over the steps that shared a context (``kl[i]`` is step i's KL, None where not measured)."""
    last = len(kl) - 1 if first_div is None else first_div
    same = [k for i, k in enumerate(kl) if k is not None and i <= last]
    after = [k for i, k in enumerate(kl) if k is not None and i > last]
    return KLSummary(len(same), _mean(same), max(same) if same else None, len(after), _mean(after))


def _mean(xs: list[float]) -> float | None:
    return float(sum(xs) / len(xs)) if xs else None


# ---- a run's summary ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class PairSummary:
    steps: int
    token_match: float | None
    top1_agreement: float | None
    kl_mean: float | None  # same-context KL (see the module docstring)
    kl_max: float | None
    first_divergence: int | None
    exact_match: bool
    cancelled: bool = False  # the run was cancelled: only the steps both sides produced are compared
    note: str | None = None  # e.g. "cancelled before the candidate produced a token"

    def to_dict(self) -> dict:
        return asdict(self)


def pair_summary(same_token: list[bool], same_top1: list[bool], kl: list[float | None],
                 cancelled: tuple[int, int] | None = None) -> PairSummary:
    """The summary of a baseline/candidate run from its per-step arrays; ``cancelled``: (baseline tokens,
    candidate tokens) of a run that was cancelled (the module docstring says what is compared)."""
    note = None
    if cancelled is not None:
        n = min(len(same_token), *cancelled)
        same_token, same_top1, kl = same_token[:n], same_top1[:n], kl[:n]
        if n == 0:
            side = "candidate" if cancelled[1] == 0 else "baseline"
            return PairSummary(0, None, None, None, None, None, False, True,
                               f"cancelled before the {side} produced a token")
        note = f"cancelled: the {n} step{'s' if n != 1 else ''} both runs produced are compared"
    n = len(same_token)
    first = first_divergence(same_token)
    k = same_context_kl(kl, first)
    return PairSummary(
        steps=n,
        token_match=match_ratio(same_token, None),
        top1_agreement=match_ratio(same_top1, None),
        kl_mean=k.kl_mean,
        kl_max=k.kl_max,
        first_divergence=first,
        exact_match=bool(n) and first is None,
        cancelled=cancelled is not None,
        note=note,
    )


# ---- verdicts ------------------------------------------------------------------------------------------
def decide_verdict(
    comparison: TokenComparison,
    quality_threshold: float = DEFAULT_QUALITY_THRESHOLD,
    stable_prefix: float = DEFAULT_STABLE_PREFIX,
) -> str:
    """The verdict of a greedy baseline/candidate pair (rules in the module docstring)."""
    check_quality_threshold(quality_threshold)
    if comparison.exact_match:
        return "exact-match"
    if comparison.prefix_match_ratio >= quality_threshold or comparison.token_match_ratio >= quality_threshold:
        return "near-stable"
    if comparison.first_divergence_index and comparison.prefix_match_ratio >= stable_prefix:
        return "prefix-stable-then-diverged"
    return "diverged"


def worst_verdict(verdicts: list[str]) -> str:
    return max(verdicts, key=VERDICTS.index) if verdicts else "exact-match"
