"""The Python side of the native CPU kernel, on the kernels' own types (the contract: the header of
``fused_attention.cpp`` and the docs' kernels page).

One kernel call attends the queries of ``B`` sequences, each over its own store, described per sequence (or per
padded group of sequences) by one ``Side`` for K and one for V (or, for a per-head layer, one pair per group of
heads, each naming its ``heads`` and the store's ``kv_heads``) (``kernel_side`` builds it from a ``PackedSide``
and the store's full-precision row chunks). ``native_attention_batch`` is the call; ``native_attention`` is the
one-store form (a padded batch in one store, dense rows as one tensor per side).

Everything else happens in C++: queries scaled and rotated once per (sequence, KV head) for TurboQuant keys, the
rotated-domain value sum rotated back once per query (``+ p * mu`` for centred values), every argument's size,
dtype and stride checked with an error naming it. The SIMD rules (widths, head-dim multiple, token blocks) live
in the C++ file; ``kernel_rules()`` asks it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tqbench.kernels.cpu import native_module
from tqbench.kernels.layouts import layout_of
from tqbench.kernels.reference import PackedSide

__all__ = ["NativeCall", "dense_chunks", "dense_side", "INT_SCORE_STEPS", "KEY_INT_SCORING", "PCAQ_INT16_MAX_WIDTH", "PCAQ_KEY_INT_SCORING",
           "int_score_bound",
           "pcaq_int_score_bound", "key_scoring", "kernel_rules", "kernel_side", "native_attention", "native_attention_batch",
           "refresh_side", "simd_order"]


_RULES: list[dict] = []
_MODULE: list = []  # the loaded extension, once native_module() has returned it (the per-call path skips its lock)


def _mod():
    if not _MODULE:
        _MODULE.append(native_module())
    return _MODULE[0]


@dataclass(slots=True)
class NativeCall:
    """What one call did: Sparse-V counts (in all and per sequence) and every transient byte it held (C++
    workspace: queries, partials, per-thread scores and decoded rows, tables; + every tensor converted to the compute
    dtype on the way in or out: rows, codebook, rotation, query, sinks, output)."""

    skipped_rows: int
    weighted_rows: int
    workspace_bytes: int
    skipped_per_sequence: tuple[int, ...] = ()
    weighted_per_sequence: tuple[int, ...] = ()


def kernel_rules() -> dict:
    """The built kernel's rules (asked once per process): ``isa``, ``min_block``, ``max_block``,
    ``blocks_per_thread``, ``simd_dim_multiple``, ``simd_turbo_bits``, ``max_head_dim``, ``max_dense_chunks``."""
    if not _RULES:
        _RULES.append(dict(native_module().rules()))
    return _RULES[0]


def simd_order(bits: int, d: int) -> torch.Tensor:
    """The coordinate each position holds when the built kernel decodes ``bits``-bit turbo rows 64 codes at a time."""
    return torch.tensor(native_module().simd_order(bits, d))


#: integer steps each side of zero of a key side's integer scoring: ``Side.score_int8`` (int8 query, uint8
#: codebook around 128) and ``Side.score_int16`` (int16 query and codebook; the C++ ``Q16``)
INT_SCORE_STEPS = {"score_int8": 127, "score_int16": 4095}


#: how the engine's fused calls score the packed turbo keys the kernel can score in integers (float32, 4/2-bit,
#: head_dim % 64 == 0, AVX-512 VNNI): 16 bits (teacher-forced KL within 1% of float scoring on the default model;
#: 8 bits is not: +8-11%; docs/measured.md)
KEY_INT_SCORING = "score_int16"


#: the widest pcaq code the kernel's 16-bit pcaq scoring cuts (8 codes of a qword stay inside its 64 bits)
PCAQ_INT16_MAX_WIDTH = 7
#: whether the engine scores pcaq keys in 16 bits (``Side.score_int16`` on a pcaq side; docs/measured.md)
PCAQ_KEY_INT_SCORING = False


def key_scoring(side, dt: torch.dtype) -> bool:
    """Set a K side's integer scoring (``KEY_INT_SCORING``) where this build can score it so; whether it did.
    The layouts table says which layouts the kernel can score in integers (``Layout.int_scoring``); the build
    says at which widths: turbo keys 4/3/2-bit codes (``score_int8_bits``); pcaq keys widths up to
    ``PCAQ_INT16_MAX_WIDTH`` on a build with VBMI + VNNI (``score_int16_pcaq``), where the engine chooses it
    (``PCAQ_KEY_INT_SCORING``: off, its KL moved by more than 1%); both float32 with head_dim % 64 == 0."""
    rules = kernel_rules()
    ok = dt == torch.float32 and side.head_dim % 64 == 0 and layout_of(side.kind).int_scoring
    if ok and side.kind == "turbo":
        ok = side.bits in rules["score_int8_bits"]
    elif ok and side.kind == "pcaq":
        ok = PCAQ_KEY_INT_SCORING and rules.get("score_int16_pcaq", False) and \
            side.widths is not None and int(side.widths.max()) <= PCAQ_INT16_MAX_WIDTH
    setattr(side, KEY_INT_SCORING, ok)
    return ok


def int_score_bound(qr: torch.Tensor, levels: torch.Tensor, norms: torch.Tensor, steps: int) -> torch.Tensor:
    """The most a key side's integer scoring moves each score from the float score, ``[..., M, N]``.

    ``qr`` ``[..., M, D]``: the scaled, rotated queries of one KV head (``scale * R q``); ``levels``: the codebook;
    ``norms`` ``[..., N]``: the rows' norms; ``steps``: ``INT_SCORE_STEPS[option]``. The kernel rounds each query
    in steps of ``a = max|qr| / steps`` and the codebook in steps of ``b = max|level| / steps`` (both half a step at
    most), then sums exactly, so ``|s_int - s| <= norm * (a / 2 * D * (max|level| + b / 2) + b / 2 * |qr|_1)``. A
    softmax over scores each moved by at most ``e`` moves each weight by a factor within ``exp(+-2e)``."""
    qr, lev = qr.double(), levels.double()
    d = qr.shape[-1]
    lmax = lev.abs().max()
    a = qr.abs().amax(-1, keepdim=True) / steps
    b = lmax / steps
    per_query = a / 2 * d * (lmax + b / 2) + b / 2 * qr.abs().sum(-1, keepdim=True)  # [..., M, 1]
    return per_query * norms.double()[..., None, :]


def pcaq_int_score_bound(qr: torch.Tensor, levels: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """The most 16-bit pcaq key scoring (``Side.score_int16`` on a pcaq side) moves a score from the float score,
    ``[..., M, 1]`` (the same for every row of the head).

    ``qr`` ``[..., H, M, D]``: the scaled, transformed queries (``scale * transform_h q``); ``levels``
    ``[H, D, 2**bits]``; ``widths`` ``[H, D]``. The kernel rounds each head's levels in steps of
    ``b = max|used level| / L`` (``L``: the rules' ``pcaq_level_steps``) and each query in two int16 parts, steps of
    ``a = max|qr| / Q16`` and the remainder in steps ``S`` times finer (``pcaq_lo_split``), then sums exactly:
    ``|s_int - s| <= a / (2 S) * sum_j (max_c |level_jc| + b / 2) + b / 2 * |qr|_1`` (the max over the codes ``c``
    of coordinate ``j``'s width)."""
    rules = kernel_rules()
    split, lsteps = rules["pcaq_lo_split"], rules["pcaq_level_steps"]
    qr, lev = qr.double(), levels.double()
    used = torch.arange(lev.shape[-1]) < (1 << widths.long())[..., None]  # [H, D, 2**bits]
    lmax = torch.where(used, lev.abs(), torch.zeros_like(lev)).amax(-1)  # [H, D]
    b = lmax.amax(-1) / lsteps  # [H]
    a = qr.abs().amax(-1, keepdim=True) / INT_SCORE_STEPS["score_int16"]  # [..., H, M, 1]
    per_head = (lmax + b[:, None] / 2).sum(-1)  # [H]
    return a / (2 * split) * per_head[:, None, None] + b[:, None, None] / 2 * qr.abs().sum(-1, keepdim=True)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def dense_chunks(rows: Sequence[torch.Tensor], dt: torch.dtype) -> tuple[list[torch.Tensor], int]:
    """Row chunks in the compute dtype (converted only where needed) and the bytes the conversions hold."""
    out, extra = [], 0
    for r in rows:  # (strides are the kernel's to check: a chunk it cannot read is refused by name)
        if r.dtype != dt:
            r = r.to(dt)
            extra += _nbytes(r)
        out.append(r)
    return out, extra


def dense_side(rows: Sequence[torch.Tensor], head_dim: int):
    """A dense side over row chunks ``[Bs, H, n_i, head_dim]`` as they are stored: in the query's dtype, or float16 /
    bfloat16 (the kernel converts each row exactly as it reads it; nothing is widened here)."""
    return _mod().Side(head_dim=head_dim, dense=list(rows))


def kernel_side(packed: PackedSide | None, dense: Sequence[torch.Tensor], n_before: int, head_dim: int,
                dt: torch.dtype):
    """``(Side, extra_bytes)``: one side of one store for the kernel.

    ``packed``: the packed run (``None``: every row is dense); ``dense``: the full-precision row chunks
    ``[Bs, H, n_i, head_dim]`` in token order, the first ``n_before`` rows of which come before the packed run;
    ``dt``: the compute dtype (float32 or float64). ``extra_bytes``: what converting the dense rows held.
    """
    chunks, extra = dense_chunks(dense, dt)
    side = _mod().Side
    if packed is None:
        return side(head_dim=head_dim, dense=chunks), extra
    p = packed.payload
    if layout_of(packed.kind).transformed:
        lev, rot = packed.levels, packed.rotation
        if lev is not None and lev.dtype != dt:
            lev = lev.to(dt)
            extra += _nbytes(lev)
        if rot is not None and rot.dtype != dt:
            rot = rot.to(dt)
            extra += _nbytes(rot)
        if packed.kind == "pcaq":  # calibrated keys: a transform per head, a width per coordinate, no norm
            return side(kind="pcaq", bits=packed.bits, head_dim=head_dim, n_before=n_before,
                        n_packed=packed.n_tokens, widths=packed.widths, levels=lev, rotation=rot, mu=packed.mu,
                        dense=chunks, **_payload_fields("pcaq", p)), extra
        return side(kind="turbo", bits=packed.bits, head_dim=head_dim, n_before=n_before, n_packed=packed.n_tokens,
                    levels=lev, rotation=rot, mu=packed.mu, dense=chunks, **_payload_fields("turbo", p)), extra
    return side(kind=packed.kind, bits=packed.bits, group=packed.group, head_dim=head_dim, n_before=n_before,
                n_packed=packed.n_tokens, dense=chunks, **_payload_fields(packed.kind, p)), extra


def _payload_fields(kind: str, payload: dict) -> dict:
    return {attr: payload[name] for attr, name in layout_of(kind).fields}


def refresh_side(side, payload: dict, n_packed: int, prefix: str = "") -> None:
    """Point a kept ``Side`` at its store's packed run after rows were packed into it (same codec and state: the
    codebook, rotation, widths and centring mean stand; only the payload tensors and the row count change).
    ``prefix``: the side's fields are ``payload[prefix + name]`` (a group of a per-head store's payload)."""
    for attr, name in layout_of(side.kind).fields:
        setattr(side, attr, payload[prefix + name])
    side.n_packed = n_packed


def native_attention_batch(
    query: torch.Tensor, k_sides: Sequence, v_sides: Sequence, scale: float, *,
    masks: Sequence[torch.Tensor | None] | None = None, softcap: float | None = None,
    sinks: torch.Tensor | None = None, sparse_v: float = 0.0, extra_bytes: int = 0,
    merge_into: Sequence[int] = (),
) -> tuple[torch.Tensor, NativeCall]:
    """Attention of ``query`` ``[B, Hq, L, D]`` over ``len(k_sides)`` stores; ``(out [B, Hq, L, Dv], call)``.

    Side ``i`` covers the next ``Bs_i`` sequences of the batch (its codes' / dense rows' batch; 1 in a ragged
    batch) and holds its own number of rows. ``masks[i]``: bool ``[Bs_i | 1, L, rows_i]`` (True = attend) or None
    (causal over the side's last ``L`` rows); ``sinks``: per-query-head sink logits ``[Hq]``; ``softcap``: logit
    soft-cap; ``sparse_v``: skip value rows below this softmax weight. ``extra_bytes``: the caller's transient
    bytes (converted rows), added to ``call.workspace_bytes``. ``merge_into``: per store, -1, or the index of the
    store whose queries it serves (a tier: rows those queries attend in the same softmax, before the store's own;
    same batch; its mask, if any, ``[Bs | 1, L, its rows]``; without one every tier row is visible); the query's
    batch is then the other stores' sequences.
    """
    if not query.is_floating_point():
        raise ValueError("query must be floating point (float32, float64, or bf16/fp16, computed in fp32), "
                         f"got {query.dtype}")
    dt = torch.float64 if query.dtype == torch.float64 else torch.float32
    q = query if query.dtype == dt else query.to(dt)
    extra_bytes += 0 if q is query else _nbytes(q)
    if sinks is not None and (sinks.dtype != dt or not sinks.is_contiguous()):
        sinks = sinks.to(dt).contiguous()
        extra_bytes += _nbytes(sinks)
    out, skipped, weighted, ws = _mod().attend(
        q, float(scale), k_sides, v_sides, [] if masks is None else list(masks), float(softcap or 0.0), sinks,
        float(sparse_v), list(merge_into))
    if out.dtype != query.dtype:  # the compute-dtype output is transient too
        extra_bytes += _nbytes(out)
        out = out.to(query.dtype)
    return out, NativeCall(sum(skipped), sum(weighted), ws + extra_bytes, tuple(skipped), tuple(weighted))


def native_attention(
    query: torch.Tensor, k_side: PackedSide | None, v_side: PackedSide | None, k_dense: torch.Tensor,
    v_dense: torch.Tensor, k_before: int, v_before: int, mask: torch.Tensor | None, scale: float, *,
    softcap: float | None = None, sinks: torch.Tensor | None = None, sparse_v: float = 0.0,
) -> tuple[torch.Tensor, NativeCall]:
    """One store (a padded batch): ``k_dense``/``v_dense`` ``[B, Hkv, n, D]`` full-precision rows, the first
    ``k_before``/``v_before`` of which come before the packed run; ``mask`` bool ``[B, L, total]`` or None."""
    dt = torch.float64 if query.dtype == torch.float64 else torch.float32
    ks, xk = kernel_side(k_side, [k_dense], k_before, query.shape[-1], dt)
    vs, xv = kernel_side(v_side, [v_dense], v_before, v_dense.shape[-1], dt)
    return native_attention_batch(query, [ks], [vs], scale, masks=[mask], softcap=softcap, sinks=sinks,
                                  sparse_v=sparse_v, extra_bytes=xk + xv)
