"""The session format: its name and version, the records a session holds, and their JSON + array layout.

A session is ``NAME.json`` (everything small: model, policies, prompts, parameters, texts, summaries,
scan/compare/validate results) beside ``NAME.safetensors`` (the per-step arrays). ``run_to_json`` /
``run_arrays`` write one ``RunRecord`` into the two; ``run_from`` reads it back; ``migrate`` brings an
older document up to ``VERSION`` first, so the rest of the code reads one layout only.

Versions:

- 1: each side's token ids are in the arrays; their text pieces are not stored (a reader rebuilt them with
  the model's tokenizer, so a session could not be shown before the model had loaded).
- 2: each side also keeps ``token_texts`` (the text piece of every token, as streamed) in the JSON.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from tqbench.engine.metrics import pair_summary

FORMAT = "tqbench-session"
VERSION = 2
SUFFIX = ".json"

#: per-side arrays and per-step pair arrays in the safetensors file (``runs.{i}.{side}.{key}``, ``runs.{i}.{key}``)
SIDE_ARRAYS = {"token_ids": np.int64, "step_seconds": np.float64, "resident_bytes": np.int64,
               "storage_bytes": np.int64}
PAIR_ARRAYS = {"same_token": np.uint8, "same_top1": np.uint8, "kl": np.float64}


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class RunSide:
    """One generation (the baseline or the candidate of a run)."""

    policy: str  # label (preset name or compact string)
    policy_string: str
    cache_mode: str
    input_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    stopped_by: str = ""
    prefill_seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)  # every token's forward (the first is prefill)
    resident_bytes: list[int] = field(default_factory=list)  # per token, when bytes were tracked
    storage_bytes: list[int] = field(default_factory=list)
    cache_report: dict | None = None
    token_texts: list[str] = field(default_factory=list)  # each token's text piece, as streamed (version 2)

    @property
    def tokens_per_second(self) -> list[float]:
        return [1.0 / s if s > 0 else 0.0 for s in self.step_seconds[1:]]

    @property
    def has_token_texts(self) -> bool:
        """Every token has its text piece (False for a version-1 side: rebuild them with the tokenizer)."""
        return len(self.token_texts) == len(self.token_ids)

    def meta(self) -> dict:
        """The side without its arrays: what goes into the JSON."""
        d = asdict(self)
        for key in SIDE_ARRAYS:
            d.pop(key)
        return d


@dataclass
class RunRecord:
    """A prompt run: a candidate, usually with a baseline beside it (lockstep), and per-step comparison."""

    prompt: str
    chat: bool
    max_new_tokens: int
    sampling: dict
    candidate: RunSide
    baseline: RunSide | None = None
    kind: str = "lockstep"  # or "bench" (one run, no baseline), "validate"
    same_token: list[bool] = field(default_factory=list)
    same_top1: list[bool] = field(default_factory=list)
    kl: list[float | None] = field(default_factory=list)
    created: str = field(default_factory=now_iso)

    @property
    def sides(self) -> list[RunSide]:
        return [s for s in (self.baseline, self.candidate) if s is not None]

    @property
    def steps(self) -> int:
        return len(self.same_token)

    @property
    def first_divergence(self) -> int | None:
        """The first step whose tokens differ (a cancelled run: among the steps both sides produced)."""
        return self.pair_summary().first_divergence

    @property
    def cancelled_tokens(self) -> tuple[int, int] | None:
        """(baseline tokens, candidate tokens) when either side was cancelled, else None."""
        if not any(s.stopped_by == "cancelled" for s in self.sides):
            return None
        return (len(self.baseline.token_ids) if self.baseline else 0, len(self.candidate.token_ids))

    def pair_summary(self):
        """``metrics.pair_summary`` (typed): the numbers ``validate`` reports for the same run."""
        return pair_summary(self.same_token, self.same_top1, self.kl, self.cancelled_tokens)

    def summary(self) -> dict:
        """``metrics.pair_summary``: the numbers ``validate`` reports for the same run (same-context KL)."""
        return self.pair_summary().to_dict()

    def params(self) -> dict:
        """What re-running this record needs."""
        return {
            "prompt": self.prompt, "chat": self.chat, "max_new_tokens": self.max_new_tokens,
            "sampling": dict(self.sampling),
            "baseline": _policy_text(self.baseline) if self.baseline else None,
            "baseline_mode": self.baseline.cache_mode if self.baseline else None,
            "candidate": _policy_text(self.candidate), "candidate_mode": self.candidate.cache_mode,
        }


def _policy_text(side: RunSide) -> str:
    """The side's label when it still names the same policy (a preset: ``turbo4``), else its compact form."""
    from tqbench.engine.policy import parse_policy

    try:
        same = parse_policy(side.policy).to_string() == side.policy_string
    except ValueError:
        same = False
    return side.policy if same else side.policy_string


# ---- records <-> JSON + arrays -----------------------------------------------------------------------
def run_to_json(rec: RunRecord) -> dict:
    return {
        "kind": rec.kind, "created": rec.created, "prompt": rec.prompt, "chat": rec.chat,
        "max_new_tokens": rec.max_new_tokens, "sampling": rec.sampling,
        "baseline": rec.baseline.meta() if rec.baseline else None,
        "candidate": rec.candidate.meta(), "summary": rec.summary(),
    }


def run_arrays(i: int, rec: RunRecord) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name in ("baseline", "candidate"):
        side = getattr(rec, name)
        if side is None:
            continue
        for key, dt in SIDE_ARRAYS.items():
            out[f"runs.{i}.{name}.{key}"] = np.asarray(getattr(side, key), dtype=dt).reshape(-1)
    for key, dt in PAIR_ARRAYS.items():
        vals = getattr(rec, key)
        if key == "kl":
            vals = [math.nan if v is None else v for v in vals]
        out[f"runs.{i}.{key}"] = np.asarray(vals, dtype=dt).reshape(-1)
    return out


def run_from(i: int, r: dict, arr: dict[str, np.ndarray]) -> RunRecord:
    """Run ``i`` of a (migrated) document, with its arrays; a missing field raises KeyError/TypeError/ValueError."""
    def side(name: str) -> RunSide | None:
        meta = r.get(name)
        if meta is None:
            return None
        s = RunSide(**meta)
        for key in SIDE_ARRAYS:
            setattr(s, key, arr[f"runs.{i}.{name}.{key}"].tolist())
        return s

    cand = side("candidate")
    if cand is None:
        raise ValueError("candidate")
    rec = RunRecord(r["prompt"], bool(r["chat"]), int(r["max_new_tokens"]), dict(r["sampling"]), cand,
                    side("baseline"), r.get("kind", "lockstep"), created=r.get("created", ""))
    rec.same_token = [bool(x) for x in arr[f"runs.{i}.same_token"].tolist()]
    rec.same_top1 = [bool(x) for x in arr[f"runs.{i}.same_top1"].tolist()]
    rec.kl = [None if math.isnan(x) else float(x) for x in arr[f"runs.{i}.kl"].tolist()]
    return rec


# ---- older versions ------------------------------------------------------------------------------------
def _v1_to_v2(doc: dict) -> dict:
    """Version 1 stored no per-token texts: each side gets an empty ``token_texts`` (rebuilt on open)."""
    for run in doc.get("runs", []):
        for name in ("baseline", "candidate"):
            if isinstance(run, dict) and isinstance(run.get(name), dict):
                run[name].setdefault("token_texts", [])
    return doc


_MIGRATIONS = {1: _v1_to_v2}  # version -> the step to version + 1


def migrate(doc: dict) -> dict:
    """``doc`` (a checked header of any version up to ``VERSION``) in the current layout."""
    version = doc["version"]
    while version < VERSION:
        doc = _MIGRATIONS[version](doc)
        version += 1
    doc["version"] = VERSION
    return doc
