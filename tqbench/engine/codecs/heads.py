"""Per-KV-head codecs: a head list ``SPEC0|SPEC1|...`` gives each KV head of a layer its own codec.

``HeadSplitCodec`` is one codec over all ``H`` heads built from sub-codecs, each serving a *group* of heads
(the heads that share a codec; a layer's K and V share one grouping, ``group_heads``). Encode splits the
rows by group and encodes each group with its sub-codec; the packed fields and the state are the groups'
own, prefixed ``g{i}.``; decode writes each group's rows back in head order. So a head's rows are exactly
what its sub-codec makes of them, and the store, its crop and its batch operations need nothing new.

A unit is ``tokens_per_unit`` = the lcm of the groups' units (a per-channel 32-token block beside per-token
heads packs every head in 32-token steps). Bytes stay exact: ``units_bytes(head_dim, heads)`` is one unit over
all heads (each group: its heads x its sub-units per unit x its sub-codec's ``unit_bytes``), the state is the
groups' state, the shared objects (rotations, codebooks) are the union by name. Dense sub-codecs (an ``fp16``
head) keep their rows as given and are counted at their named width (``packed_nbytes``), as the store counts
its full-precision rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .base import Codec, Encoded, bits_per_element
from .names import HEAD_SEP, is_head_list, split_head_list

__all__ = ["HEAD_SEP", "HeadSplitCodec", "group_heads", "is_head_list", "split_head_list"]

def group_heads(*per_head: Sequence[str]) -> list[tuple[int, ...]]:
    """Heads grouped by their codecs across the given roles (e.g. K's and V's per-head specs): groups in order of
    their first head, each the tuple of heads whose specs are equal in every role."""
    groups: dict[tuple, list[int]] = {}
    for h, key in enumerate(zip(*per_head)):
        groups.setdefault(key, []).append(h)
    return [tuple(g) for g in groups.values()]


class HeadSplitCodec(Codec):
    """One codec per group of KV heads (``groups[i]``, served by ``subs[i]``), over ``heads`` heads."""

    def __init__(self, spec: str, heads: int, groups: Sequence[tuple[int, ...]], subs: Sequence[Codec]) -> None:
        if len(groups) != len(subs) or not groups:
            raise ValueError("a per-head codec needs one sub-codec per group of heads")
        flat = sorted(h for g in groups for h in g)
        if flat != list(range(heads)):
            raise ValueError(f"head groups {list(groups)} do not cover heads 0..{heads - 1} exactly once")
        self.spec = spec
        self.heads = heads
        self.groups = [tuple(g) for g in groups]
        self.subs = list(subs)
        self.tokens_per_unit = math.lcm(*(c.tokens_per_unit for c in self.subs))
        self._index: dict = {}
        self._plan: tuple | None = None  # (key, state, the native encode plan): see _native_plan

    # -- groups ----------------------------------------------------------------------------------
    def head_index(self, g: int, device) -> slice | torch.Tensor:
        """The rows of group ``g`` along the heads dim: a slice when its heads are consecutive (a view)."""
        heads = self.groups[g]
        if heads == tuple(range(heads[0], heads[0] + len(heads))):
            return slice(heads[0], heads[0] + len(heads))
        key = (g, str(device))
        if key not in self._index:
            self._index[key] = torch.tensor(heads, device=device)
        return self._index[key]

    def take(self, x: torch.Tensor, g: int) -> torch.Tensor:
        """Group ``g``'s heads of ``x`` (``[B, H, ...]``)."""
        idx = self.head_index(g, x.device)
        return x[:, idx] if isinstance(idx, slice) else x.index_select(1, idx)

    @staticmethod
    def field_prefix(g: int) -> str:
        """What names group ``g``'s fields in a per-head payload or state (``g0.idx``)."""
        return f"g{g}."

    @staticmethod
    def sub_fields(d: dict, g: int) -> dict:
        prefix = HeadSplitCodec.field_prefix(g)
        return {k[len(prefix):]: v for k, v in d.items() if k.startswith(prefix)}

    def append_groups(self, state: dict[str, torch.Tensor]) -> tuple[list, list, list, list]:
        """``(sub-codecs, heads per group, sub-states, field prefixes)``: what the native encoder of new rows reads
        (``codecs.appender``)."""
        n = len(self.subs)
        return (list(self.subs), [list(g) for g in self.groups], [self.sub_fields(state, g) for g in range(n)],
                [self.field_prefix(g) for g in range(n)])

    @property
    def encoder_fallback(self) -> str | None:
        return next((w for c in self.subs if (w := getattr(c, "encoder_fallback", None))), None)

    def _check_heads(self, x: torch.Tensor) -> None:
        if x.shape[1] != self.heads:
            raise ValueError(f"{self.spec}: a head list of {self.heads} codecs got rows of {x.shape[1]} KV heads: "
                             "give one codec per KV head of the model")

    # -- codec --------------------------------------------------------------------------------------
    def calibrate(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        if x.dim() != 4:  # (calibration rows need not fill whole units)
            raise ValueError(f"{self.spec}: expected KV rows shaped [batch, kv_heads, tokens, head_dim], got "
                             f"{tuple(x.shape)}")
        self._check_heads(x)
        return {f"g{g}.{k}": t for g, c in enumerate(self.subs) for k, t in c.calibrate(self.take(x, g)).items()}

    def state_bytes(self, state: dict[str, torch.Tensor]) -> int:
        return sum(c.state_bytes(self.sub_fields(state, g)) for g, c in enumerate(self.subs))

    def encode(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> Encoded:
        self.check_input(x)
        self._check_heads(x)
        plan = self._native_plan(x, state)
        if plan is not None:  # every group in one native call (the decode step's append path)
            names, encoder = plan
            outs = encoder.encode(x.contiguous())
            return {name: t for group, fields in zip(names, outs) for name, t in zip(group, fields)}
        return {f"g{g}.{k}": t for g, c in enumerate(self.subs)
                for k, t in c.encode(self.take(x, g), self.sub_fields(state, g)).items()}

    def __getstate__(self) -> dict:
        """Copies and pickles leave out the native encode plan (not copyable; rebuilt on first use)."""
        state = self.__dict__.copy()
        state["_plan"] = None
        return state

    def _native_plan(self, x: torch.Tensor, state: dict[str, torch.Tensor]):
        """``(field names per group, a native ``HeadsEncoder``)``: every group encoded in one native call, each
        reading its heads of ``x`` by index (no slicing here); kept while the state, dtype, head_dim and batch
        stand. None where it cannot run: rows off the CPU or not fp32/fp64, a group whose codec is neither a
        TurboQuant-MSE nor a calibrated-key codec (then each group encodes on its own, on its own native path where
        it has one), or no native kernel (each group's encode then says why)."""
        if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64):
            return None
        key = (x.dtype, x.shape[-1], x.shape[0])
        hit = self._plan
        if hit is not None and hit[0] == key and hit[1] is state:
            return hit[2]
        plan = self._build_plan(x.dtype, x.shape[-1], x.shape[0], state)
        self._plan = (key, state, plan)
        return plan

    def _build_plan(self, dtype: torch.dtype, d: int, batch: int, state: dict[str, torch.Tensor]):
        from .appender import heads_encoder

        plan = heads_encoder(self, state, dtype, d, batch, self.heads)
        return None if isinstance(plan, str) else plan

    def decode(self, enc: Encoded, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        out = None
        for g, c in enumerate(self.subs):
            rows = c.decode(self.sub_fields(enc, g), self.sub_fields(state, g), dtype)
            if out is None:
                out = rows.new_empty(rows.shape[0], self.heads, *rows.shape[2:])
            idx = self.head_index(g, rows.device)
            if isinstance(idx, slice):
                out[:, idx] = rows
            else:
                out.index_copy_(1, idx, rows)
        return out

    # -- bytes ------------------------------------------------------------------------------------------
    def unit_bytes(self, head_dim: int) -> int:
        raise ValueError(f"{self.spec}: the heads of a per-head codec differ in bytes per unit: use "
                         "units_bytes(head_dim, heads), the bytes of one unit over all heads")

    def units_bytes(self, head_dim: int, heads: int) -> int:
        if heads != self.heads:
            raise ValueError(f"{self.spec}: a head list of {self.heads} codecs cannot count {heads} KV heads")
        return sum(len(g) * (self.tokens_per_unit // c.tokens_per_unit) * c.unit_bytes(head_dim)
                   for g, c in zip(self.groups, self.subs))

    def bits_per_element(self, head_dim: int) -> float:
        """The mean over the heads (per-unit metadata included, state and shared objects excluded)."""
        return bits_per_element(self.units_bytes(head_dim, self.heads), self.tokens_per_unit * head_dim * self.heads)

    def packed_nbytes(self, fields: dict) -> int:
        return sum(c.packed_nbytes(self.sub_fields(fields, g)) for g, c in enumerate(self.subs))

    def shared_items(self, head_dim: int) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.subs:
            out.update(c.shared_items(head_dim))
        return out

    def __repr__(self) -> str:
        return f"HeadSplitCodec({self.spec!r}, groups={self.groups})"
