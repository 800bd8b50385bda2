"""The KV cache types of the engines people deploy on, by the names those engines use, and their tqbench codecs.

``engine_setting("llamacpp:q8_0/q4_0")`` -> ``("q8_0", "q4_0")`` (K, V); ``"llamacpp:q4_0"`` gives both;
``"vllm:fp8"`` -> ``("fp8_e4m3", "fp8_e4m3")``. The policy language reads these names (``parse_policy``), and
``tqbench.engine.deploy`` maps a policy back onto them.

What each engine's name means (read in the engines' sources, see docs):
- llama.cpp ``-ctk/-ctv`` (``--cache-type-k/-v``): f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1.
- vLLM ``--kv-cache-dtype`` (0.34): ``fp8`` is ``fp8_e4m3``; the scale is the checkpoint's ``k_scale`` /
  ``v_scale``, 1.0 when it has none (tqbench's static ``fp8_e4m3``).
- SGLang ``--kv-cache-dtype`` (0.5.23): ``fp8_e4m3``, ``fp8_e5m2``, scales as vLLM's; ``fp4_mx_block16`` (E2M1 in
  blocks of 16 with an exponent byte, ``codecs.fp4``).
- TensorRT-LLM ``kv_cache_config.dtype: fp8``: e4m3 with the per-tensor scale the checkpoint was calibrated
  with (ModelOpt: amax / 448): tqbench's ``fp8_e4m3-prefill`` computes that scale on the prefill instead.
"""

from __future__ import annotations

__all__ = ["ENGINES", "ENGINE_KV_TYPES", "NOT_REPRODUCED", "describe_setting", "engine_setting", "is_engine_setting"]

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
#: the engine type names each engine accepts that tqbench does not store bit-exactly (said, never guessed)
NOT_REPRODUCED: dict[str, dict[str, str]] = {
    "vllm": {
        **{t: "vLLM's TurboQuant layout (Hadamard rotation, Lloyd-Max keys or fp8 keys, uniform 3/4-bit values "
              "with fp16 scale+zero, first/last 2 layers skipped): the closest tqbench policy is turbo keys "
              "and int values, not bit-exact"
           for t in ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")},
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


def _codec(engine: str, kind: str, text: str) -> str:
    types = ENGINE_KV_TYPES[engine]
    key = kind.strip().lower()
    if key in types:
        return types[key]
    why = NOT_REPRODUCED.get(engine, {}).get(key)
    if why:
        raise ValueError(f"{text!r}: {engine}'s {key} is not reproduced here ({why}); types tqbench reproduces "
                         f"for {engine}: {', '.join(types)}")
    raise ValueError(f"{text!r}: {key!r} is not a {engine} KV type: valid {engine} types are {', '.join(types)}")


def engine_setting(text: str) -> tuple[str, str]:
    """``"engine:K/V"`` or ``"engine:T"`` -> the tqbench codecs ``(k, v)``; ValueError naming the valid ones."""
    engine, _, kinds = text.strip().partition(":")
    engine = canonical_engine(engine)
    parts = kinds.split("/")
    if not kinds or len(parts) > 2 or not all(p.strip() for p in parts):
        raise ValueError(f"{text!r}: write {engine}:TYPE (K and V) or {engine}:K_TYPE/V_TYPE, with types from "
                         f"{', '.join(ENGINE_KV_TYPES[engine])}")
    k = _codec(engine, parts[0], text)
    v = _codec(engine, parts[-1], text)
    return k, v


def describe_setting(text: str) -> str:
    """One line for an engine setting: ``llamacpp:q8_0/q4_0`` -> "llama.cpp -ctk q8_0 -ctv q4_0: ..."."""
    engine_setting(text)  # validates
    engine, _, kinds = text.strip().lower().partition(":")
    engine = canonical_engine(engine)
    parts = kinds.split("/")
    flags = _FLAGS[engine].format(k=parts[0].strip(), v=parts[-1].strip())
    k, _ = engine_setting(text)
    if k.endswith("-prefill"):
        return (f"{flags}: the engine's fp8 bytes, with a per-tensor scale computed on the prefill (the engine "
                "takes the checkpoint's calibrated one)")
    scale = " with scale 1.0 (no checkpoint scales)" if k.startswith("fp8_") else ""
    return f"{flags}: the engine's own KV storage{scale}, bit-exact (no sinks, no recent window)"
