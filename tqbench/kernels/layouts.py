"""The packed layouts the kernels read: one row per layout, as ggml's type traits.

This table is the one place that says, for each way packed rows can be laid out, which payload fields hold them
(the codes first), whether the rows live in a transformed domain (scored against the transformed query and summed
there), how many rows one unit of codes covers, which roles may use it and whether the native CPU kernel can
score its keys in integers (at the widths the build declares: ``kernel_rules()["score_int8_bits"]``). A codec
states which layout its packed rows have (``Codec.packed_side``); the torch reference, the Triton kernel, the
native kernel's glue and the cache's reports read the row here instead of switching on the codec's type.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """One packed layout (a row of ``LAYOUTS``)."""

    kind: str
    #: (the native kernel ``Side`` attribute, the payload field) pairs, the codes first
    fields: tuple[tuple[str, str], ...]
    #: rows live in a transformed domain (turbo's rotation, pcaq's per-head basis): keys are scored against the
    #: transformed query, values summed there and transformed back once
    transformed: bool
    #: one unit of codes covers ``group`` rows (KIVI's token-major blocks) rather than one row
    grouped_rows: bool
    roles: tuple[str, ...]
    #: the native kernel can score this layout's keys in integers (``attention.key_scoring``)
    int_scoring: bool
    #: the torch reference decodes the codes through byte tables (``packing.lookup_packed``: a 4-byte float per
    #: code while it decodes; else a row-sized intermediate, as ``unpack_widths`` for per-coordinate widths)
    table_decoded: bool
    #: what the packed codes are, for the docs and error messages
    summary: str

    @property
    def code_field(self) -> str:
        return self.fields[0][1]

    @property
    def payload_fields(self) -> tuple[str, ...]:
        return tuple(name for _, name in self.fields)


_ROWS = (
    Layout("turbo", (("codes", "idx"), ("norms", "norm")), transformed=True, grouped_rows=False, roles=("k", "v"),
           int_scoring=True, table_decoded=True, summary="b-bit codebook indices in the rotated domain + an fp16 norm per row"),
    Layout("affine-channel", (("codes", "q"), ("scales", "scale"), ("zeros", "zero")), transformed=False,
           grouped_rows=True, roles=("k", "v"), int_scoring=False, table_decoded=True,
           summary="token-major codes over blocks of group rows, an fp16 scale and zero per (block, channel)"),
    Layout("affine-token", (("codes", "q"), ("scales", "scale"), ("zeros", "zero")), transformed=False,
           grouped_rows=False, roles=("k", "v"), int_scoring=False, table_decoded=True,
           summary="codes per row, an fp16 scale and zero per group of channels"),
    Layout("pcaq", (("codes", "idx"),), transformed=True, grouped_rows=False, roles=("k",), int_scoring=True,
           table_decoded=False, summary="a width per coordinate in a per-head basis, no norm (calibrated keys)"),
)

#: kind -> its layout; the order is the Triton kernel's kind ids (turbo 0, affine-channel 1, affine-token 2, pcaq 3)
LAYOUTS: dict[str, Layout] = {row.kind: row for row in _ROWS}
KINDS: tuple[str, ...] = tuple(LAYOUTS)
#: kinds whose rows live in a transformed domain
TRANSFORMED: tuple[str, ...] = tuple(k for k, row in LAYOUTS.items() if row.transformed)


def layout_of(kind: str) -> Layout:
    """The layout named ``kind``; a clear error naming the valid kinds otherwise."""
    try:
        return LAYOUTS[kind]
    except KeyError:
        raise ValueError(f"unknown packed kind {kind!r}: valid kinds are {', '.join(KINDS)}") from None
