"""Kept policies: the policies a user named in the workbench, in ``policies.json`` of the data dir, so every
later session lists them."""

from __future__ import annotations

import json
from pathlib import Path

from tqbench.engine.atomic import atomic_write
from tqbench.sessions.store import SessionError, data_dir


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
    atomic_write(path, (json.dumps(policies, indent=1, sort_keys=True) + "\n").encode())
    return path
