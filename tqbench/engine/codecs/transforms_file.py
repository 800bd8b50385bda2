"""The fitted calibrated transforms of one model: one safetensors file (tensors + metadata), and the rule that
refuses a file fitted on another model.

Tensors (``L`` layers, ``H`` KV heads, ``D`` head dim, ``G = D / GROUP``): ``k.basis`` ``[L, H, D, D]`` int8,
``k.scale`` ``[L, H, D]`` fp16, ``k.var`` ``[L, H, D]`` fp32, ``k.levels`` ``[L, H, G, 126]`` fp16, ``k.mse``
``[L, H, G, 7]`` fp32 (``calibrated_fit``). Metadata: ``format``, ``model``, ``fingerprint``, ``num_layers``,
``kv_heads``, ``head_dim``, ``calibration`` (the texts and token counts it was fitted on), ``ridge``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

from tqbench.constants import PACKAGE_DATA_DIR
from tqbench.engine.atomic import atomic_write, check_output_path

__all__ = [
    "DEFAULT_TRANSFORMS",
    "FORMAT",
    "CalibratedTransforms",
    "TransformsMismatch",
    "load_transforms",
    "resolve_transforms_path",
    "save_transforms",
]

FORMAT = "tqbench-transforms/1"
TRANSFORMS_DIR = PACKAGE_DATA_DIR / "transforms"
#: the fit shipped for the default model (SmolLM2-135M-Instruct), used when a policy names no ``calib=`` file
DEFAULT_TRANSFORMS = TRANSFORMS_DIR / "smollm2-135m-instruct.safetensors"
#: how to fit transforms (the front end that runs the calibrate job names its own command)
_CALIBRATE = "with the calibrate job (tqbench calibrate) into FILE.safetensors"
_FIELDS = ("basis", "scale", "var", "levels", "mse")


class TransformsMismatch(ValueError):
    """A transforms file used on a model it was not fitted on (or a file that is not one)."""


@dataclass
class CalibratedTransforms:
    model: str
    fingerprint: str
    num_layers: int
    kv_heads: int
    head_dim: int
    tensors: dict[str, torch.Tensor]  # "k.basis", ... (see the module docstring)
    calibration: list = field(default_factory=list)  # [{"text": name, "tokens": n}, ...]
    ridge: float = 1e-4
    path: str | None = None

    @property
    def digest(self) -> str:
        """Short content id (the basis bytes): names the shared objects a cache counts once per layer."""
        if "_digest" not in self.__dict__:
            self.__dict__["_digest"] = hashlib.sha256(
                self.tensors["k.basis"].contiguous().numpy().tobytes()).hexdigest()[:10]
        return self.__dict__["_digest"]

    def head(self, layer: int, role: str = "k") -> dict[str, torch.Tensor]:
        """The fitted tensors of one layer (all KV heads): ``basis [H, D, D]``, ``scale``, ``var``, ``levels``, ``mse``."""
        if not 0 <= layer < self.num_layers:
            raise TransformsMismatch(f"the calibrated transforms ({self.describe()}) have no layer {layer}: they "
                                     f"were fitted on a model with {self.num_layers} layers")
        return {name: self.tensors[f"{role}.{name}"][layer] for name in _FIELDS}

    def describe(self) -> str:
        where = f" from {self.path}" if self.path else ""
        return f"fitted on {self.model} (fingerprint {self.fingerprint}){where}"

    def check_geometry(self, kv_heads: int, head_dim: int) -> None:
        if (kv_heads, head_dim) != (self.kv_heads, self.head_dim):
            raise TransformsMismatch(
                f"the calibrated transforms were {self.describe()} with {self.kv_heads} KV heads x head_dim "
                f"{self.head_dim}, but this model hands the cache {kv_heads} x {head_dim}: fit transforms for "
                f"this model {_CALIBRATE} and pass calib=FILE"
            )

    def check_model(self, fingerprint: str | None, name: str | None = None) -> None:
        """Refuse a model with another fingerprint (say which, and how to refit)."""
        if fingerprint is not None and self.fingerprint and fingerprint != self.fingerprint:
            raise TransformsMismatch(
                f"the calibrated transforms were {self.describe()}, not on this model "
                f"({name or 'model'}, fingerprint {fingerprint}): they would quantize its keys in the wrong basis; "
                f"fit transforms for this model {_CALIBRATE} and use calib=FILE in the policy"
            )

    def to_dict(self) -> dict:
        return {"format": FORMAT, "model": self.model, "fingerprint": self.fingerprint,
                "num_layers": self.num_layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "calibration": self.calibration, "ridge": self.ridge, "path": self.path, "digest": self.digest,
                "bytes": os.path.getsize(self.path) if self.path and os.path.exists(self.path) else None}


def save_transforms(tr: CalibratedTransforms, path: str | os.PathLike) -> Path:
    from safetensors.torch import save

    path = check_output_path(path, ".safetensors", "transforms file")
    meta = {"format": FORMAT, "model": tr.model, "fingerprint": tr.fingerprint, "num_layers": str(tr.num_layers),
            "kv_heads": str(tr.kv_heads), "head_dim": str(tr.head_dim), "ridge": repr(tr.ridge),
            "calibration": json.dumps(tr.calibration)}
    atomic_write(path, save({k: v.contiguous() for k, v in tr.tensors.items()}, metadata=meta))
    tr.path = str(path)
    load_transforms.cache_clear()
    return path


def resolve_transforms_path(calib: str | os.PathLike | None) -> Path:
    """``calib`` ("" / None = the shipped default) as an existing file path; ValueError naming what to do."""
    if not calib:
        if not DEFAULT_TRANSFORMS.is_file():
            raise ValueError(f"the shipped transforms file {DEFAULT_TRANSFORMS} is missing: reinstall tqbench, or "
                             f"fit one {_CALIBRATE} and pass calib=FILE")
        return DEFAULT_TRANSFORMS
    path = Path(calib)
    if not path.is_file() and (TRANSFORMS_DIR / path).is_file():
        path = TRANSFORMS_DIR / path
    if not path.is_file():
        raise ValueError(f"calibrated transforms file {str(calib)!r} does not exist: fit one {_CALIBRATE}, "
                         "or leave calib unset for the "
                         "shipped SmolLM2-135M-Instruct fit")
    return path


def load_transforms(calib: str | os.PathLike | None = None) -> CalibratedTransforms:
    """The transforms in ``calib`` (cached per file path and modification time)."""
    path = resolve_transforms_path(calib).resolve()
    return _load(str(path), path.stat().st_mtime_ns)


@lru_cache(maxsize=8)
def _load(path: str, _mtime: int) -> CalibratedTransforms:
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as fh:
            meta = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except Exception as exc:  # safetensors raises its own error types for a corrupt header
        raise TransformsMismatch(f"{path} is not a readable safetensors file ({exc})") from None
    if meta.get("format") != FORMAT:
        raise TransformsMismatch(f"{path} is not a tqbench transforms file (format {meta.get('format')!r}, "
                                 f"expected {FORMAT!r}): fit one {_CALIBRATE}")
    missing = [f"k.{n}" for n in _FIELDS if f"k.{n}" not in tensors]
    if missing:
        raise TransformsMismatch(f"{path} lacks tensors {', '.join(missing)}")
    try:
        return CalibratedTransforms(meta["model"], meta["fingerprint"], int(meta["num_layers"]),
                                    int(meta["kv_heads"]), int(meta["head_dim"]), tensors,
                                    json.loads(meta.get("calibration", "[]")), float(meta.get("ridge", "1e-4")), path)
    except KeyError as exc:
        raise TransformsMismatch(f"{path}: its metadata lacks {exc}: fit it again with "
                                 f"{_CALIBRATE}") from None
    except ValueError as exc:  # a number that does not parse, or calibration that is not JSON
        raise TransformsMismatch(f"{path}: its metadata does not parse ({exc}): fit it again with "
                                 f"{_CALIBRATE}") from None


load_transforms.cache_clear = _load.cache_clear  # type: ignore[attr-defined]
