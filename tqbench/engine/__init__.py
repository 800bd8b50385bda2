"""The engine: codecs, policies, the compressed cache, generation. Imports torch and transformers only.

This package is the one door the front ends (CLI, TUI, server, sessions) use: ``from tqbench.engine import
Engine, parse_policy, run_validate ...``. Names load lazily, so ``import tqbench.engine`` does not import
torch; each name comes from its room's package (``tqbench.engine.policy``, ``.cache``, ``.validate``,
``.scan``, ``.models``, ``.allocate``) or from a top-level engine module (``engine``, ``generate``, ``metrics``, ``request``), never
from a module inside a room, so rooms may rearrange their modules freely.

``validate`` and ``scan`` are rooms (subpackages), so their main functions come through the door as
``run_validate`` and ``run_scan`` (a package attribute cannot be both the subpackage and a function).
"""

from __future__ import annotations

_MODELS = "tqbench.engine.models"
_POLICY = "tqbench.engine.policy"
_CACHE = "tqbench.engine.cache"
_VALIDATE = "tqbench.engine.validate"
_SCAN = "tqbench.engine.scan"
_METRICS = "tqbench.engine.metrics"
_GENERATE = "tqbench.engine.generate"
_ALLOCATE = "tqbench.engine.allocate"
_REQUEST = "tqbench.engine.request"

# public name -> (module, attribute in that module)
_LAZY: dict[str, tuple[str, str]] = {
    "Engine": ("tqbench.engine.engine", "Engine"),
    "PromptTooLongError": (_REQUEST, "PromptTooLongError"),
    "LoadedModel": (_MODELS, "LoadedModel"),
    "ResolvedModel": (_MODELS, "ResolvedModel"),
    "ModelLoadError": (_MODELS, "ModelLoadError"),
    "ModelNotFoundError": (_MODELS, "ModelNotFoundError"),
    "load_model": (_MODELS, "load_model"),
    "resolve_model": (_MODELS, "resolve_model"),
    "Policy": (_POLICY, "Policy"),
    "CheckedPolicy": (_POLICY, "CheckedPolicy"),
    "parse_policy": (_POLICY, "parse_policy"),
    "split_policies": (_POLICY, "split_policies"),
    "PRESETS": (_POLICY, "PRESETS"),
    "get_preset": (_POLICY, "get_preset"),
    "Sampling": (_REQUEST, "Sampling"),
    "GenerationRequest": (_REQUEST, "GenerationRequest"),
    "RequestError": (_REQUEST, "RequestError"),
    "check_max_new_tokens": (_REQUEST, "check_max_new_tokens"),
    "check_context": (_REQUEST, "check_context"),
    "check_prompt": (_REQUEST, "check_prompt"),
    "check_temperature": (_REQUEST, "check_temperature"),
    "check_top_p": (_REQUEST, "check_top_p"),
    "check_prefill_chunk": (_REQUEST, "check_prefill_chunk"),
    "GenerationResult": (_GENERATE, "GenerationResult"),
    "Cancelled": (_GENERATE, "Cancelled"),
    "TQCache": (_CACHE, "TQCache"),
    "CompressedDynamicCache": (_CACHE, "CompressedDynamicCache"),
    "KVGeometry": (_CACHE, "KVGeometry"),
    "estimate_kv": (_CACHE, "estimate_kv"),
    "pair_summary": (_METRICS, "pair_summary"),
    "compare_tokens": (_METRICS, "compare_tokens"),
    "decide_verdict": (_METRICS, "decide_verdict"),
    "VERDICTS": (_METRICS, "VERDICTS"),
    "run_validate": (_VALIDATE, "validate"),
    "self_test": (_VALIDATE, "self_test"),
    "teacher_forced_quality": (_VALIDATE, "teacher_forced_quality"),
    "compare_policies": (_VALIDATE, "compare_policies"),
    "needle_in_haystack": (_VALIDATE, "needle_in_haystack"),
    "run_tasks": ("tqbench.engine.tasks", "run_tasks"),
    "check_tasks": ("tqbench.engine.tasks", "check_tasks"),
    "run_scan": (_SCAN, "scan"),
    "capture_qkv": (_SCAN, "capture_qkv"),
    "allocate_policy": (_ALLOCATE, "allocate_policy"),
    "frontier": (_ALLOCATE, "frontier"),
    "save_policy_artifact": (_POLICY, "save_policy_artifact"),
    "load_policy_artifact": (_POLICY, "load_policy_artifact"),
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'tqbench.engine' has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    found = importlib.import_module(module)
    if not hasattr(found, attr):
        raise AttributeError(
            f"tqbench.engine.{name}: module {module!r} does not export {attr!r} (its __init__.py should)"
        )
    return getattr(found, attr)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
