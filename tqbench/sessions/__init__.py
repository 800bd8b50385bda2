"""Sessions: everything a workbench run produced, saved as versioned JSON plus a safetensors file of arrays.

The door of the room: front ends import from here (``from tqbench.sessions import Session``).

- ``schema``: the format name and version, ``RunSide`` / ``RunRecord``, their JSON + array layout, migration
  of older versions;
- ``store``: ``Session``, its atomic save and load, ``save_session``, ``read_header``, ``list_sessions``, paths;
- ``recorder``: ``RunRecorder`` (from the engine's events), ``record_from_validation``, ``restore_token_texts``;
- ``diff``: ``diff_runs`` (a re-run against its saved record);
- ``kept``: the policies a user kept in the workbench.
"""

from tqbench.sessions.diff import RunDiff, diff_runs
from tqbench.sessions.kept import kept_policies_path, load_kept_policies, save_kept_policies
from tqbench.sessions.recorder import RunRecorder, record_from_validation, restore_token_texts
from tqbench.sessions.schema import FORMAT, SUFFIX, VERSION, RunRecord, RunSide, migrate, now_iso
from tqbench.sessions.store import (
    Session,
    SessionEntry,
    SessionError,
    data_dir,
    default_session_path,
    environment,
    list_sessions,
    new_session_path,
    read_header,
    save_session,
    session_dir,
)

__all__ = [
    "FORMAT", "SUFFIX", "VERSION", "RunDiff", "RunRecord", "RunRecorder", "RunSide", "Session", "SessionEntry",
    "SessionError", "data_dir", "default_session_path", "diff_runs", "environment", "kept_policies_path",
    "list_sessions", "load_kept_policies", "migrate", "new_session_path", "now_iso", "read_header", "record_from_validation",
    "restore_token_texts", "save_kept_policies", "save_session", "session_dir",
]
