"""The recommendation for one validated candidate: a status, a cause hint and the next policy to try.

The status follows the quality verdict (``STATUS``) with three overrides, in order: a storage-only run
(dense-shadow) makes no quality claim; a policy that stores at least as many bytes as the baseline at the
tested length (``cache.savings``) is ``saves-nothing``, whatever its tokens did; an exact-match or near-stable
verdict on too small a sample (``evidence``) is ``unproven``, never "safe". ``Recommendation`` carries the
``Savings`` and ``Evidence`` it was decided on, for every front end to render.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tqbench.engine.codecs import nominal_bits
from tqbench.engine.policy.files import parse_policy
from tqbench.engine.policy.keep import eviction_test_tokens, fmt_keep
from tqbench.engine.policy.presets import PRESETS
from tqbench.engine.policy.spec import Policy

if TYPE_CHECKING:
    from tqbench.engine.cache.savings import Savings
    from tqbench.engine.validate.evidence import Evidence

STATUS = {
    "exact-match": "safe",
    "near-stable": "usable-with-care",
    "prefix-stable-then-diverged": "risky",
    "diverged": "unsafe",
}
NEXT_STEP = {
    "safe": "use it; try the next more aggressive policy to find the edge",
    "usable-with-care": "use it where small late wording changes are acceptable; check teacher-forced quality",
    "risky": "not for exact reproduction; try the next safer policy",
    "unsafe": "do not use; try the next safer policy",
    "saves-nothing": "keep the baseline at this length",
    "unproven": "too small a sample to call it safe: measure teacher-forced quality, or run more prompts and tokens",
}
STORAGE_ONLY = {
    "status": "storage-only",
    "cause_hint": "dense-shadow mode: attention read exact K/V, so the tokens say nothing about quality",
    "next_step": "rerun in the compressed (or simulate / fused) cache mode for a quality verdict",
}


@dataclass(frozen=True)
class Recommendation:
    """What to do with one validated candidate. ``savings``: its bytes against the baseline at the tested
    length (None when the model's geometry is unknown); ``evidence``: the sample the verdict rests on."""

    status: str
    cause_hint: str
    next_policy: str | None
    next_step: str
    savings: Savings | None = None
    evidence: Evidence | None = None

    @property
    def caveat(self) -> str | None:
        """The sample-size caveat, when the sample was too small (``Evidence.caveat``)."""
        return self.evidence.caveat if self.evidence is not None else None

    def to_dict(self) -> dict:
        return {"status": self.status, "cause_hint": self.cause_hint, "next_policy": self.next_policy,
                "next_step": self.next_step,
                "savings": self.savings.to_dict() if self.savings is not None else None,
                "evidence": self.evidence.to_dict() if self.evidence is not None else None,
                "caveat": self.caveat}


def _nominal_kv_bits(preset: str) -> tuple[float, float]:
    """Nominal K and V bits of a preset (the bits the codec names promise: K against V, preset against preset)."""
    pol = parse_policy(preset)
    return nominal_bits(pol.k), nominal_bits(pol.v)


@functools.lru_cache(maxsize=8)
def _ladder(geometry) -> list[tuple[float, str]]:
    from tqbench.engine.cache.estimate import estimate_kv

    return sorted((estimate_kv(name, geometry, 1024).bits_per_element, name) for name in PRESETS)


def cause_hint(verdict: str, policy: Policy) -> str:
    """Why a verdict is what it is, from which side (K or V) holds fewer bits."""
    kb, vb = nominal_bits(policy.k), nominal_bits(policy.v)
    low = min(kb, vb)
    if verdict == "exact-match":
        return "no token changed; a more aggressive policy may hold too"
    if kb < vb:
        return f"keys are the lower-precision side ({policy.k}): key error moves attention scores; raise key bits first"
    if vb < kb:
        return f"values are the lower-precision side ({policy.v}): raise value bits, or keep the last layers' values int8"
    if low <= 2:
        return f"{policy.k} keys and values: 2 bits is past the edge on most models; try 3 bits or an outlier split"
    if low >= 16:
        return "the policy keeps fp16 everywhere: a difference here means the comparison itself is not deterministic"
    return (f"uniform {low:g}-bit K and V: each bit removed costs 2-3x in KL; a longer recent window "
            "(recent=32) or per-layer protection from `scan` helps")


def next_policy(verdict: str, policy: Policy, geometry) -> str | None:
    """The next preset on the ladder ordered by estimated bits per element at 1024 tokens of ``geometry``:
    the next cheaper one after an exact-match, the next dearer one otherwise."""
    from tqbench.engine.cache.estimate import estimate_kv

    kb, vb = nominal_bits(policy.k), nominal_bits(policy.v)
    # rank on the same footing as the presets: estimated bits at 1024 tokens of this model's geometry
    bits_per_element = estimate_kv(policy, geometry, 1024).bits_per_element
    ladder = _ladder(geometry)
    qjl = "qjl" in policy.k or "qjl" in policy.v
    if verdict == "exact-match":  # the gentlest step down: fewer bits, neither K nor V more precise
        lower = [name for bits, name in ladder if bits < bits_per_element - 1e-6
                 and _nominal_kv_bits(name)[0] <= kb and _nominal_kv_bits(name)[1] <= vb]
        return lower[-1] if lower else None
    # the cheapest step up: more bits, neither K nor V less precise, no QJL unless already QJL
    higher = [name for bits, name in ladder if bits > bits_per_element + 1e-6
              and _nominal_kv_bits(name)[0] >= kb and _nominal_kv_bits(name)[1] >= vb
              and (qjl or "qjl" not in name)]
    return higher[0] if higher else "fp16"


def decide_status(verdict: str, savings: Savings | None = None, evidence: Evidence | None = None,
                  storage_only: bool = False) -> str:
    """The status of a candidate (rules in the module docstring)."""
    if storage_only:
        return STORAGE_ONLY["status"]
    if savings is not None and not savings.saves:
        return "saves-nothing"
    status = STATUS[verdict]
    if status in ("safe", "usable-with-care") and evidence is not None and not evidence.enough:
        return "unproven"
    return status


def short_for_eviction(policy: Policy, prompt_tokens: int | None) -> str | None:
    """Why a prompt of ``prompt_tokens`` cannot test ``policy``'s eviction (``keep.eviction_test_tokens``), else
    None (a policy that evicts nothing, or a long enough prompt)."""
    if prompt_tokens is None or not policy.evicts:
        return None
    need = eviction_test_tokens(policy.sink, policy.window, policy.recent)
    if prompt_tokens >= need:
        return None
    return (f"the prompt ({prompt_tokens} tokens) is too short to test eviction: every KV head keeps its "
            f"{policy.sink} sink and last {max(policy.window, policy.recent)} rows anyway, so keep={fmt_keep(policy.keep)} "
            f"evicts a few rows at most and the tokens say nothing about it; use a prompt of {need}+ tokens "
            "or teacher-forced quality on a shipped corpus text")


def recommend(verdict: str, policy: Policy, geometry=None, storage_only: bool = False,
              savings: Savings | None = None, evidence: Evidence | None = None,
              prompt_tokens: int | None = None) -> Recommendation:
    """Status, a cause hint and the next policy to try, for one candidate's verdict (no next policy without
    ``geometry``, nor when it saves nothing at this length). ``prompt_tokens``: the prompt's length, so an eviction
    policy validated on a prompt too short to evict from is said to be untested (``short_for_eviction``), not
    blamed on its codecs."""
    status = decide_status(verdict, savings, evidence, storage_only)
    if status == STORAGE_ONLY["status"]:
        return Recommendation(status, STORAGE_ONLY["cause_hint"], policy.label, STORAGE_ONLY["next_step"],
                              savings, evidence)
    short = short_for_eviction(policy, prompt_tokens)
    if short is not None:
        status = "unproven" if status in ("safe", "usable-with-care") else status
        return Recommendation(status, short, None, "rerun with a longer prompt to test the eviction", savings,
                              evidence)
    if status == "saves-nothing":
        return Recommendation(status, cause_hint(verdict, policy), None,
                              f"{NEXT_STEP[status]}: {savings.starts_to_save}", savings, evidence)
    nxt = next_policy(verdict, policy, geometry) if geometry is not None else None
    return Recommendation(status, cause_hint(verdict, policy), nxt, NEXT_STEP[status], savings, evidence)


def self_test_recommendation(verdict: str) -> Recommendation:
    """A self-test's 'recommendation': passed (exact-match) or a bug to report."""
    ok = verdict == "exact-match"
    return Recommendation(
        "self-test-passed" if ok else "self-test-failed",
        "the baseline against itself through the same loop" + (
            "" if ok else ": tokens differ, so the generation loop or cache is not deterministic"),
        None,
        "validate a candidate policy" if ok else "report a bug: comparisons cannot be trusted")
