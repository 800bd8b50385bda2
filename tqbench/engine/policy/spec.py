"""KV policies: which codec each layer's K and V get, plus token- and layer-level protection.

Three interchangeable forms:
- compact text: ``k=turbo4,v=turbo3,sink=4,recent=32,protect=first2+last2`` (a preset name may lead:
  ``turbo4,recent=64``); per-layer overrides ``v@last8=int8``, ``kv@0-3=fp16``;
- a dict (JSON / TOML file) with the same keys;
- a named preset from ``PRESETS``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace

from tqbench.constants import POLICIES_DATA_DIR
from tqbench.engine.codecs import (
    CODEC_SPECS,
    HEAD_SEP,
    canonical_spec,
    codec_from_spec,
    head_codecs,
    is_calibrated_spec,
    is_head_list,
    is_valid_spec,
)
from tqbench.engine.codecs.engine_formats import ENGINE_KV_TYPES, engine_setting, is_engine_setting
from tqbench.engine.codecs.heads import split_head_list
from tqbench.engine.policy.layers import select_layers, validate_selector
from tqbench.engine.tomlfile import read_toml

FULL_PRECISION = "fp16"
#: model-specific policies shipped with the package (per-layer allocations), usable by name
SHIPPED_POLICY_DIR = POLICIES_DATA_DIR
BYPASS_CHOICES = ("none", "global")
#: what a sliding-window layer does: compress (the policy's codecs in a window-bounded store), dense (fp16 in
#: a window-bounded store), bypass (transformers' own bounded dense window), auto (compress when every layer
#: slides, else bypass)
SLIDING_CHOICES = ("auto", "compress", "dense", "bypass")
ROTATION_CHOICES = ("qr", "hadamard")
_BOOL = {"on": True, "true": True, "1": True, "yes": True, "off": False, "false": False, "0": False, "no": False}
_ROLES = ("k", "v", "kv")


@dataclass(frozen=True)
class LayerPlan:
    """What one layer's cache does under a policy."""

    layer: int
    k: str
    v: str
    sink: int
    recent: int
    reason: str | None = None  # why this layer differs from the policy's default codecs
    dense_window: bool = False  # sliding-window layer kept as transformers' own bounded dense window
    sliding: bool = False  # sliding-window layer in a window-bounded tqbench store (sliding=compress/dense)

    @property
    def compressed(self) -> bool:
        return not self.dense_window and not (self.k in DENSE_SPECS and self.v in DENSE_SPECS)


DENSE_SPECS = ("fp16", "bf16", "fp32")


@dataclass(frozen=True)
class FittedOn:
    """The model a saved policy was fitted on (an artifact's ``[model]`` table): a ``Policy`` read from such a
    file carries it, so "fitted on another model" can be checked whatever form the policy reaches the engine in
    (a path, a shipped name, or an already-parsed ``Policy``)."""

    name: str | None = None
    fingerprint: str | None = None
    num_layers: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None

    @classmethod
    def from_dict(cls, data: dict | None) -> FittedOn | None:
        if not data:
            return None
        return cls(**{k: data.get(k) for k in cls.__dataclass_fields__})

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def warning(self, fingerprint: str | None, geometry=None) -> str | None:
        """Why a policy fitted on this model may not suit a model with ``fingerprint`` (else, when only a config
        is known, with KV ``geometry``); None when it matches or nothing comparable is recorded. The one rule."""
        fitted = f"{self.name or '?'} (fingerprint {self.fingerprint or '?'})"
        if fingerprint is not None and self.fingerprint and self.fingerprint != fingerprint:
            return (f"this policy was fitted on {fitted}, not on this model (fingerprint {fingerprint}): its "
                    "allocation may not suit it; run `tqbench --headless allocate` for this model")
        if geometry is not None:
            want = (self.num_layers, self.kv_heads, self.head_dim)
            have = (geometry.num_layers, geometry.kv_heads, geometry.head_dim)
            if None not in want and want != have:
                return (f"this policy was fitted on {fitted} with {want[0]} layers x {want[1]} KV heads x "
                        f"head_dim {want[2]}, but this model has {have[0]} x {have[1]} x {have[2]}")
        return None


@dataclass(frozen=True)
class Policy:
    k: str = FULL_PRECISION
    v: str = FULL_PRECISION
    sink: int = 0
    recent: int = 0
    protect: str = ""  # layer selector whose layers keep fp16 K and V
    overrides: tuple[tuple[str, str, str], ...] = ()  # (role, selector, codec) applied in order
    bypass: str = "none"  # "global": keep full-attention layers dense in mixed sliding/full models
    sliding: str = "auto"  # sliding-window layers: see SLIDING_CHOICES
    rotation: str = "qr"
    center: bool = True  # center turbo keys per head (softmax ignores the shift)
    vcenter: bool = False  # center turbo values per head (the mean is added back exactly: sum p = 1)
    normfix: bool = True  # least-squares norm correction for turbo rows
    group: int = 32  # per-token affine group (V)
    kblock: int = 32  # per-channel affine token block (K)
    sparsev: float = 0.0  # fused mode: skip value rows whose softmax weight is below this (0 = off)
    seed: int = 0
    calib: str = ""  # calibrated (pcaq) key codecs: the transforms file ("" = the shipped default-model fit)
    name: str | None = field(default=None, compare=False)
    #: the model a saved policy file was fitted on (its ``[model]`` table); None for presets and compact text.
    #: Provenance, not part of the policy's value: not compared, not in ``to_string``/``to_dict``
    fitted_on: FittedOn | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for role in ("k", "v"):
            object.__setattr__(self, role, _check_codec(getattr(self, role), role))
        for what, val in (("sink", self.sink), ("recent", self.recent)):
            if not isinstance(val, int) or val < 0:
                raise ValueError(f"{what}={val!r} is invalid: use a whole number of tokens >= 0")
        for what, val in (("group", self.group), ("kblock", self.kblock)):
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"{what}={val!r} is invalid: use a whole number >= 1")
        if isinstance(self.sparsev, bool) or not isinstance(self.sparsev, (int, float)) or not 0 <= self.sparsev < 1:
            raise ValueError(f"sparsev={self.sparsev!r} is invalid: use a softmax-weight threshold in [0, 1), "
                             "e.g. 0.001 (0 turns Sparse-V off)")
        object.__setattr__(self, "sparsev", float(self.sparsev))
        if self.protect:
            object.__setattr__(self, "protect", validate_selector(self.protect))
        if self.bypass not in BYPASS_CHOICES:
            raise ValueError(f"bypass={self.bypass!r} is invalid: valid choices are {', '.join(BYPASS_CHOICES)}")
        if self.sliding not in SLIDING_CHOICES:
            raise ValueError(f"sliding={self.sliding!r} is invalid: valid choices are {', '.join(SLIDING_CHOICES)}")
        if self.rotation not in ROTATION_CHOICES:
            raise ValueError(
                f"rotation={self.rotation!r} is invalid: valid choices are {', '.join(ROTATION_CHOICES)}"
            )
        fixed = []
        for role, sel, spec in self.overrides:
            if role not in _ROLES:
                raise ValueError(f"override role {role!r} is invalid: use k@, v@ or kv@")
            fixed.append((role, validate_selector(sel), _check_codec(spec, role)))
        object.__setattr__(self, "overrides", tuple(fixed))

    # ---- forms ------------------------------------------------------------------------------
    def to_string(self) -> str:
        parts = [f"k={self.k}", f"v={self.v}"]
        defaults = Policy()
        for key in ("sink", "recent", "protect", "bypass", "sliding", "rotation", "center", "vcenter", "normfix",
                    "group", "kblock", "seed", "sparsev", "calib"):
            val = getattr(self, key)
            if val != getattr(defaults, key):
                parts.append(f"{key}={_fmt(val)}")
        parts += [f"{role}@{sel}={spec}" for role, sel, spec in self.overrides]
        return ",".join(parts)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("fitted_on")  # provenance: an artifact writes it as its own [model] table
        d["overrides"] = [{"role": r, "layers": s, "codec": c} for r, s, c in self.overrides]
        return d

    @classmethod
    def from_dict(cls, data: dict) -> Policy:
        if "preset" in data:
            base = get_preset(data["preset"])
            data = {k: v for k, v in data.items() if k != "preset"}
        else:
            base = cls()
        data = {k: v for k, v in data.items() if not k.startswith("_")}  # "_source" and other notes
        valid = set(cls.__dataclass_fields__) - {"fitted_on"}
        unknown = sorted(set(data) - valid - {"kv"})
        if unknown:
            raise ValueError(f"unknown policy field(s) {', '.join(unknown)}: valid fields are {', '.join(sorted(valid))}")
        kw = dict(data)
        if "kv" in kw:
            kw["k"] = kw["v"] = kw.pop("kv")
        for role in ("k", "v"):
            if role in kw:
                kw[role] = _list_spec(kw[role], role)
        if "overrides" in kw:
            kw["overrides"] = tuple(
                (o["role"], str(o["layers"]), _list_spec(o["codec"], o["role"])) if isinstance(o, dict) else tuple(o)
                for o in kw["overrides"]
            )
        return replace(base, **kw)

    def with_name(self, name: str | None) -> Policy:
        return replace(self, name=name)

    @property
    def label(self) -> str:
        return self.name or self.to_string()

    # ---- per-layer plan ------------------------------------------------------------------------
    def plan(self, num_layers: int, layer_types: list[str] | None = None) -> list[LayerPlan]:
        """Resolve the policy for a model: one ``LayerPlan`` per layer, with a reason wherever it differs."""
        k = [self.k] * num_layers
        v = [self.v] * num_layers
        reason: list[str | None] = [None] * num_layers
        for role, sel, spec in self.overrides:
            for i in sorted(select_layers(sel, num_layers)):
                if role in ("k", "kv"):
                    k[i] = spec
                if role in ("v", "kv"):
                    v[i] = spec
                reason[i] = f"override {role}@{sel}={spec}"
        if self.protect:
            for i in select_layers(self.protect, num_layers):
                k[i] = v[i] = FULL_PRECISION
                reason[i] = f"protected ({self.protect}): fp16 K and V"
        window = [False] * num_layers
        sliding = [False] * num_layers
        if layer_types is not None:
            if len(layer_types) != num_layers:
                raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
            mixed = len(set(layer_types)) > 1
            how = self.sliding if self.sliding != "auto" else ("bypass" if mixed else "compress")
            for i, kind in enumerate(layer_types):
                if kind == "sliding_attention" and how == "bypass":
                    window[i] = True
                    reason[i] = "bypassed: sliding-window layer keeps transformers' bounded dense window"
                elif kind == "sliding_attention":
                    sliding[i] = True
                    if how == "dense":
                        k[i] = v[i] = FULL_PRECISION
                        reason[i] = "sliding-window layer kept fp16 in a window-bounded store (sliding=dense)"
                elif mixed and self.bypass == "global" and kind == "full_attention":
                    k[i] = v[i] = FULL_PRECISION
                    reason[i] = "bypassed: global (full-attention) layer in a mixed model (bypass=global)"
        return [
            LayerPlan(i, k[i], v[i], 0 if sliding[i] else self.sink, self.recent, reason[i], window[i], sliding[i])
            for i in range(num_layers)
        ]

    def codec_options(self, role: str) -> dict:
        """Options passed to ``codec_from_spec`` for this policy and role."""
        return {
            "rotation": self.rotation,
            "center": self.center if role == "k" else self.vcenter,
            "norm_correction": self.normfix,
            "group": self.group,
            "kblock": self.kblock,
            "seed": self.seed + (0 if role == "k" else 1),
            "calib": self.calib,
        }

    def build_codec(self, spec: str, role: str, layer: int | None = None, heads: tuple[int, ...] | None = None):
        """The codec of ``spec`` for ``role``; ``layer``: the layer it serves (calibrated codecs need it);
        ``heads``: the layer's KV-head indices it serves, in the order of the rows it gets (calibrated codecs
        select those heads' fitted tables; the others ignore it)."""
        return codec_from_spec(spec, role=role, layer=layer, heads=heads, **self.codec_options(role))

    def layer_codecs(self, plan: LayerPlan, kv_heads: int | None = None) -> tuple:
        """``(k_codec, v_codec)`` of one layer. Where a role has a per-KV-head list both roles are built over the
        same groups of heads (``codecs.head_codecs``); ``kv_heads``: the model's, checked against each list."""
        out = head_codecs({"k": plan.k, "v": plan.v}, plan.layer, kv_heads,
                          opts={role: self.codec_options(role) for role in ("k", "v")})
        return out["k"], out["v"]

    @property
    def per_head(self) -> bool:
        """True when any codec of the policy is a per-KV-head list."""
        return any(is_head_list(s) for s in (self.k, self.v, *(o[2] for o in self.overrides)))


def _fmt(val) -> str:
    if isinstance(val, bool):
        return "on" if val else "off"
    return str(val)


def _list_spec(spec, role: str):
    """A policy file's codec field: a spec, or a list of specs (one per KV head) -> its head-list string."""
    if not isinstance(spec, list):
        return spec
    if not spec or any(not isinstance(e, str) for e in spec):
        raise ValueError(f"{role.upper()} codec {spec!r}: a per-KV-head list is a flat list of codec names, one per "
                         'KV head (e.g. ["turbo2", "turbo4", "turbo2"]); lists cannot nest')
    if any(HEAD_SEP in e for e in spec):
        raise ValueError(f"{role.upper()} codec {spec!r}: an entry of a per-KV-head list is one codec (lists cannot "
                         "nest)")
    return HEAD_SEP.join(spec)


def _check_codec(spec: str, role: str) -> str:
    """Validate a codec spec for ``role``; a per-KV-head list comes back canonical (equal entries: that one spec)."""
    if is_head_list(spec):
        entries = split_head_list(spec)  # (empty entries, nesting: refused with their own message)
        for e in entries:
            try:
                _check_codec(e, role)
            except ValueError as exc:
                raise ValueError(f"{role.upper()} head list {spec!r}: {exc}") from None
        return canonical_spec(spec)
    if not isinstance(spec, str) or not is_valid_spec(spec):
        raise ValueError(
            f"unknown {role.upper()} codec {spec!r}: valid codecs are {', '.join(CODEC_SPECS)}, or one per KV head "
            "as SPEC0|SPEC1|..."
        )
    if role in ("v", "kv") and is_calibrated_spec(spec):
        raise ValueError(f"{spec} is a key codec (calibrated in the metric of the queries): give it to keys only "
                         f"(k={spec} or k@LAYERS={spec}) and a value codec such as turbo2 to values")
    return spec


# ---- compact text ----------------------------------------------------------------------------------
_INT_KEYS = ("sink", "recent", "group", "kblock", "seed")
_STR_KEYS = ("protect", "bypass", "sliding", "rotation", "name", "calib")
_BOOL_KEYS = ("center", "vcenter", "normfix")
_FLOAT_KEYS = ("sparsev",)
_VALID_KEYS = ("k", "v", "kv", *_INT_KEYS, *_FLOAT_KEYS, *_STR_KEYS, *_BOOL_KEYS, "k@<layers>", "v@<layers>", "kv@<layers>")


def parse_compact(text: str) -> Policy:
    text = text.strip()
    if not text:
        raise ValueError("empty policy: give a preset name (see `tqbench --headless policies`) or k=...,v=...")
    items = [p.strip() for p in text.split(",") if p.strip()]
    base = Policy()
    if "=" not in items[0]:
        base = get_preset(items[0])
        items = items[1:]
    kw: dict = {}
    overrides = list(base.overrides)
    for item in items:
        if "=" not in item:
            raise ValueError(f"policy part {item!r} is not key=value: valid keys are {', '.join(_VALID_KEYS)}")
        key, val = (s.strip() for s in item.split("=", 1))
        key = key.lower()
        if "@" in key:
            role, sel = key.split("@", 1)
            if role not in _ROLES:
                raise ValueError(f"policy part {item!r}: override must start with k@, v@ or kv@")
            overrides.append((role, sel, val))
        elif key in ("k", "v"):
            kw[key] = val
        elif key == "kv":
            kw["k"] = kw["v"] = val
        elif key in _INT_KEYS:
            try:
                kw[key] = int(val)
            except ValueError:
                raise ValueError(f"policy part {item!r}: {key} must be a whole number") from None
        elif key in _FLOAT_KEYS:
            try:
                kw[key] = float(val)
            except ValueError:
                raise ValueError(f"policy part {item!r}: {key} must be a number such as 0.001") from None
        elif key in _BOOL_KEYS:
            if val.lower() not in _BOOL:
                raise ValueError(f"policy part {item!r}: {key} must be on or off")
            kw[key] = _BOOL[val.lower()]
        elif key in _STR_KEYS:
            kw[key] = "" if (key == "protect" and val.lower() == "none") else val
        else:
            raise ValueError(f"unknown policy key {key!r} in {item!r}: valid keys are {', '.join(_VALID_KEYS)}")
    name = kw.pop("name", None)
    pol = replace(base, overrides=tuple(overrides), **kw)
    if name is not None:
        return pol.with_name(name)
    if kw or overrides != list(base.overrides):  # a changed preset is no longer that preset: label by its string
        return pol.with_name(None)
    return base


def load_policy_file(path: str) -> Policy:
    fitted = None  # an artifact's [model] table: the model the policy was fitted on
    if path.endswith(".toml"):
        data = read_toml(path, "policy file")
        fitted = data.get("model") if "policy" in data else None
        data = data.get("policy", data)
    else:
        with open(path, "rb") as fh:
            raw = fh.read()
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"policy file {path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"policy file {path}: a policy file holds one object with keys k, v, sink, recent, ...")
    try:
        pol = Policy.from_dict(data)
    except ValueError as exc:  # a field's error, named with the file it came from
        raise ValueError(f"policy file {path}: {exc}") from None
    pol = replace(pol, fitted_on=FittedOn.from_dict(fitted if isinstance(fitted, dict) else None))
    beside = os.path.join(os.path.dirname(os.path.abspath(path)), pol.calib) if pol.calib else ""
    if pol.calib and not os.path.isabs(pol.calib) and os.path.isfile(beside):  # a transforms file next to it
        pol = replace(pol, calib=beside)
    return pol if pol.name else pol.with_name(os.path.splitext(os.path.basename(path))[0])


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


def parse_policy(text: str | Policy) -> Policy:
    """A preset name, a compact string, or a path to a .json/.toml policy file."""
    if isinstance(text, Policy):
        return text
    text = text.strip()
    if text in PRESETS:
        return get_preset(text)
    if "," not in text and "=" not in text:
        shipped = shipped_policy_path(text)
        if shipped is not None:
            return load_policy_file(str(shipped))
    if text.endswith((".json", ".toml")):
        if not os.path.exists(text):
            raise ValueError(f"policy file {text!r} does not exist")
        return load_policy_file(text)
    return parse_compact(text)


# ---- presets -----------------------------------------------------------------------------------
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


def engine_policy(text: str) -> Policy:
    """An engine's own KV setting as a policy: ``llamacpp:q8_0/q4_0`` (K/V), ``llamacpp:q4_0`` (both),
    ``vllm:fp8``: those codecs on every layer, no sinks, no recent window (the engines keep none)."""
    k, v = engine_setting(text)
    engine, _, kinds = text.strip().lower().partition(":")
    return Policy(k=k, v=v).with_name(f"{engine}:{kinds.strip()}")


#: engine settings listed beside the presets (every other type pair the engines accept parses too)
ENGINE_PRESETS = (
    "llamacpp:q8_0", "llamacpp:q8_0/q4_0", "llamacpp:q5_1", "llamacpp:q5_0", "llamacpp:q4_1", "llamacpp:q4_0",
    "llamacpp:iq4_nl", "vllm:fp8", "vllm:fp8_e5m2", "sglang:fp4_mx_block16", "trtllm:fp8",
)


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


PRESETS = tuple(PRESET_TEXT)
