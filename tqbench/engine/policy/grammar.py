"""The compact text form of a policy: ``k=turbo4,v=turbo3,sink=4,recent=32,protect=first2+last2``, a preset name
may lead (``turbo4,recent=64``), per-layer overrides ``v@last8=int8`` / ``kv@0-3=fp16``; presets and engine settings
(``llamacpp:q8_0/q4_0``) by name."""

from __future__ import annotations

from dataclasses import replace

from tqbench.engine.codecs.engine_formats import ENGINE_KV_TYPES, engine_setting, is_engine_setting
from tqbench.engine.policy.keep import parse_keep
from tqbench.engine.policy.presets import PRESET_TEXT, shipped_policy_names
from tqbench.engine.policy.spec import _ROLES, Policy

_BOOL = {"on": True, "true": True, "1": True, "yes": True, "off": False, "false": False, "0": False, "no": False}
_INT_KEYS = ("sink", "recent", "srecent", "group", "kblock", "seed", "window", "chunk", "every")
_STR_KEYS = ("protect", "bypass", "sliding", "rotation", "name", "calib", "score", "demote", "heads", "budget")
_BOOL_KEYS = ("center", "vcenter", "normfix")
_FLOAT_KEYS = ("sparsev", "ada_floor")
_VALID_KEYS = ("k", "v", "kv", *_INT_KEYS, *_FLOAT_KEYS, *_STR_KEYS, *_BOOL_KEYS, "keep", "k@<layers>", "v@<layers>",
               "kv@<layers>", "keep@<layers>",
               "demote@<layers>")


def split_policies(text: str) -> list[str]:
    """Several policies in one text. ``;`` always separates policies. Within a ``;`` part, ``,`` separates policies
    only when no element is ``key=value`` (``fp16,turbo4``: names of presets, shipped policies, engine settings or
    files); a part with any ``key=value`` is one compact policy (``k=turbo4,v=turbo3,sink=4``), never fragments."""
    out: list[str] = []
    for part in text.split(";"):
        items = [p.strip() for p in part.split(",") if p.strip()]
        if any("=" in item for item in items):
            out.append(part.strip())
        else:
            out.extend(items)
    return out


def parse_compact(text: str) -> Policy:
    text = text.strip()
    if not text:
        raise ValueError("empty policy: give a preset name or k=...,v=...")
    items = [p.strip() for p in text.split(",") if p.strip()]
    base = Policy()
    if "=" not in items[0]:
        base = get_preset(items[0])
        items = items[1:]
    kw: dict = {}
    overrides = list(base.overrides)
    given: dict[str, str] = {}  # field (or override key) -> the part that set it: a key given twice is refused
    for item in items:
        if "=" not in item:
            raise ValueError(f"policy part {item!r} is not key=value (several policies? put ';' between them): "
                             f"valid keys are {', '.join(_VALID_KEYS)}")
        key, val = (s.strip() for s in item.split("=", 1))
        key = key.lower()
        for field_ in (("k", "v") if key == "kv" else (key.replace(" ", ""),)):
            if field_ in given:
                raise ValueError(f"policy {text!r} sets {field_} twice ({given[field_]} and {item}): give each key "
                                 "once")
            given[field_] = item
        if "@" in key:
            role, sel = key.split("@", 1)
            if role not in _ROLES:
                raise ValueError(f"policy part {item!r}: override must start with k@, v@, kv@, keep@ or "
                                 "demote@")
            overrides.append((role, sel, val))
        elif key in ("k", "v"):
            kw[key] = val
        elif key == "kv":
            kw["k"] = kw["v"] = val
        elif key == "keep":
            kw[key] = parse_keep(val)
        elif key in _INT_KEYS:
            try:
                kw[key] = int(val)
            except ValueError:
                raise ValueError(f"policy part {item!r}: {key} must be a whole number") from None
        elif key in _FLOAT_KEYS:
            try:
                kw[key] = float(val)
            except ValueError:
                raise ValueError(f"policy part {item!r}: {key} must be a number such as "
                                 f"{'0.2' if key == 'ada_floor' else '0.001'}") from None
        elif key in _BOOL_KEYS:
            if val.lower() not in _BOOL:
                raise ValueError(f"policy part {item!r}: {key} must be on or off")
            kw[key] = _BOOL[val.lower()]
        elif key in _STR_KEYS:
            kw[key] = "" if (key in ("protect", "demote") and val.lower() == "none") else val
        else:
            raise ValueError(f"unknown policy key {key!r} in {item!r}: valid keys are {', '.join(_VALID_KEYS)}")
    name = kw.pop("name", None)
    pol = replace(base, overrides=tuple(overrides), **kw)
    if name is not None:
        return pol.with_name(name)
    if pol == base:  # keys that change nothing (turbo4,keep=1): still that preset, under its name
        return base
    return pol.with_name(None)  # a changed preset is no longer that preset: label by its string


def engine_policy(text: str) -> Policy:
    """An engine's own KV setting as a policy: ``llamacpp:q8_0/q4_0`` (K/V), ``llamacpp:q4_0`` (both),
    ``vllm:fp8``: those codecs on every layer, no sinks, no recent window (the engines keep none). vLLM's
    TurboQuant presets keep the first and last 2 layers at the model's dtype, as vLLM does (``protect``)."""
    from tqbench.engine.codecs.names import BOUNDARY_LAYERS, VLLM_TQ_PRESETS

    k, v = engine_setting(text)
    engine, _, kinds = text.strip().lower().partition(":")
    n = BOUNDARY_LAYERS
    protect = f"first{n}+last{n}" if engine == "vllm" and kinds.strip() in VLLM_TQ_PRESETS else ""
    return Policy(k=k, v=v, protect=protect).with_name(f"{engine}:{kinds.strip()}")


def get_preset(name: str) -> Policy:
    if is_engine_setting(name):
        return engine_policy(name)
    if name not in PRESET_TEXT:
        shipped = shipped_policy_names()
        raise ValueError(
            f"unknown policy preset {name!r}: valid presets are {', '.join(PRESET_TEXT)}"
            + (f" (shipped policy files: {', '.join(shipped)})" if shipped else "")
            + f"; or an engine's KV setting ENGINE:TYPE or ENGINE:K_TYPE/V_TYPE ({', '.join(ENGINE_KV_TYPES)}), "
            "e.g. llamacpp:q8_0/q4_0, vllm:fp8"
        )
    return parse_compact(PRESET_TEXT[name][0]).with_name(name)
