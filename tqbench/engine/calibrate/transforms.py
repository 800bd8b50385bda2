"""Fit the ``pcaq`` key transforms of a model: capture real K and Q per layer on calibration texts
(``engine.scan.capture``), center each text's keys per head (as the cache's key centering does at run time),
and fit per (layer, KV head) the metric PCA, variances and Lloyd-Max level tables (``codecs.calibrated_fit``).

Calibration texts: the shipped mix ``tqbench/data/calibration/{prose,code,legal,chat}.txt`` (never used to
verify); held-out texts of other kinds are in ``tqbench/data/heldout/`` and ``tqbench/data/corpus/``.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from tqbench.constants import CORPUS_DIR, PACKAGE_DATA_DIR
from tqbench.engine.codecs.calibrated_fit import fit_head
from tqbench.engine.codecs.transforms_file import CalibratedTransforms
from tqbench.engine.events import CancelFlag, OnEvent, Progress, emit, raise_if_cancelled
from tqbench.engine.scan.capture import LayerQKV, capture_qkv

CALIBRATION_DIR = PACKAGE_DATA_DIR / "calibration"
HELDOUT_DIR = PACKAGE_DATA_DIR / "heldout"
DEFAULT_MIX = ("prose", "code", "legal", "chat")


def calibration_texts() -> list[str]:
    return sorted(p.stem for p in CALIBRATION_DIR.glob("*.txt"))


def text_path(name: str) -> Path:
    """A text by name: ``calibration/NAME``, ``heldout:NAME``, ``corpus:NAME`` (or a file path)."""
    if Path(name).is_file():
        return Path(name)
    kind, _, stem = name.rpartition(":")
    folder = {"": CALIBRATION_DIR, "calibration": CALIBRATION_DIR, "heldout": HELDOUT_DIR,
              "corpus": CORPUS_DIR}.get(kind)
    path = folder / f"{stem}.txt" if folder is not None else None
    if path is None or not path.is_file():
        raise ValueError(f"calibration text {name!r} is not a file nor a shipped text: valid names are "
                         f"{', '.join(calibration_texts())} (the calibration mix), or a path to a UTF-8 text file")
    return path


def fit_from_layers(captures: list[dict[int, LayerQKV]], *, model: str, fingerprint: str, ridge: float = 1e-4,
                    calibration: list | None = None, cancel: CancelFlag | None = None) -> CalibratedTransforms:
    """Fit from captured layers of one or more texts (``Capture.layers`` dicts, every layer present in each)."""
    if not captures:
        raise ValueError("fit_from_layers needs at least one capture")
    layers = sorted(captures[0])
    if layers != list(range(len(layers))):
        raise ValueError(f"calibrated transforms need every layer captured, got layers {layers}")
    first = captures[0][0]
    heads, d = first.k.shape[0], first.k.shape[-1]
    group = first.q.shape[0] // heads
    out: dict[str, list] = {n: [] for n in ("basis", "scale", "var", "levels", "mse")}
    for layer in layers:
        raise_if_cancelled(cancel, "calibrate")
        per_head: dict[str, list] = {n: [] for n in out}
        for h in range(heads):
            k = torch.cat([c[layer].k[h] - c[layer].k[h].mean(0, keepdim=True) for c in captures])
            q = torch.cat([c[layer].q[h * group:(h + 1) * group].reshape(-1, d) for c in captures])
            fit = fit_head(k, q, ridge)
            for n in out:
                per_head[n].append(fit[n])
        for n in out:
            out[n].append(torch.stack(per_head[n]))
    tensors = {f"k.{n}": torch.stack(v) for n, v in out.items()}
    return CalibratedTransforms(model, fingerprint, len(layers), heads, d, tensors, calibration or [], ridge)


def fit_transforms(engine, texts=DEFAULT_MIX, *, max_tokens: int = 1024, ridge: float = 1e-4,
                   on_event: OnEvent | None = None, cancel: CancelFlag | None = None) -> CalibratedTransforms:
    """Capture every layer's Q/K on each text (its first ``max_tokens`` tokens, no chat template) and fit."""
    if not texts:
        raise ValueError("no calibration texts given: use e.g. prose,code,legal,chat")
    captures, used = [], []
    t0 = time.perf_counter()
    for i, name in enumerate(texts):
        raise_if_cancelled(cancel, "calibrate")
        path = text_path(name)
        emit(on_event, Progress("calibrate", i, len(texts) + 1, f"capturing Q/K on {name}"))
        cap = capture_qkv(engine, path.read_text(encoding="utf-8"), None, max_tokens, 0, chat=False, cancel=cancel)
        captures.append(cap.layers)
        used.append({"text": name, "tokens": len(cap.token_ids)})
    emit(on_event, Progress("calibrate", len(texts), len(texts) + 1, "fitting transforms"))
    tr = fit_from_layers(captures, model=engine.name, fingerprint=engine.loaded.fingerprint, ridge=ridge,
                         calibration=used, cancel=cancel)
    emit(on_event, Progress("calibrate", len(texts) + 1, len(texts) + 1,
                            f"fitted {tr.num_layers} layers x {tr.kv_heads} heads in {time.perf_counter() - t0:.0f}s"))
    return tr


def save_beside(policy, toml_path) -> tuple:
    """For a policy artifact written to ``toml_path``: when ``policy`` uses calibrated key codecs, copy its
    transforms file next to the TOML (``<stem>.transforms.safetensors``) and return ``(policy with calib set
    to that file name, the copied path)``; ``load_policy_file`` resolves the name against the TOML's folder.
    Otherwise ``(policy, None)``."""
    import shutil
    from dataclasses import replace

    from tqbench.engine.codecs import is_calibrated_spec
    from tqbench.engine.codecs.transforms_file import resolve_transforms_path

    specs = (policy.k, *(spec for role, _, spec in policy.overrides if role in ("k", "kv")))
    if not any(is_calibrated_spec(part) for s in specs for part in str(s).split("|")):  # head lists too
        return policy, None
    src = resolve_transforms_path(policy.calib)
    dst = Path(toml_path).with_suffix(".transforms.safetensors")
    if src.resolve() != dst.resolve():
        shutil.copyfile(src, dst)
    return replace(policy, calib=dst.name), dst
