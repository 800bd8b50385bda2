"""Sessions: everything a workbench run produced, saved as versioned JSON plus a safetensors file of arrays.

``NAME.json`` holds the model (id + weight fingerprint), policies, prompts, parameters, texts, summaries,
scan/compare/validate results, library versions and device; ``NAME.safetensors`` beside it holds the arrays
(token ids, per-step seconds, KL, agreement flags, cache bytes). Both are written atomically (temp file +
``os.replace``; arrays first, the JSON last, so a crash never leaves a JSON pointing at missing arrays).
Never pickle: JSON and safetensors only. A corrupt file or one from a newer format raises ``SessionError``
with a message a front end can show as is.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from tqbench.engine.events import CacheBytes, GenerationFinished, GenerationStarted, PairStep, PrefillDone
from tqbench.engine.metrics import first_divergence, pair_summary

FORMAT = "tqbench-session"
VERSION = 1
SUFFIX = ".json"


class SessionError(ValueError):
    """A session file that cannot be read (corrupt, missing arrays, newer format)."""


def data_dir() -> Path:
    """tqbench's user data: ``$TQBENCH_DATA_DIR``, else the platform's user data dir."""
    env = os.environ.get("TQBENCH_DATA_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("tqbench"))


def session_dir(override: str | os.PathLike | None = None) -> Path:
    """Where sessions live: ``override``, else ``$TQBENCH_DATA_DIR/sessions``, else the user data dir."""
    if override:
        return Path(override).expanduser()
    return data_dir() / "sessions"


def kept_policies_path() -> Path:
    return data_dir() / "policies.json"


def load_kept_policies() -> dict[str, str]:
    """Policies the user named and kept in the workbench (``{name: compact form}``); a bad file raises."""
    path = kept_policies_path()
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        raise SessionError(f"{path} is corrupt (not valid JSON): fix or delete it to keep policies again") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise SessionError(f"{path} is not a {{name: policy}} object: fix or delete it")
    return data


def save_kept_policies(policies: dict[str, str]) -> Path:
    path = kept_policies_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, (json.dumps(policies, indent=1, sort_keys=True) + "\n").encode())
    return path


def environment(device: str | None = None) -> dict:
    import torch
    import transformers

    from tqbench import __version__

    return {
        "tqbench": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
        "numpy": np.__version__, "python": platform.python_version(), "platform": platform.platform(),
        "device": device, "threads": torch.get_num_threads(),
    }


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# ---- records -----------------------------------------------------------------------------------------
_SIDE_ARRAYS = {"token_ids": np.int64, "step_seconds": np.float64, "resident_bytes": np.int64,
                "storage_bytes": np.int64}
_PAIR_ARRAYS = {"same_token": np.uint8, "same_top1": np.uint8, "kl": np.float64}


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

    @property
    def tokens_per_second(self) -> list[float]:
        return [1.0 / s if s > 0 else 0.0 for s in self.step_seconds[1:]]

    def meta(self) -> dict:
        d = asdict(self)
        for key in _SIDE_ARRAYS:
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
    kind: str = "lockstep"  # or "bench" (one run, no baseline)
    same_token: list[bool] = field(default_factory=list)
    same_top1: list[bool] = field(default_factory=list)
    kl: list[float | None] = field(default_factory=list)
    created: str = field(default_factory=now_iso)

    @property
    def steps(self) -> int:
        return len(self.same_token)

    @property
    def first_divergence(self) -> int | None:
        return first_divergence(self.same_token)

    def summary(self) -> dict:
        """``metrics.pair_summary``: the numbers ``validate`` reports for the same run (same-context KL)."""
        return pair_summary(self.same_token, self.same_top1, self.kl).to_dict()

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
    from tqbench.engine.policy.spec import parse_policy

    try:
        same = parse_policy(side.policy).to_string() == side.policy_string
    except ValueError:
        same = False
    return side.policy if same else side.policy_string


@dataclass(frozen=True)
class RunDiff:
    """A re-run compared with its saved record, side by side."""

    identical: bool
    sides: dict  # side -> {"identical", "first_difference", "saved_tokens", "new_tokens"}

    def describe(self) -> str:
        parts = []
        for side, d in self.sides.items():
            if d["identical"]:
                parts.append(f"{side}: identical ({d['new_tokens']} tokens)")
            else:
                parts.append(f"{side}: differs from token {d['first_difference']} "
                             f"({d['saved_tokens']} saved, {d['new_tokens']} now)")
        return "; ".join(parts)


def diff_runs(saved: RunRecord, new: RunRecord) -> RunDiff:
    sides = {}
    for name in ("baseline", "candidate"):
        a, b = getattr(saved, name), getattr(new, name)
        if a is None or b is None:
            continue
        first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if first is None and len(a.token_ids) != len(b.token_ids):
            first = min(len(a.token_ids), len(b.token_ids))
        sides[name] = {"identical": first is None, "first_difference": first,
                       "saved_tokens": len(a.token_ids), "new_tokens": len(b.token_ids)}
    return RunDiff(all(d["identical"] for d in sides.values()), sides)


class RunRecorder:
    """Builds a ``RunRecord`` from the events of ``Engine.lockstep`` / ``Engine.stream`` (any front end)."""

    def __init__(self, prompt: str, chat: bool, max_new_tokens: int, sampling: dict, kind: str = "lockstep") -> None:
        self.record = RunRecord(prompt, chat, max_new_tokens, dict(sampling), candidate=RunSide("", "", ""), kind=kind)
        self._sides: dict[str, RunSide] = {}

    def side(self, run: str) -> RunSide | None:
        return self._sides.get(run)

    def __call__(self, ev: object) -> None:
        rec = self.record
        if isinstance(ev, GenerationStarted):
            from tqbench.engine.policy.spec import parse_policy

            try:
                pstr = parse_policy(ev.kv_policy).to_string()
            except ValueError:
                pstr = ev.kv_policy
            side = RunSide(ev.kv_policy, pstr, ev.cache_mode, ev.input_tokens)
            self._sides[ev.run] = side
            if ev.run == "baseline":
                rec.baseline = side
            else:
                rec.candidate = side
        elif isinstance(ev, PrefillDone):
            self._sides[ev.run].prefill_seconds = ev.seconds
        elif isinstance(ev, PairStep):
            for tok in (ev.baseline, ev.candidate):
                if tok is not None:
                    self._token(tok)
            rec.same_token.append(bool(ev.same_token))
            rec.same_top1.append(bool(ev.same_top1))
            rec.kl.append(None if ev.kl is None else float(ev.kl))
        elif isinstance(ev, CacheBytes):
            side = self._sides[ev.run]
            side.resident_bytes.append(ev.resident_bytes)
            side.storage_bytes.append(ev.storage_bytes)
        elif isinstance(ev, GenerationFinished):
            r = ev.result
            side = self._sides[ev.run]
            side.text = r.text
            side.stopped_by = r.stopped_by
            side.token_ids = list(r.token_ids)
            side.cache_report = r.cache_report.to_dict() if r.cache_report is not None else None
        elif type(ev).__name__ == "TokenGenerated":  # a single stream (no PairStep)
            self._token(ev)

    def _token(self, tok) -> None:
        side = self._sides[tok.run]
        if len(side.step_seconds) <= tok.step:
            side.token_ids.append(tok.token_id)
            side.step_seconds.append(float(tok.step_seconds))


# ---- the session -------------------------------------------------------------------------------------
@dataclass
class Session:
    model: dict = field(default_factory=dict)  # spec, name, fingerprint, device, dtype, num_params
    runs: list[RunRecord] = field(default_factory=list)
    policies: dict[str, str] = field(default_factory=dict)  # user-named policies: name -> compact form
    scans: list[dict] = field(default_factory=list)
    compares: list[dict] = field(default_factory=list)
    validations: list[dict] = field(default_factory=list)
    environment: dict = field(default_factory=dict)
    created: str = field(default_factory=now_iso)
    title: str = ""

    @staticmethod
    def model_info(engine, spec: str | None = None) -> dict:
        info = engine.loaded
        return {
            "spec": spec or info.name, "name": info.name, "fingerprint": info.fingerprint,
            "device": str(info.device), "dtype": str(info.dtype).replace("torch.", ""),
            "num_params": int(info.num_params),
        }

    # -- save ------------------------------------------------------------------------------------------
    def to_json(self, arrays_name: str, arrays_sha256: str) -> dict:
        runs = []
        for rec in self.runs:
            runs.append({
                "kind": rec.kind, "created": rec.created, "prompt": rec.prompt, "chat": rec.chat,
                "max_new_tokens": rec.max_new_tokens, "sampling": rec.sampling,
                "baseline": rec.baseline.meta() if rec.baseline else None,
                "candidate": rec.candidate.meta(), "summary": rec.summary(),
            })
        return {
            "format": FORMAT, "version": VERSION, "created": self.created, "saved": now_iso(),
            "title": self.title, "model": self.model, "environment": self.environment,
            "policies": self.policies, "runs": runs, "scans": self.scans, "compares": self.compares,
            "validations": self.validations,
            "arrays": {"file": arrays_name, "sha256": arrays_sha256},
        }

    def arrays(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for i, rec in enumerate(self.runs):
            for name in ("baseline", "candidate"):
                side = getattr(rec, name)
                if side is None:
                    continue
                for key, dt in _SIDE_ARRAYS.items():
                    out[f"runs.{i}.{name}.{key}"] = np.asarray(getattr(side, key), dtype=dt).reshape(-1)
            for key, dt in _PAIR_ARRAYS.items():
                vals = getattr(rec, key)
                if key == "kl":
                    vals = [math.nan if v is None else v for v in vals]
                out[f"runs.{i}.{key}"] = np.asarray(vals, dtype=dt).reshape(-1)
        return out

    def save(self, path: str | os.PathLike) -> Path:
        from safetensors.numpy import save

        path = Path(path)
        if path.suffix != SUFFIX:
            path = path.with_name(path.name + SUFFIX)
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays_path = path.with_suffix(".safetensors")
        blob = save(self.arrays(), metadata={"format": FORMAT, "version": str(VERSION)})
        _atomic_write(arrays_path, blob)
        doc = self.to_json(arrays_path.name, hashlib.sha256(blob).hexdigest())
        _atomic_write(path, (json.dumps(doc, indent=1, allow_nan=False) + "\n").encode())
        return path

    # -- load ------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike) -> Session:
        from safetensors.numpy import load

        path = Path(path)
        doc = read_header(path)
        arrays_path = path.with_name(doc["arrays"]["file"])
        try:
            blob = arrays_path.read_bytes()
        except OSError:
            raise SessionError(f"session {path.name}: its arrays file {arrays_path.name} is missing") from None
        if hashlib.sha256(blob).hexdigest() != doc["arrays"]["sha256"]:
            raise SessionError(f"session {path.name}: {arrays_path.name} does not match the session (changed or "
                               "corrupt): save the session again")
        try:
            arr = load(blob)
        except Exception as exc:  # safetensors raises its own error types
            raise SessionError(f"session {path.name}: {arrays_path.name} is not a readable safetensors file "
                               f"({exc})") from None
        try:
            runs = [_run_from(i, r, arr) for i, r in enumerate(doc["runs"])]
            return cls(model=doc["model"], runs=runs, policies=dict(doc.get("policies", {})),
                       scans=list(doc.get("scans", [])), compares=list(doc.get("compares", [])),
                       validations=list(doc.get("validations", [])), environment=doc.get("environment", {}),
                       created=doc.get("created", ""), title=doc.get("title", ""))
        except (KeyError, TypeError, ValueError) as exc:
            raise SessionError(f"session {path.name} is corrupt (bad or missing field {exc}): it cannot be "
                               "opened") from None


def read_header(path: str | os.PathLike) -> dict:
    """The session JSON, checked for format and version (arrays not read)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise SessionError(f"session file {str(path)!r} does not exist") from None
    except OSError as exc:
        raise SessionError(f"session file {str(path)!r} cannot be read ({exc.strerror})") from None
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise SessionError(f"session {path.name} is corrupt (not valid JSON): it cannot be opened") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SessionError(f"{path.name} is not a tqbench session (no \"format\": \"{FORMAT}\")")
    version = doc.get("version")
    if not isinstance(version, int):
        raise SessionError(f"session {path.name} is corrupt (no format version)")
    if version > VERSION:
        raise SessionError(f"session {path.name} was written by a newer tqbench (format version {version}; this "
                           f"one reads up to {VERSION}): upgrade tqbench to open it")
    if not isinstance(doc.get("arrays"), dict) or "file" not in doc["arrays"] or "sha256" not in doc["arrays"]:
        raise SessionError(f"session {path.name} is corrupt (no arrays entry)")
    return doc


def _run_from(i: int, r: dict, arr: dict[str, np.ndarray]) -> RunRecord:
    def side(name: str) -> RunSide | None:
        meta = r.get(name)
        if meta is None:
            return None
        s = RunSide(**meta)
        for key in _SIDE_ARRAYS:
            vals = arr[f"runs.{i}.{name}.{key}"].tolist()
            setattr(s, key, vals)
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


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@dataclass(frozen=True)
class SessionEntry:
    path: Path
    title: str
    saved: str
    model: str
    runs: int
    error: str | None = None


def list_sessions(directory: str | os.PathLike | None = None) -> list[SessionEntry]:
    """Every ``*.json`` session in ``directory`` (newest first); unreadable ones carry their error."""
    d = session_dir(directory)
    if not d.is_dir():
        return []
    out = []
    for p in sorted(d.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            doc = read_header(p)
            out.append(SessionEntry(p, doc.get("title") or p.stem, doc.get("saved", ""),
                                    doc.get("model", {}).get("name", "?"), len(doc.get("runs", []))))
        except SessionError as exc:
            out.append(SessionEntry(p, p.stem, "", "?", 0, str(exc)))
    return out


def default_session_path(directory: str | os.PathLike | None = None, stem: str = "session") -> Path:
    return session_dir(directory) / f"{time.strftime('%Y%m%d-%H%M%S')}-{stem}{SUFFIX}"


def record_from_validation(payload: dict) -> RunRecord | None:
    """The lockstep run inside a ``ValidationReport.to_dict()`` as a ``RunRecord`` (None for teacher-forced)."""
    ids, texts = payload.get("token_ids"), payload.get("texts")
    if not isinstance(ids, dict) or not isinstance(texts, dict):
        return None
    steps = payload.get("per_step") or []

    def side(name: str, label: str, pstr: str, mode: str) -> RunSide:
        rep = payload.get(f"{name}_cache_report")
        return RunSide(label, pstr, mode, token_ids=list(ids.get(name, [])), text=texts.get(name, ""),
                       stopped_by="", cache_report=rep,
                       step_seconds=[float(s.get(f"{name}_seconds") or 0.0) for s in steps])

    prompt = payload.get("prompt")
    if isinstance(prompt, list):
        prompt = "\n".join(str(m.get("content", "")) for m in prompt)
    rec = RunRecord(
        prompt or "", bool(payload.get("chat", True)), int(payload.get("max_new_tokens", 0)),
        dict(payload.get("sampling") or {}),
        candidate=side("candidate", payload["candidate"], payload["candidate_policy"], payload["cache_mode"]),
        baseline=side("baseline", payload["baseline"], payload["baseline_policy"], payload["baseline_mode"]),
        kind="validate",
    )
    if steps:
        rec.same_token = [s.get("baseline_token") is not None and s.get("baseline_token") == s.get("candidate_token")
                          for s in steps]
        rec.same_top1 = [s.get("baseline_top1") is not None and s.get("baseline_top1") == s.get("candidate_top1")
                         for s in steps]
        rec.kl = [s.get("kl") for s in steps]
    else:
        b, c = rec.baseline.token_ids, rec.candidate.token_ids
        rec.same_token = [i < len(c) and b[i] == c[i] for i in range(len(b))]
        rec.same_top1 = list(rec.same_token)
        rec.kl = [None] * len(b)
    return rec
