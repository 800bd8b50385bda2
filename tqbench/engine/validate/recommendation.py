"""The recommendation for one validated candidate: a status, a cause hint and the next policy to try."""

from __future__ import annotations

import functools

from tqbench.engine.codecs import nominal_bits
from tqbench.engine.policy.files import parse_policy
from tqbench.engine.policy.presets import PRESETS
from tqbench.engine.policy.spec import Policy

STATUS = {
    "exact-match": "safe",
    "near-stable": "usable-with-care",
    "prefix-stable-then-diverged": "risky",
    "diverged": "unsafe",
}
NEXT_STEP = {
    "safe": "use it; try the next more aggressive policy to find the edge",
    "usable-with-care": "use it where small late wording changes are acceptable; check its teacher-forced quality",
    "risky": "not for exact reproduction; try the next safer policy",
    "unsafe": "do not use; try the next safer policy",
}
STORAGE_ONLY = {
    "status": "storage-only",
    "cause_hint": "dense-shadow mode: attention read exact K/V, so the tokens say nothing about quality",
    "next_step": "rerun in compressed cache mode (or simulate / fused) for a quality verdict",
}


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


def recommend(verdict: str, policy: Policy, geometry=None, storage_only: bool = False) -> dict:
    """Status, a cause hint and the next policy to try, for one candidate's verdict (no next policy without
    ``geometry``)."""
    if storage_only:
        return {"status": STORAGE_ONLY["status"], "cause_hint": STORAGE_ONLY["cause_hint"],
                "next_policy": policy.label, "next_step": STORAGE_ONLY["next_step"]}
    status = STATUS[verdict]
    nxt = next_policy(verdict, policy, geometry) if geometry is not None else None
    return {"status": status, "cause_hint": cause_hint(verdict, policy), "next_policy": nxt,
            "next_step": NEXT_STEP[status]}


def self_test_recommendation(verdict: str) -> dict:
    """A self-test's 'recommendation': passed (exact-match) or a bug to report."""
    ok = verdict == "exact-match"
    return {"status": "self-test-passed" if ok else "self-test-failed",
            "cause_hint": "the baseline against itself through the same loop" + (
                "" if ok else ": tokens differ, so the generation loop or cache is not deterministic"),
            "next_policy": None,
            "next_step": "validate a candidate policy" if ok else "report a bug: comparisons cannot be trusted"}
