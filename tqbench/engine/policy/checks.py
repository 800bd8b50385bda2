"""The codec fields of a policy, checked (torch-free: ``codecs.names``): a K/V codec or per-KV-head list
(``check_codec``), a demote tier (``check_demote``) and the one rule for which tiers a layer may demote to
(``check_demote_cheaper``: a demoted row costs less than a kept one), and the file forms of codec fields."""

from __future__ import annotations

from tqbench.engine.codecs.names import (
    CODEC_SPECS,
    HEAD_SEP,
    canonical_spec,
    is_calibrated_spec,
    is_head_list,
    is_valid_spec,
    nominal_bits,
    split_head_list,
)
from tqbench.engine.policy.keep import fmt_keep, parse_keep


def check_demote_cheaper(k: str, v: str, demote: str, where: str = "") -> None:
    """The one rule for a demote tier: a row kept at ``demote`` (K and V both) must cost fewer bits than the same
    row kept at the layer's codecs ``k`` and ``v``, in every KV head (a per-head list: head by head); else evicting
    to it saves nothing (``turbo4,keep=0.5,demote=fp32`` stores more than ``turbo4``). Bits: the codecs' nominal
    widths (``nominal_bits``); ValueError naming the cheapest width that would do."""
    if not demote:
        return
    ks = split_head_list(k) if is_head_list(k) else [k]
    vs = split_head_list(v) if is_head_list(v) else [v]
    n = max(len(ks), len(vs))
    if len(ks) == len(vs) or 1 in (len(ks), len(vs)):
        cheapest = min(nominal_bits(ks[h % len(ks)]) + nominal_bits(vs[h % len(vs)]) for h in range(n))
    else:  # lists of different lengths (refused against the model): the cheapest K with the cheapest V
        cheapest = min(map(nominal_bits, ks)) + min(map(nominal_bits, vs))
    if 2 * nominal_bits(demote) < cheapest:
        return
    kept = f"k={k},v={v}" if k != v else f"kv={k}"
    bits = cheapest / 2
    cheaper = next((c for c in ("turbo4", "turbo3", "turbo2", "turbo1") if nominal_bits(c) < bits), None)
    raise ValueError(f"{where or 'demote'}={demote} is not cheaper than the rows it replaces ({kept}: {bits:g} "
                     f"bit{'' if bits == 1 else 's'} per element{' in its cheapest KV head' if n > 1 else ''}): "
                     + (f"a demote tier must use fewer bits, e.g. {cheaper}, or drop the evicted rows (no demote)"
                        if cheaper else "no tier is cheaper: drop the evicted rows (no demote)"))


def demote_choices(k: str, v: str) -> list[str]:
    """The codecs a layer kept at ``k`` and ``v`` may demote its evicted rows to (``check_demote`` and
    ``check_demote_cheaper``): what a front end offers, so it never offers a tier the policy would refuse."""
    out = []
    for spec in CODEC_SPECS:
        try:
            check_demote(spec, "demote")
            check_demote_cheaper(k, v, spec)
        except ValueError:
            continue
        out.append(spec)
    return out


def override_value(value, role: str):
    """A policy file's override value: a keep value (a list: one fraction per KV head), or a codec field."""
    if role == "keep":
        return fmt_keep(parse_keep(value))
    return list_spec(value, role)


def list_spec(spec, role: str):
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


def check_demote(spec, what: str) -> None:
    """A demote codec (``demote=`` or a ``demote@`` override's value): one codec for K and V, not calibrated."""
    if not isinstance(spec, str) or is_head_list(spec) or is_calibrated_spec(spec):
        raise ValueError(f"{what}={spec!r} is invalid: use one codec for K and V, e.g. turbo2"
                         + (" (none: drop the evicted rows of those layers)" if "@" in what else ""))
    try:
        check_codec(spec, "v")
    except ValueError as exc:
        raise ValueError(f"{what}={spec!r} is invalid: {exc}") from None


def check_codec(spec: str, role: str) -> str:
    """Validate a codec spec for ``role``; a per-KV-head list comes back canonical (equal entries: that one spec)."""
    if is_head_list(spec):
        entries = split_head_list(spec)  # (empty entries, nesting: refused with their own message)
        for e in entries:
            try:
                check_codec(e, role)
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
