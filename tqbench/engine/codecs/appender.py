"""The native encoder of a store's new rows: one ``HeadsEncoder`` (``tqbench.kernels.cpu``) per codec and state.

A TurboQuant-MSE or calibrated-key (``pcaq``) codec over a layer's heads is one group of every head; a per-head
codec (``HeadSplitCodec``) is one group per sub-codec. ``heads_encoder`` builds the encoder (tables, centring
means, widths, all converted once) and the packed field names it fills, in order; ``HeadsEncoder.encode(x)``
returns the fields of rows ``x``, ``HeadsEncoder.encode_into(src, start, n, dsts, offsets)`` writes the fields of a
row buffer's rows ``[start, start + n)`` straight into the store's packed buffers (the decode step's append path,
``KVStore``). Both pack exactly the codes of each codec's own ``encode`` (float64: every byte; tested).

Where no encoder can be built, ``heads_encoder`` returns the reason as a string (the store says it in the cache
report) instead of an encoder: a codec family without a native encode, rows of a dtype or device it cannot take, a
centring mean of another batch, or no native kernel here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import Codec, native_encoder

__all__ = ["heads_encoder", "native_append_codec"]


def _groups(codec: Codec, state: dict[str, torch.Tensor], heads: int):
    """``(sub-codecs, heads per group, states, field prefixes)``: a per-head codec's own groups (``append_groups``),
    else one group of every head."""
    own = getattr(codec, "append_groups", None)
    if own is not None:
        return own(state)
    return [codec], [list(range(heads))], [state], [""]


def native_append_codec(codec: Codec) -> bool:
    """Whether ``codec``'s family has a native encode (TurboQuant-MSE, calibrated keys, per-head layers of them)."""
    from .calibrated import PcaKeyCodec
    from .turbo import TurboCodec

    subs = getattr(codec, "subs", None) if hasattr(codec, "append_groups") else [codec]
    return all(type(c) in (TurboCodec, PcaKeyCodec) for c in subs)


def heads_encoder(codec: Codec, state: dict[str, torch.Tensor], dtype: torch.dtype, d: int, batch: int,
                  heads: int):
    """``(field names, HeadsEncoder)`` for ``codec`` under ``state`` (rows of ``dtype``, ``head_dim`` ``d``, ``batch``
    sequences, ``heads`` KV heads), or ``str``: why there is none."""
    if not native_append_codec(codec):
        return f"no native encoder for {codec.spec}"
    if not dtype.is_floating_point:
        return f"{dtype} rows"
    cd = torch.float64 if dtype == torch.float64 else torch.float32  # (16-bit rows compute in float32)
    subs, groups, states, prefixes = _groups(codec, state, heads)
    return _build(subs, groups, states, prefixes, cd, d, batch)


def _build(subs: Sequence[Codec], groups: list[list[int]], states: list[dict], prefixes: list[str],
           cd: torch.dtype, d: int, batch: int):
    from .calibrated import PcaKeyCodec
    from .turbo import TurboCodec

    kinds, mus, tables, bits, normfix, names = [], [], [], [], [], []
    for c, heads, sub, prefix in zip(subs, groups, states, prefixes):
        n = len(heads)
        if type(c) is TurboCodec:
            mu = c._mu(sub)
            if mu is None and (problem := c.encode_problem(d)):
                return problem
            rot, levels, bounds = c._tables(d, "cpu", cd)
            kinds.append("turbo")
            tables.append([rot.contiguous(), levels.contiguous(), bounds.contiguous()])
            bits.append(c.bits)
            normfix.append(bool(c.norm_correction))
            names.append((f"{prefix}idx", f"{prefix}norm"))
        else:  # PcaKeyCodec (native_append_codec checked the family)
            assert type(c) is PcaKeyCodec
            widths, _, enc, _, bounds = c._layer_tables(d, "cpu", cd)
            if widths.shape[0] != n:
                return f"{c.spec}: transforms for {widths.shape[0]} heads, {n} heads of rows"
            mu = c._mu(sub)
            kinds.append("pcaq")
            tables.append([enc.contiguous(), bounds.contiguous(), c.fused_tables(d, "cpu", cd)[0]])
            bits.append(0)
            normfix.append(False)
            names.append((f"{prefix}idx",))
        if mu is not None and tuple(mu.shape) != (batch, n, 1, d):
            return f"a centring mean of shape {tuple(mu.shape)} for rows of batch {batch}"
        mus.append(None if mu is None else mu.to(torch.float16).contiguous())
    mod = native_encoder(subs[0])
    if mod is None:
        return subs[0].encoder_fallback
    return names, mod.HeadsEncoder(kinds, groups, mus, tables, bits, normfix)
