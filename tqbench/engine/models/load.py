"""Load a model: resolve the spec, convert a GGUF once if needed, load model + tokenizer in eval mode.

Hub ids load with ``local_files_only`` when the hub cannot be reached (no ~25 s of retries). Progress goes
through an optional ``on_progress(message)`` callback; the engine never prints. Import from ``tqbench.engine.models``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tqbench.engine.models.device import resolve_device, resolve_dtype
from tqbench.engine.models.errors import ModelLoadError, ModelNotFoundError
from tqbench.engine.models.families import FAMILIES, family_model
from tqbench.engine.models.fingerprint import model_config_summary, model_fingerprint
from tqbench.engine.models.gguf import ensure_converted
from tqbench.engine.models.loaded import LoadedModel
from tqbench.engine.models.progress import ProgressFn, notify
from tqbench.engine.models.resolve import DEFAULT_MODEL_ID, TINY_FAMILY_PREFIX, resolve_model
from tqbench.engine.models.tiny import tiny_model


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
    attn_implementation: str | None = None,
    on_progress: ProgressFn | None = None,
) -> LoadedModel:
    """Resolve ``spec``, convert a GGUF once if needed, and load model + tokenizer in eval mode.

    ``attn_implementation=None`` lets transformers pick the family's default (sdpa where the family supports
    it; eager for Gemma-2 and gpt-oss, whose soft-capping and sink logits SDPA cannot do)."""
    start = time.perf_counter()
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    source = resolve_model(spec)
    if source.kind == "tiny":
        if source.path_or_id == "tiny-random":
            loaded = tiny_model(dtype=torch_dtype, attn_implementation=attn_implementation or "sdpa")
        else:
            family = source.path_or_id.removeprefix(TINY_FAMILY_PREFIX)
            if family not in FAMILIES:
                raise ModelNotFoundError(f"{spec!r} is not a tiny model: use tiny, or tiny-<family> with a family "
                                         f"of {', '.join(FAMILIES)}")
            loaded = family_model(family, dtype=torch_dtype, attn_implementation=attn_implementation)
        loaded.model.to(dev)
        loaded.device, loaded.load_seconds = dev, time.perf_counter() - start
        loaded.threads = torch.get_num_threads()
        return loaded

    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _quiet_progress_bars():
        folder = ensure_converted(source, on_progress) if source.gguf_file else None
        where = str(folder) if folder else source.path_or_id
        notify(on_progress, f"Loading {source.display_name} ({torch_dtype}, {dev}) ...")
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
