"""The session and its files: atomic save and load of ``NAME.json`` + ``NAME.safetensors``, listing, paths.

Both files are written atomically (temp file + ``os.replace``; arrays first, the JSON last, so a crash never
leaves a JSON pointing at missing arrays). Never pickle: JSON and safetensors only. A corrupt file or one from
a newer format raises ``SessionError`` with a message a front end can show as is. ``save_session`` is the one
way a front end saves (the workbench's ctrl+s, a headless command's ``--save-session``).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tqbench.engine.atomic import atomic_write
from tqbench.sessions.schema import (
    FORMAT,
    SUFFIX,
    VERSION,
    RunRecord,
    migrate,
    now_iso,
    run_arrays,
    run_from,
    run_to_json,
)

if TYPE_CHECKING:
    from tqbench.engine.scan import ScanResult
    from tqbench.engine.validate import CompareResult


class SessionError(ValueError):
    """A session file that cannot be read (corrupt, missing arrays, newer format)."""


# ---- where sessions live -------------------------------------------------------------------------------
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


def default_session_path(directory: str | os.PathLike | None = None, stem: str = "session") -> Path:
    return session_dir(directory) / f"{time.strftime('%Y%m%d-%H%M%S')}-{stem}{SUFFIX}"


def environment(device: str | None = None) -> dict:
    """Library versions, platform and device: what a saved session records about the machine."""
    import torch
    import transformers

    from tqbench import __version__

    return {
        "tqbench": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
        "numpy": np.__version__, "python": platform.python_version(), "platform": platform.platform(),
        "device": device, "threads": torch.get_num_threads(),
    }


# ---- the session -----------------------------------------------------------------------------------------
@dataclass
class Session:
    model: dict = field(default_factory=dict)  # spec, name, fingerprint, device, dtype, num_params
    runs: list[RunRecord] = field(default_factory=list)
    policies: dict[str, str] = field(default_factory=dict)  # user-named policies: name -> compact form
    scans: list[ScanResult] = field(default_factory=list)  # typed in memory, to_dict() in the file
    compares: list[CompareResult] = field(default_factory=list)
    validations: list[dict] = field(default_factory=list)
    tasks: list = field(default_factory=list)  # engine.tasks.TasksResult: the long-context suite's results
    environment: dict = field(default_factory=dict)
    created: str = field(default_factory=now_iso)
    title: str = ""
    backup: Path | None = field(default=None, repr=False, compare=False)  # set by save: the previous version kept

    @staticmethod
    def model_info(engine, spec: str | None = None) -> dict:
        info = engine.loaded
        return {
            "spec": spec or info.name, "name": info.name, "fingerprint": info.fingerprint,
            "device": str(info.device), "dtype": str(info.dtype).replace("torch.", ""),
            "num_params": int(info.num_params),
        }

    @property
    def has_token_texts(self) -> bool:
        """Every run's tokens carry their text (False for a version-1 file: needs the model's tokenizer)."""
        return all(side.has_token_texts for rec in self.runs for side in rec.sides)

    # -- save ------------------------------------------------------------------------------------------
    def to_json(self, arrays_name: str, arrays_sha256: str) -> dict:
        return {
            "format": FORMAT, "version": VERSION, "created": self.created, "saved": now_iso(),
            "title": self.title, "model": self.model, "environment": self.environment,
            "policies": self.policies, "runs": [run_to_json(rec) for rec in self.runs],
            "scans": [s.to_dict() for s in self.scans], "compares": [c.to_dict() for c in self.compares],
            "validations": self.validations, "tasks": [t.to_dict() for t in self.tasks],
            "arrays": {"file": arrays_name, "sha256": arrays_sha256},
        }

    def arrays(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for i, rec in enumerate(self.runs):
            out.update(run_arrays(i, rec))
        return out

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``path`` (``.json`` added when missing) and the arrays beside it; returns the JSON's path."""
        from safetensors.numpy import save

        path = Path(path)
        if path.suffix != SUFFIX:
            path = path.with_name(path.name + SUFFIX)
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays_path = path.with_suffix(".safetensors")
        blob = save(self.arrays(), metadata={"format": FORMAT, "version": str(VERSION)})
        self.backup = keep_backup(path)
        atomic_write(arrays_path, blob)
        doc = self.to_json(arrays_path.name, hashlib.sha256(blob).hexdigest())
        atomic_write(path, (json.dumps(doc, indent=1, allow_nan=False) + "\n").encode())
        return path

    # -- load ------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike) -> Session:
        """Read a session of any version up to ``VERSION`` (older ones are migrated on the way in)."""
        path = Path(path)
        doc = read_header(path)
        arr = _read_arrays(path, doc)
        try:
            doc = migrate(doc)
            runs = [run_from(i, r, arr) for i, r in enumerate(doc["runs"])]
            scans, compares = _results_from(doc)
            tasks = _tasks_from(doc)
            return cls(model=doc["model"], runs=runs, policies=dict(doc.get("policies", {})),
                       scans=scans, compares=compares, tasks=tasks,
                       validations=list(doc.get("validations", [])), environment=doc.get("environment", {}),
                       created=doc.get("created", ""), title=doc.get("title", ""))
        except (KeyError, TypeError, ValueError) as exc:
            raise SessionError(f"session {path.name} is corrupt (bad or missing field {exc}): it cannot be "
                               "opened") from None


def _results_from(doc: dict) -> tuple[list[ScanResult], list[CompareResult]]:
    """A (migrated) document's scans and comparisons as the engine's typed results."""
    scans, compares = doc.get("scans", []), doc.get("compares", [])
    if not scans and not compares:
        return [], []
    from tqbench.engine.scan import ScanResult
    from tqbench.engine.validate import CompareResult

    return [ScanResult.from_dict(d) for d in scans], [CompareResult.from_dict(d) for d in compares]


def backup_path(path: Path) -> Path:
    """Where ``keep_backup`` keeps the previous version of session ``path``: ``NAME.bak.json`` (+ its arrays)."""
    return path.with_name(path.stem + ".bak" + SUFFIX)


def keep_backup(path: Path) -> Path | None:
    """The overwrite rule, for every front end (``--save-session``, ctrl+s, save as): a path that does not exist
    is written; an existing tqbench session is moved to ``backup_path`` (its arrays too; one backup, replaced by
    the next save) and its path returned; any other existing file is refused (``SessionError``), never replaced."""
    if not path.exists():
        return None
    try:
        read_header(path)
    except SessionError as exc:
        raise SessionError(f"{path} exists and is not a tqbench session ({exc}): it is not overwritten; give "
                           "another file name") from None
    bak = backup_path(path)
    doc = json.loads(path.read_bytes())
    arrays = path.parent / (doc.get("arrays") or {}).get("file", path.with_suffix(".safetensors").name)
    if arrays.exists():  # the backup names its own arrays file, so it opens as it was
        os.replace(arrays, bak.with_suffix(".safetensors"))
        doc["arrays"]["file"] = bak.with_suffix(".safetensors").name
    atomic_write(bak, (json.dumps(doc, indent=1, allow_nan=False) + "\n").encode())
    path.unlink()
    return bak


def _tasks_from(doc: dict) -> list:
    if not doc.get("tasks"):
        return []
    from tqbench.engine.tasks.suite import TasksResult

    return [TasksResult.from_dict(d) for d in doc["tasks"]]


def save_session(session: Session, path: str | os.PathLike | None = None, *,
                 directory: str | os.PathLike | None = None, engine=None, model_spec: str | None = None) -> Path:
    """Save ``session`` to ``path``, else to ``new_session_path(session, directory)``. With ``engine``, the
    session records this machine's environment and (when it has none yet) the engine's model (``model_spec``:
    how it was asked for). Returns the JSON's path."""
    if engine is not None:
        session.environment = environment(str(engine.loaded.device))
        if not session.model:
            session.model = Session.model_info(engine, model_spec)
    return session.save(path or new_session_path(session, directory))


def new_session_path(session: Session, directory: str | os.PathLike | None = None) -> Path:
    """A new file in ``directory`` (the session dir when None), named by the time and the last run's candidate."""
    stem = "session"
    if session.runs:
        cand = session.runs[-1].candidate.policy
        stem = "".join(c if c.isalnum() or c in "-." else "-" for c in cand) or "session"
        if len(stem) > 40:  # cut, with a hash of the whole policy so two long policies never share a name
            stem = f"{stem[:31]}-{hashlib.sha1(cand.encode()).hexdigest()[:8]}"
    return default_session_path(directory, stem)


def read_header(path: str | os.PathLike) -> dict:
    """The session JSON, checked for format and version (arrays not read, older versions not migrated)."""
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
    if not isinstance(version, int) or version < 1:
        raise SessionError(f"session {path.name} is corrupt (no format version)")
    if version > VERSION:
        raise SessionError(f"session {path.name} was written by a newer tqbench (format version {version}; this "
                           f"one reads up to {VERSION}): upgrade tqbench to open it")
    if not isinstance(doc.get("arrays"), dict) or "file" not in doc["arrays"] or "sha256" not in doc["arrays"]:
        raise SessionError(f"session {path.name} is corrupt (no arrays entry)")
    return doc


def _read_arrays(path: Path, doc: dict) -> dict[str, np.ndarray]:
    from safetensors.numpy import load

    arrays_path = path.with_name(doc["arrays"]["file"])
    try:
        blob = arrays_path.read_bytes()
    except OSError:
        raise SessionError(f"session {path.name}: its arrays file {arrays_path.name} is missing") from None
    if hashlib.sha256(blob).hexdigest() != doc["arrays"]["sha256"]:
        raise SessionError(f"session {path.name}: {arrays_path.name} does not match the session (changed or "
                           "corrupt): save the session again")
    try:
        return load(blob)
    except Exception as exc:  # safetensors raises its own error types
        raise SessionError(f"session {path.name}: {arrays_path.name} is not a readable safetensors file "
                           f"({exc})") from None


# ---- listing -------------------------------------------------------------------------------------------
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
