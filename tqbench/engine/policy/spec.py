"""KV policies: which codec each layer's K and V get, plus token- and layer-level protection.

This module holds the value (``Policy``, ``LayerPlan``, ``FittedOn``) and its checks. Its three interchangeable
forms live beside it: compact text in ``grammar.py`` (``k=turbo4,v=turbo3,sink=4,recent=32,protect=first2+last2``,
a preset name may lead; per-layer overrides ``v@last8=int8``), dicts and files in ``files.py`` (JSON / TOML with the
same keys; ``parse_policy`` is the door for every form), named presets in ``presets.py``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from tqbench.engine.codecs.names import canonical_spec, is_head_list, split_head_list
from tqbench.engine.policy.checks import (
    check_codec,
    check_demote,
    check_demote_cheaper,
    list_spec,
    override_value,
)
from tqbench.engine.policy.fitted import FittedOn
from tqbench.engine.policy.keep import (
    ADA_FLOOR,
    SCORES,
    Rows,
    check_budget,
    check_heads,
    check_keep_rows,
    evicts,
    fmt_keep,
    is_head_keeps,
    parse_keep,
)
from tqbench.engine.policy.layers import select_layers, validate_selector

__all__ = ["BYPASS_CHOICES", "DENSE_SPECS", "FULL_PRECISION", "NO_DEMOTE", "ROTATION_CHOICES", "SLIDING_CHOICES",
           "FittedOn", "LayerPlan", "Policy"]

FULL_PRECISION = "fp16"
BYPASS_CHOICES = ("none", "global")
#: what a sliding-window layer does: compress (the policy's codecs in a window-bounded store), dense (fp16 in
#: a window-bounded store), bypass (transformers' own bounded dense window), auto (compress, in every model:
#: bypassing the sliding layers of a mixed sliding/full model, as auto once did, kept most of its cache dense at
#: every length -- Gemma-2-9B at 8192 tokens saved 49.6% instead of 74.4%, a 5:1 Gemma-3 far less)
SLIDING_CHOICES = ("auto", "compress", "dense", "bypass")
ROTATION_CHOICES = ("qr", "hadamard")
_ROLES = ("k", "v", "kv", "keep", "demote")  # "keep": a per-layer keep (keep@0-3=1.0); "demote": a per-layer
#: demote tier (demote@3-5=turbo2; ``NO_DEMOTE`` drops the evicted rows of those layers)
_VALUE_ROLES = ("keep", "demote")  # override roles whose value is not a K/V codec
NO_DEMOTE = "none"


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
    #: token eviction: the layer's keep value (``policy.keep``; a tuple: one fraction per KV head), None when it
    #: evicts nothing
    keep: float | int | tuple[float, ...] | None = None
    #: the codec the layer's evicted rows are kept at (``policy.demote``, ``demote@``), "" when they are dropped
    #: or the layer evicts nothing
    demote: str = ""

    @property
    def evicts(self) -> bool:
        return evicts(self.keep)

    @property
    def head_keeps(self) -> bool:
        """True when the layer's KV heads keep different fractions (ragged per-head stores)."""
        return is_head_keeps(self.keep)

    @property
    def compressed(self) -> bool:
        return not self.dense_window and not (self.k in DENSE_SPECS and self.v in DENSE_SPECS)


DENSE_SPECS = ("fp16", "bf16", "fp32")


@dataclass(frozen=True)
class Policy:
    k: str = FULL_PRECISION
    v: str = FULL_PRECISION
    sink: int = 0
    recent: int = 0
    #: the fp16 recent rows of a compressed sliding-window layer (-1: ``recent``). On Gemma-3 270M the windows'
    #: recent rows carry most of the window's value and the global layers' barely any (docs/allocation.md)
    srecent: int = -1
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
    #: token eviction (``policy.keep``): rows kept per KV head, a fraction of the evictable ones or a ``Rows`` count (``512rows``), or a
    #: tuple of fractions, one per KV head (``0.5|1|0.25``)
    keep: float | int | tuple[float, ...] = 1.0
    score: str = "snapkv"  # how rows are ranked: see keep.SCORES
    window: int = 32  # observation window: the last queries a score reads (never evicted themselves)
    chunk: int = 1  # rank rows in chunks of this many positions (ChunkKV; 1: each row on its own)
    every: int = 0  # decode: evict again every this many decoded tokens (0: only at prefill)
    demote: str = ""  # evicted rows kept at this (cheaper) codec instead of dropped ("" = dropped)
    heads: str = "uniform"  # kept rows shared between a layer's KV heads: uniform, or ada (see keep.HEAD_BUDGETS)
    ada_floor: float = ADA_FLOOR  # heads=ada: the fraction of the uniform share every KV head keeps at least
    budget: str = "layer"  # keep=F per layer and KV head, or global: ranked over every layer (keep.BUDGETS)
    name: str | None = field(default=None, compare=False)
    #: the model a saved policy file was fitted on (its ``[model]`` table); None for presets and compact text.
    #: Provenance, not part of the policy's value: not compared, not in ``to_string``/``to_dict``
    fitted_on: FittedOn | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for role in ("k", "v"):
            object.__setattr__(self, role, check_codec(getattr(self, role), role))
        for what, val in (("sink", self.sink), ("recent", self.recent)):
            if not isinstance(val, int) or val < 0:
                raise ValueError(f"{what}={val!r} is invalid: use a whole number of tokens >= 0")
        if not isinstance(self.srecent, int) or isinstance(self.srecent, bool) or self.srecent < -1:
            raise ValueError(f"srecent={self.srecent!r} is invalid: the fp16 recent rows of sliding-window layers, a "
                             "whole number >= 0 (or -1: as recent)")
        object.__setattr__(self, "keep", parse_keep(self.keep))
        if self.demote:
            check_demote(self.demote, "demote")
            check_demote_cheaper(self.k, self.v, self.demote)
        check_heads(self.heads, self.ada_floor)
        object.__setattr__(self, "ada_floor", float(self.ada_floor))
        if self.score not in SCORES:
            raise ValueError(f"score={self.score!r} is invalid: valid scores are {', '.join(SCORES)}")
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"chunk={self.chunk!r} is invalid: use a whole number of tokens >= 1 (e.g. 8: rows are "
                             "kept or evicted in chunks of 8 positions; 1: each row on its own)")
        for what, val in (("window", self.window), ("every", self.every)):
            if isinstance(val, bool) or not isinstance(val, int) or val < (1 if what == "window" else 0):
                raise ValueError(f"{what}={val!r} is invalid: use a whole number of tokens >= "
                                 f"{1 if what == 'window' else 0}"
                                 + (" (0: evict only at prefill)" if what == "every" else ""))
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
        seen: set[tuple[str, str]] = set()
        for role, sel, spec in self.overrides:
            if (role, validate_selector(sel)) in seen:  # the later would silently replace the earlier
                raise ValueError(f"override {role}@{sel} is given twice: give each override once")
            seen.add((role, validate_selector(sel)))
            if role not in _ROLES:
                raise ValueError(f"override role {role!r} is invalid: use k@, v@, kv@, keep@ or demote@")
            if role == "keep":
                keep = parse_keep(spec)
                check_keep_rows(keep, self.sink, self.window, self.recent, f"keep@{sel}")
                fixed.append((role, validate_selector(sel), fmt_keep(keep)))
                continue
            if role == "demote":
                if str(spec).strip().lower() == NO_DEMOTE:
                    spec = NO_DEMOTE
                else:
                    check_demote(spec, f"demote@{sel}")
                fixed.append((role, validate_selector(sel), spec))
                continue
            fixed.append((role, validate_selector(sel), check_codec(spec, role)))
        object.__setattr__(self, "overrides", tuple(fixed))
        if self.heads == "ada" and not self.evicts:
            raise ValueError("heads=ada shares a layer's kept rows between its KV heads, but this policy evicts "
                             "nothing: set keep below 1 (e.g. keep=0.5)")
        if self.heads == "ada" and (is_head_keeps(self.keep) or any(
                r == "keep" and is_head_keeps(parse_keep(s)) for r, _, s in self.overrides)):
            raise ValueError("heads=ada shares a layer's kept rows between its KV heads by their scores, so it takes "
                             "one keep value per layer, not a per-head keep list: drop heads=ada (each head then "
                             "keeps its own fraction) or give one keep value")
        check_keep_rows(self.keep, self.sink, self.window, self.recent)
        check_budget(self.budget, self.score, self.heads, (self.keep, *(parse_keep(c) for r, _, c in self.overrides
                                                                        if r == "keep")), self.every,
                     bool(self.demote) or any(r == "demote" and c != NO_DEMOTE for r, _, c in self.overrides),
                     self.evicts)
        demotes = (f"demote={self.demote}" if self.demote else
                   next((f"demote@{s}={c}" for r, s, c in self.overrides if r == "demote" and c != NO_DEMOTE), ""))
        if demotes and not self.evicts:
            raise ValueError(f"{demotes} keeps the evicted rows at a cheaper codec, but this policy evicts nothing: "
                             "set keep below 1 (e.g. keep=0.5)")

    # ---- forms ------------------------------------------------------------------------------
    def to_string(self) -> str:
        """The compact form, read back equal by ``parse_compact``: every field whose value differs from the default
        by value or by meaning (``keep=1rows``, one row, is not ``keep=1``, every row), then the overrides."""
        parts = [f"k={self.k}", f"v={self.v}"]
        defaults = Policy()
        for key in _WRITTEN:
            val = getattr(self, key)
            if _differs(val, getattr(defaults, key)):
                parts.append(f"{key}={fmt_keep(val) if key == 'keep' else _fmt(val)}")
        parts += [f"{role}@{sel}={spec}" for role, sel, spec in self.overrides]
        return ",".join(parts)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("fitted_on")  # provenance: an artifact writes it as its own [model] table
        if isinstance(self.keep, Rows):  # a row count keeps its unit (a bare 512 would read back as ambiguous)
            d["keep"] = fmt_keep(self.keep)
        elif is_head_keeps(self.keep):
            d["keep"] = list(self.keep)
        d["overrides"] = [{"role": r, "layers": s, "codec": c} for r, s, c in self.overrides]
        return d

    @classmethod
    def from_dict(cls, data: dict, base: Policy | None = None) -> Policy:
        """The dict (JSON/TOML) form over ``base`` (default: the empty policy); a ``preset`` key is resolved by
        ``policy.files.policy_from_dict``, which names its base."""
        if "preset" in data:
            raise ValueError("a policy dict with a preset key is read by tqbench.engine.policy.policy_from_dict")
        base = cls() if base is None else base
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
                kw[role] = list_spec(kw[role], role)
        if "overrides" in kw:
            kw["overrides"] = tuple(
                (o["role"], str(o["layers"]), override_value(o["codec"], o["role"])) if isinstance(o, dict)
                else tuple(o) for o in kw["overrides"]
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
        keep = [self.keep] * num_layers
        demote = [self.demote] * num_layers
        reason: list[str | None] = [None] * num_layers
        for role, sel, spec in self.overrides:
            for i in sorted(select_layers(sel, num_layers, layer_types)):
                if role == "keep":
                    keep[i] = parse_keep(spec)
                    continue
                if role == "demote":
                    demote[i] = "" if spec == NO_DEMOTE else spec
                    continue
                if role in ("k", "kv"):
                    k[i] = spec
                if role in ("v", "kv"):
                    v[i] = spec
                reason[i] = f"override {role}@{sel}={spec}"
        if self.protect:
            for i in select_layers(self.protect, num_layers, layer_types):
                k[i] = v[i] = FULL_PRECISION
                reason[i] = f"protected ({self.protect}): fp16 K and V"
        window = [False] * num_layers
        sliding = [False] * num_layers
        if layer_types is not None:
            if len(layer_types) != num_layers:
                raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
            mixed = len(set(layer_types)) > 1
            how = self.sliding if self.sliding != "auto" else "compress"
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
        # eviction on full-attention layers only: a sliding-window layer already holds a bounded window
        keeps = [None if (window[i] or sliding[i] or not evicts(keep[i])) else keep[i] for i in range(num_layers)]
        for i in range(num_layers):
            if keeps[i] is not None and demote[i]:
                check_demote_cheaper(k[i], v[i], demote[i], f"layer {i}: demote")
        return [
            LayerPlan(i, k[i], v[i], 0 if sliding[i] else self.sink, self.sliding_recent if sliding[i] else self.recent,
                      reason[i], window[i], sliding[i],
                      keeps[i], demote[i] if keeps[i] is not None else "")
            for i in range(num_layers)
        ]

    @property
    def sliding_recent(self) -> int:
        """The fp16 recent rows of a compressed sliding-window layer (``srecent``, else ``recent``)."""
        return self.recent if self.srecent < 0 else self.srecent

    @property
    def evicts(self) -> bool:
        """True when some layer of the policy can evict rows (``keep`` below everything)."""
        return evicts(self.keep) or any(r == "keep" and evicts(parse_keep(s)) for r, _, s in self.overrides)

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
        from tqbench.engine.codecs import codec_from_spec  # torch: loaded when a codec is built, not a policy

        return codec_from_spec(spec, role=role, layer=layer, heads=heads, **self.codec_options(role))

    def layer_codecs(self, plan: LayerPlan, kv_heads: int | None = None) -> tuple:
        """``(k_codec, v_codec)`` of one layer. Where a role has a per-KV-head list both roles are built over the
        same groups of heads (``codecs.head_codecs``); ``kv_heads``: the model's, checked against each list."""
        from tqbench.engine.codecs import head_codecs

        out = head_codecs({"k": plan.k, "v": plan.v}, plan.layer, kv_heads,
                          opts={role: self.codec_options(role) for role in ("k", "v")})
        return out["k"], out["v"]

    def head_codec(self, plan: LayerPlan, role: str, head: int):
        """The codec of KV head ``head`` of a layer for ``role``, alone (a ragged layer's per-head store,
        ``evict.ragged``): its own entry of a per-head list, a calibrated codec with that head's table."""
        spec = plan.k if role == "k" else plan.v
        if is_head_list(spec):
            spec = canonical_spec(split_head_list(spec)[head])
        return self.build_codec(spec, role, layer=plan.layer, heads=(head,))

    def ragged(self, plan: LayerPlan) -> bool:
        """True when ``plan``'s layer keeps one store per KV head, each its own rows: it evicts and its heads
        keep different counts (``heads=ada``, a per-head keep list, or ``budget=global``)."""
        return plan.evicts and (self.heads == "ada" or plan.head_keeps or self.budget == "global")

    @property
    def per_head(self) -> bool:
        """True when any codec of the policy is a per-KV-head list."""
        return any(is_head_list(s) for s in (self.k, self.v, *(o[2] for o in self.overrides if o[0] not in _VALUE_ROLES)))


#: the fields ``to_string`` writes when they differ from the default (every field but the codecs, the overrides and
#: the name, which it writes its own way, and the provenance)
_WRITTEN = ("sink", "recent", "srecent", "protect", "bypass", "sliding", "rotation", "center", "vcenter", "normfix", "group",
            "kblock", "seed", "sparsev", "calib", "keep", "score", "window", "chunk", "every", "demote", "heads",
            "ada_floor", "budget")


def _differs(val, default) -> bool:
    """By value or by meaning: ``Rows(1)`` differs from ``1.0``, ``True`` from ``1``."""
    return type(val) is not type(default) or val != default


def _fmt(val) -> str:
    if isinstance(val, bool):
        return "on" if val else "off"
    return str(val)
