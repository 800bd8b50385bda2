"""The named policy presets (compact text + meaning) and the engine settings listed beside them: data only; the
grammar (``grammar.get_preset``) turns a name into a ``Policy``."""

from __future__ import annotations

from tqbench.constants import POLICIES_DATA_DIR

#: model-specific policies shipped with the package (per-layer allocations), usable by name
SHIPPED_POLICY_DIR = POLICIES_DATA_DIR

_TURBO_TOKENS = "sink=4,recent=16"

#: name -> (compact form, meaning)
PRESET_TEXT: dict[str, tuple[str, str]] = {
    "fp16": ("k=fp16,v=fp16", "no compression: the baseline"),
    "fp16k-q8v": ("k=fp16,v=int8", "fp16 keys, int8 values (per-token groups)"),
    "boundary-fp16-fp16k-q8v": ("k=fp16,v=int8,protect=first2+last2", "fp16k-q8v, first and last 2 layers fp16"),
    "boundary-fp16-q8k-q8v": ("k=int8,v=int8,protect=first2+last2", "q8k-q8v, first and last 2 layers fp16"),
    "q8k-q8v": ("k=int8,v=int8", "int8 keys (per-channel blocks) and int8 values"),
    "fp16k-int4v": ("k=fp16,v=int4", "fp16 keys, int4 values"),
    "q8k-int4v": ("k=int8,v=int4", "int8 keys, int4 values"),
    "fp16k-int4v-last8-fp16": ("k=fp16,v=int4,protect=last8", "fp16k-int4v, the last 8 layers fp16"),
    "q8k-int4v-last8-q8v": ("k=int8,v=int4,v@last8=int8", "q8k-int4v, the last 8 layers keep int8 values"),
    "fp16k-int4v-boundary-last": ("k=fp16,v=int4,protect=last2", "fp16k-int4v, the last 2 layers fp16"),
    "q8k-turbo4v": ("k=int8,v=turbo4", "int8 keys, TurboQuant 4-bit values"),
    "turbo4": (f"k=turbo4,v=turbo4,{_TURBO_TOKENS}", "TurboQuant 4-bit K and V, centered keys, 4 sinks + 16 recent fp16"),
    "turbo3.5": (f"k=turbo3.5,v=turbo3.5,{_TURBO_TOKENS}", "TurboQuant 3.5-bit (outlier split 4/3 bits)"),
    "turbo3": (f"k=turbo3,v=turbo3,{_TURBO_TOKENS}", "TurboQuant 3-bit K and V"),
    "turbo2.5": (f"k=turbo2.5,v=turbo2.5,{_TURBO_TOKENS}", "TurboQuant 2.5-bit (outlier split 3/2 bits)"),
    "turbo2": (f"k=turbo2,v=turbo2,{_TURBO_TOKENS}", "TurboQuant 2-bit K and V"),
    "k4v2": (f"k=turbo4,v=turbo2,{_TURBO_TOKENS}", "asymmetric: 4-bit keys, 2-bit values"),
    "k3v2": (f"k=turbo3,v=turbo2,{_TURBO_TOKENS}", "asymmetric: 3-bit keys, 2-bit values"),
    "turbo4-qjl": (
        f"k=turbo4-qjl,v=turbo4,{_TURBO_TOKENS}",
        "TurboQuant-prod keys (3-bit MSE + 1-bit QJL: unbiased scores), 4-bit values",
    ),
}


#: engine settings listed beside the presets (every other type pair the engines accept parses too)
ENGINE_PRESETS = (
    "llamacpp:q8_0", "llamacpp:q8_0/q4_0", "llamacpp:q5_1", "llamacpp:q5_0", "llamacpp:q4_1", "llamacpp:q4_0",
    "llamacpp:iq4_nl", "vllm:fp8", "vllm:fp8_e5m2", "sglang:fp4_mx_block16", "trtllm:fp8",
)

PRESETS = tuple(PRESET_TEXT)


def shipped_policy_names() -> list[str]:
    """Names of the policy files shipped with the package (``tqbench/data/policies/*.toml|json``)."""
    return sorted({p.stem for ext in ("toml", "json") for p in SHIPPED_POLICY_DIR.glob(f"*.{ext}")})


def shipped_policy_path(name: str):
    """The shipped policy file named ``name`` (TOML preferred), or None."""
    for ext in ("toml", "json"):
        path = SHIPPED_POLICY_DIR / f"{name}.{ext}"
        if path.is_file():
            return path
    return None
