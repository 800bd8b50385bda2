"""The KV cache types of the engines people deploy on, by the names those engines use, and their tqbench codecs.

``engine_setting("llamacpp:q8_0/q4_0")`` -> ``("q8_0", "q4_0")`` (K, V); ``"llamacpp:q4_0"`` gives both;
``"vllm:fp8"`` -> ``("fp8_e4m3", "fp8_e4m3")``. The policy language reads these names (``parse_policy``), and
``tqbench.engine.deploy`` maps a policy back onto them.

What each engine's name means (read in the engines' sources, see docs):
- llama.cpp ``-ctk/-ctv`` (``--cache-type-k/-v``): f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1.
- vLLM ``--kv-cache-dtype`` (0.34): ``fp8`` is ``fp8_e4m3``; the scale is the checkpoint's ``k_scale`` /
  ``v_scale``, 1.0 when it has none (tqbench's static ``fp8_e4m3``). Its TurboQuant presets (0.33) store K and V
  differently (``ENGINE_KV_PAIRS``, ``codecs.vllm_tq``): ``turboquant_k8v4`` fp8 keys + 4-bit uniform values,
  ``turboquant_4bit_nc`` / ``turboquant_k3v4_nc`` / ``turboquant_3bit_nc`` Hadamard + Lloyd-Max keys with norm
  correction and 4/4, 4/3, 3/3-bit values; vLLM also keeps the first and last 2 layers at the model's dtype.
- SGLang ``--kv-cache-dtype`` (0.5.23): ``fp8_e4m3``, ``fp8_e5m2``, scales as vLLM's; ``fp4_mx_block16`` (E2M1 in
  blocks of 16 with an exponent byte, ``codecs.fp4``).
- TensorRT-LLM ``kv_cache_config.dtype: fp8``: e4m3 with the per-tensor scale the checkpoint was calibrated
  with (ModelOpt: amax / 448): tqbench's ``fp8_e4m3-prefill`` computes that scale on the prefill instead.
"""

from __future__ import annotations

from .names import VLLM_TQ_PRESETS

__all__ = ["ENGINES", "ENGINE_KV_PAIRS", "ENGINE_KV_TYPES", "NOT_REPRODUCED", "describe_setting", "engine_setting",
           "engine_types", "is_engine_setting"]

#: engine -> {the engine's KV type name -> the tqbench codec that stores exactly what the engine stores}
ENGINE_KV_TYPES: dict[str, dict[str, str]] = {
    "llamacpp": {
        "f32": "fp32", "f16": "fp16", "bf16": "bf16", "q8_0": "q8_0", "q5_1": "q5_1", "q5_0": "q5_0",
        "q4_1": "q4_1", "q4_0": "q4_0", "iq4_nl": "iq4_nl",
    },
    "vllm": {
        "auto": "fp16", "float16": "fp16", "bfloat16": "bf16", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3",
        "fp8_e5m2": "fp8_e5m2",
    },
    "sglang": {"auto": "fp16", "bf16": "bf16", "bfloat16": "bf16", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2",
               "fp4_mx_block16": "fp4_mx_block16"},
    "trtllm": {"auto": "fp16", "fp8": "fp8_e4m3-prefill"},
}
ENGINES = tuple(ENGINE_KV_TYPES)
#: engine -> {a type name that sets K and V to different codecs -> (K codec, V codec)}
ENGINE_KV_PAIRS: dict[str, dict[str, tuple[str, str]]] = {"vllm": dict(VLLM_TQ_PRESETS)}
#: the engine type names each engine accepts that tqbench does not store bit-exactly (said, never guessed)
NOT_REPRODUCED: dict[str, dict[str, str]] = {
    "vllm": {
        "nvfp4": "NVFP4 blocks are not a tqbench codec yet",
        "fp8_inc": "Intel Gaudi's fp8 is not reproduced",
        "int8_per_token_head": "not reproduced", "int4_per_token_head": "not reproduced",
        "fp8_per_token_head": "not reproduced",
    },
    "sglang": {"nvfp4": "NVFP4 blocks are not a tqbench codec yet (their quantizer is a flashinfer kernel)",
               "mxfp8": "not reproduced"},
    "trtllm": {"nvfp4": "NVFP4 blocks are not a tqbench codec yet", "int8": "TensorRT-LLM's int8 KV (per-tensor "
               "scale) is not reproduced"},
}
_FLAGS = {"llamacpp": "llama.cpp -ctk {k} -ctv {v}", "vllm": "vLLM --kv-cache-dtype {k}",
          "sglang": "SGLang --kv-cache-dtype {k}", "trtllm": "TensorRT-LLM kv_cache_config.dtype {k}"}
_ENGINE_ALIASES = {"llama.cpp": "llamacpp", "llama-cpp": "llamacpp", "tensorrt-llm": "trtllm",
                   "tensorrt_llm": "trtllm", "trt-llm": "trtllm"}


def canonical_engine(name: str) -> str:
    key = name.strip().lower()
    key = _ENGINE_ALIASES.get(key, key)
    if key not in ENGINE_KV_TYPES:
        raise ValueError(f"unknown engine {name!r}: valid engines are {', '.join(ENGINES)}")
    return key


def is_engine_setting(text: str) -> bool:
    """True when ``text`` has the ``engine:type`` form (whether or not the names are valid)."""
    return isinstance(text, str) and ":" in text and "=" not in text.split(":", 1)[0]


def engine_types(engine: str) -> tuple[str, ...]:
    """Every type name of ``engine`` tqbench reproduces (one codec for K and V, then K/V pairs)."""
    return (*ENGINE_KV_TYPES[engine], *ENGINE_KV_PAIRS.get(engine, {}))


def _codec(engine: str, kind: str, text: str, role: int = 0) -> str:
    types = ENGINE_KV_TYPES[engine]
    key = kind.strip().lower()
    if key in types:
        return types[key]
    if key in ENGINE_KV_PAIRS.get(engine, {}):
        return ENGINE_KV_PAIRS[engine][key][role]
    why = NOT_REPRODUCED.get(engine, {}).get(key)
    if why:
        raise ValueError(f"{text!r}: {engine}'s {key} is not reproduced here ({why}); types tqbench reproduces "
                         f"for {engine}: {', '.join(engine_types(engine))}")
    raise ValueError(f"{text!r}: {key!r} is not a {engine} KV type: valid {engine} types are "
                     f"{', '.join(engine_types(engine))}")


def engine_setting(text: str) -> tuple[str, str]:
    """``"engine:K/V"`` or ``"engine:T"`` -> the tqbench codecs ``(k, v)``; ValueError naming the valid ones."""
    engine, _, kinds = text.strip().partition(":")
    engine = canonical_engine(engine)
    parts = kinds.split("/")
    if not kinds or len(parts) > 2 or not all(p.strip() for p in parts):
        raise ValueError(f"{text!r}: write {engine}:TYPE (K and V) or {engine}:K_TYPE/V_TYPE, with types from "
                         f"{', '.join(engine_types(engine))}")
    if len(parts) == 2 and any(p.strip().lower() in ENGINE_KV_PAIRS.get(engine, {}) for p in parts):
        raise ValueError(f"{text!r}: {engine}'s {', '.join(ENGINE_KV_PAIRS[engine])} set K and V together: write "
                         f"{engine}:TYPE")
    k = _codec(engine, parts[0], text, 0)
    v = _codec(engine, parts[-1], text, 1)
    return k, v


def describe_setting(text: str) -> str:
    """One line for an engine setting: ``llamacpp:q8_0/q4_0`` -> "llama.cpp -ctk q8_0 -ctv q4_0: ..."."""
    engine_setting(text)  # validates
    engine, _, kinds = text.strip().lower().partition(":")
    engine = canonical_engine(engine)
    parts = kinds.split("/")
    flags = _FLAGS[engine].format(k=parts[0].strip(), v=parts[-1].strip())
    k, _ = engine_setting(text)
    if parts[0].strip() in ENGINE_KV_PAIRS.get(engine, {}):
        return (f"{flags}: the engine's own K/V bytes, bit-exact (storage only: its Triton/CUDA attention kernels "
                "do not run here; vLLM also keeps the first and last 2 layers unquantized, which this setting "
                "alone does not)")
    if k.endswith("-prefill"):
        return (f"{flags}: the engine's fp8 bytes, with a per-tensor scale computed on the prefill (the engine "
                "takes the checkpoint's calibrated one)")
    scale = " with scale 1.0 (no checkpoint scales)" if k.startswith("fp8_") else ""
    return f"{flags}: the engine's own KV storage{scale}, bit-exact (no sinks, no recent window)"
