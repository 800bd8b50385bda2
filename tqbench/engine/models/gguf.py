"""GGUF models: convert a ``.gguf`` file once into a float32 safetensors folder in the user cache.

The folder (``TQBENCH_CACHE_DIR`` or ``platformdirs``) is written to a temporary folder and renamed into
place, so later loads take a second or two and a crashed conversion never leaves a half folder behind.
transformers' GGUF reading is patched for the duration of a conversion (quieter, about twice as fast).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tqbench.engine.models.errors import ModelLoadError
from tqbench.engine.models.progress import ProgressFn, notify
from tqbench.engine.models.resolve import ResolvedModel, models_cache_dir


def converted_dir(source: ResolvedModel) -> Path:
    """The cached safetensors folder for a GGUF source, keyed by file name, size and mtime."""
    if source.gguf_path is None:
        raise ValueError(f"{source.display_name} is not a GGUF model")
    st = source.gguf_path.stat()
    key = hashlib.sha256(f"{source.gguf_file}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:10]
    return models_cache_dir() / f"{Path(source.gguf_file).stem}-{key}"


@contextlib.contextmanager
def _patched_gguf_loading(on_progress: ProgressFn | None) -> Iterator[None]:
    """Make transformers' GGUF loading quieter and about twice as fast, for the duration of a conversion.

    transformers parses the GGUF metadata once per call (config, weights, tokenizer config, tokenizer: four
    ``GGUFReader``s of ~6 s each for SmolLM2) and rebuilds gguf's tensor-name map for every module (~9 s).
    Both are memoized here (same output, measured: 30 s -> 15 s). The dequantization loop's bare tqdm bar is
    routed to ``on_progress``. Everything is restored on exit; the cached readers are released.
    """
    import gguf
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    saved = {
        (gguf, "GGUFReader"): gguf.GGUFReader,
        (gguf, "get_tensor_name_map"): gguf.get_tensor_name_map,
        (gguf_utils, "tqdm"): getattr(gguf_utils, "tqdm", None),
    }
    readers: dict[tuple, Any] = {}

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = saved[gguf, "GGUFReader"](path, mode)
        return readers[key]

    def report(items, desc: str = "", **_: Any):
        items = list(items)
        marks = {max(1, round(len(items) * q / 4)) for q in range(1, 5)}
        for i, item in enumerate(items, 1):
            yield item
            if i in marks:
                notify(on_progress, f"Dequantizing GGUF tensors: {i}/{len(items)}")

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(saved[gguf, "get_tensor_name_map"])
    if saved[gguf_utils, "tqdm"] is not None:
        gguf_utils.tqdm = report
    try:
        yield
    finally:
        for (module, attr), value in saved.items():
            if value is not None:
                setattr(module, attr, value)
        readers.clear()


def _remove_stale_temps(target: Path, max_age_s: float = 3600.0) -> None:
    """Delete temp folders left by a conversion that was killed (old enough not to be in progress)."""
    for tmp in target.parent.glob(f".{target.name}.tmp-*"):
        with contextlib.suppress(OSError):
            if time.time() - tmp.stat().st_mtime > max_age_s:
                shutil.rmtree(tmp, ignore_errors=True)


def _convert_gguf(source: ResolvedModel, out: Path, on_progress: ProgressFn | None) -> None:
    """Dequantize ``source`` to float32 and save model + tokenizer into ``out`` (an empty folder)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = source.path_or_id, source.gguf_file
    notify(on_progress, "Reading GGUF metadata and weights ...")
    try:
        with _patched_gguf_loading(on_progress):
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
            notify(on_progress, "Reading GGUF tokenizer ...")
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as exc:
        raise ModelLoadError(f"Could not read {source.gguf_path}: {type(exc).__name__}: {exc}") from exc
    model.hf_quantizer = None  # save_pretrained refuses a model still marked as GGUF-quantized
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    notify(on_progress, "Saving the float32 folder ...")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    st = source.gguf_path.stat()
    info = {"gguf": str(source.gguf_path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    (out / "tqbench_source.json").write_text(json.dumps(info, indent=2))


def ensure_converted(source: ResolvedModel, on_progress: ProgressFn | None = None) -> Path:
    """Return the cached float32 safetensors folder for a GGUF source, converting it once if needed.

    The conversion writes into a temporary sibling folder that is renamed into place only when complete.
    """
    target = converted_dir(source)
    if (target / "config.json").is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    except OSError as exc:
        raise ModelLoadError(
            f"Cannot write the model cache {target.parent} ({exc}): set TQBENCH_CACHE_DIR to a writable dir"
        ) from exc
    _remove_stale_temps(target)
    start = time.perf_counter()
    notify(on_progress, f"Converting {source.gguf_file} to a float32 folder (once, ~20 s) ...")
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cached model is an ordinary folder
        _convert_gguf(source, tmp, on_progress)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # else another process won the race: keep theirs
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    notify(on_progress, f"Converted in {time.perf_counter() - start:.1f} s -> {target}")
    return target
