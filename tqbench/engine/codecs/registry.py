"""The codec registry's torch side: ``codec_from_spec`` builds the codec a spec names, ``head_codecs`` a layer's
per-KV-head codecs, ``codec_bits_per_element`` what a spec costs (packed bits, metadata included). The names
themselves (valid specs, aliases, head lists, nominal bits) are torch-free, in ``names.py``."""

from __future__ import annotations

from typing import Any

from .affine import AffineChannelCodec, AffineTokenCodec
from .base import Codec
from .calibrated import PcaKeyCodec
from .dense import DenseCodec
from .fp4 import Fp4Block16Codec
from .fp8 import Fp8Codec
from .ggml import GgmlCodec
from .heads import HeadSplitCodec, group_heads
from .names import (
    HEAD_SEP,
    ROLES,
    canonical_spec,
    is_calibrated_spec,
    is_head_list,
    parse_codec_name,
    split_head_list,
)
from .rotation import ROTATIONS
from .turbo import TurboCodec, TurboProdCodec, TurboSplitCodec
from .vllm_tq import VllmTqKeyCodec, VllmUniformCodec

#: option name -> default
CODEC_OPTS: dict[str, Any] = {
    "rotation": "qr",
    "center": False,
    "norm_correction": True,
    "group": 32,
    "kblock": 32,
    "seed": 0,
    "calib": "",  # calibrated (pcaq) codecs: the transforms file ("" = the shipped default-model fit)
}


def _check_opts(opts: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(opts) - set(CODEC_OPTS))
    if unknown:
        raise ValueError(
            f"unknown codec option(s) {', '.join(unknown)}: valid options are {', '.join(CODEC_OPTS)}"
        )
    o = {**CODEC_OPTS, **opts}
    if o["rotation"] not in ROTATIONS:
        raise ValueError(f"unknown rotation {o['rotation']!r}: valid rotations are {', '.join(ROTATIONS)}")
    for name in ("center", "norm_correction"):
        if not isinstance(o[name], bool):
            raise ValueError(f"{name} must be True or False, got {o[name]!r}")
    for name in ("group", "kblock"):
        if isinstance(o[name], bool) or not isinstance(o[name], int) or o[name] < 1:
            raise ValueError(f"{name} must be a positive integer, got {o[name]!r}")
    if isinstance(o["seed"], bool) or not isinstance(o["seed"], int):
        raise ValueError(f"seed must be an integer, got {o['seed']!r}")
    if not isinstance(o["calib"], str):
        raise ValueError(f"calib must be a transforms file path (or empty for the shipped fit), got {o['calib']!r}")
    return o


def codec_from_spec(spec: str, role: str = "v", layer: int | None = None, heads: tuple[int, ...] | None = None,
                    **opts: Any) -> Codec:
    """Build the codec named ``spec`` for keys (``role="k"``) or values (``role="v"``).

    Options (ignored by codecs they do not apply to): ``rotation`` ("qr" | "hadamard"), ``center``,
    ``norm_correction``, ``group`` (V/per-token affine group), ``kblock`` (K per-channel affine token
    block), ``seed``, ``calib`` (calibrated codecs' transforms file). ``layer``: the layer the codec serves
    (calibrated codecs hold one fitted transform per layer; the others ignore it). ``heads``: the layer's KV
    heads this codec serves, in the order of the rows it gets (calibrated codecs select those heads' fitted
    tables; the others ignore it). A head list (``turbo2|turbo4``) gives a ``HeadSplitCodec`` (one sub-codec
    per group of equal entries; ``head_codecs`` groups a layer's K and V together).
    """
    name = canonical_spec(spec)
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: valid roles are {', '.join(ROLES)}")
    if is_head_list(name):
        return head_codecs({role: name}, layer, heads=heads, opts={role: opts})[role]
    o = _check_opts(opts)
    n = parse_codec_name(name)
    if n.family == "pcaq":
        return PcaKeyCodec(n.bits, layer, o["calib"], role, heads)
    if n.family == "dense":
        return DenseCodec(name)
    if n.family == "ggml":
        return GgmlCodec(name)
    if n.family == "fp4":
        return Fp4Block16Codec()
    if n.family == "vllm-tq":
        return VllmTqKeyCodec(int(n.bits))
    if n.family == "vllm-u":
        return VllmUniformCodec(int(n.bits))
    if n.family == "fp8":
        return Fp8Codec(n.fmt, n.scale)
    if n.family == "affine":
        bits = int(n.bits)
        return AffineChannelCodec(bits, o["kblock"]) if role == "k" else AffineTokenCodec(bits, o["group"])
    turbo = {k: o[k] for k in ("rotation", "center", "norm_correction", "seed")}
    if n.family == "turbo-qjl":
        return TurboProdCodec(int(n.bits), **turbo)
    if n.family == "turbo-split":
        return TurboSplitCodec(n.bits, **turbo)
    return TurboCodec(int(n.bits), **turbo)


def head_codecs(specs: dict[str, str], layer: int | None = None, kv_heads: int | None = None,
                heads: tuple[int, ...] | None = None, opts: dict[str, dict] | None = None) -> dict[str, Codec]:
    """The codecs of one layer's roles (``{"k": spec, "v": spec}``, either a head list or one spec), built
    together: when any is a head list, every role gets a ``HeadSplitCodec`` over the same groups of heads (heads
    with equal codecs in every role), so attention can read each group with its K and V codecs over the same
    heads. ``kv_heads``: the model's KV heads, checked against each list's length (the error names the layer,
    the role and both counts). ``heads``: the KV-head indices the rows cover (default all); ``opts``: per role,
    as for ``codec_from_spec``."""
    opts = opts or {}
    where = f"layer {layer}: " if layer is not None else ""
    lists = {}
    for role, spec in specs.items():
        if not is_head_list(spec):
            continue
        entries = split_head_list(spec)
        n = kv_heads if kv_heads is not None else (len(heads) if heads is not None else None)
        if n is not None and len(entries) != n:
            raise ValueError(f"{where}the {role.upper()} head list {spec!r} has {len(entries)} entries but the model "
                             f"has {n} KV heads: give one codec per KV head, in head order (SPEC0|...|SPEC{n - 1})")
        lists[role] = entries
    if not lists:
        return {role: codec_from_spec(spec, role, layer, heads=heads, **opts.get(role, {}))
                for role, spec in specs.items()}
    counts = {len(e) for e in lists.values()}
    if len(counts) > 1:
        raise ValueError(f"{where}the K and V head lists have {' and '.join(str(len(e)) for e in lists.values())} "
                         "entries: give both one codec per KV head")
    n = counts.pop()
    per_head = {}
    for role, spec in specs.items():
        try:
            per_head[role] = [canonical_spec(e) for e in lists[role]] if role in lists else [canonical_spec(spec)] * n
        except ValueError as exc:
            raise ValueError(f"{where}{role.upper()} codec: {exc}") from None
    groups = group_heads(*per_head.values())
    index = tuple(range(n)) if heads is None else tuple(heads)
    if len(index) != n:
        raise ValueError(f"{where}heads={heads} gives {len(index)} heads for a head list of {n} codecs")
    out = {}
    for role, entries in per_head.items():
        subs = [codec_from_spec(entries[g[0]], role, layer, heads=tuple(index[h] for h in g), **opts.get(role, {}))
                for g in groups]
        name = entries[0] if len(set(entries)) == 1 else HEAD_SEP.join(entries)
        out[role] = HeadSplitCodec(name, n, groups, subs)
    return out


def codec_bits_per_element(spec: str, head_dim: int, **opts: Any) -> float:
    """Packed bits per K and V element of ``spec`` at ``head_dim``, averaged over the two roles.

    Per-unit metadata (norms, scales, zeros) included; per-layer state and shared objects (rotations,
    codebooks) excluded: ``Codec.bits_per_element``. ``opts`` as for ``codec_from_spec``. A key-only codec
    (``pcaq``) gives its key bits.
    """
    if is_calibrated_spec(spec) or (is_head_list(spec) and any(is_calibrated_spec(e) for e in split_head_list(spec))):
        return codec_from_spec(spec, "k", **opts).bits_per_element(head_dim)
    return sum(codec_from_spec(spec, role, **opts).bits_per_element(head_dim) for role in ROLES) / len(ROLES)
