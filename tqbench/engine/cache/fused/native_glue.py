"""The native CPU path of the ``fused`` cache mode: one C++ call per attention (``tqbench.kernels.cpu``).

The call reads the packed codes where they are stored (no decoded copy, no code index) plus the layer's
full-precision rows ``[sinks | tail + this call's rows]``, joined once per call (a few dozen rows). Torch
does only the per-call O(D^2) work around it: rotating the queries once for TurboQuant keys, and the
rotated-domain value sum back once for TurboQuant values (``+ p * mu`` for centred codecs).

``native_plan`` says whether a call can run natively (which codecs, which masks); the caller falls back to
the torch reference with that reason otherwise.
"""

from __future__ import annotations

import torch

from tqbench.engine.cache.fused.layout import layout, packed_side
from tqbench.kernels.packing import byte_table
from tqbench.kernels.reference import code_values

KIND_CODES = {"turbo": 1, "affine-token": 2, "affine-channel": 3}
BLOCKS_PER_THREAD = 8  # token blocks per thread and kv head: keeps 2-16 threads busy at batch 1
MIN_BLOCK = 32  # the kernel's smallest token block

_tables: dict[tuple, torch.Tensor] = {}


def _byte_table(lut: torch.Tensor, bits: int) -> torch.Tensor:
    if 8 % bits:
        return lut.new_empty(0)
    key = (bits, lut.dtype, tuple(lut.tolist()))
    tab = _tables.get(key)
    if tab is None:
        tab = _tables[key] = byte_table(lut, bits).contiguous()
    return tab


def _side_args(store, part, n_before: int, d: int, dt: torch.dtype):
    """``([kind, bits, group, n_before, n_packed, codes, a, z, lut, byte_table], side)`` for one side's packed
    run (``side`` None when it has none); ``(None, None)`` when its codec has no native form."""
    empty = torch.empty(0, dtype=dt)
    if part is None:
        return [0, 0, 1, 0, 0, torch.empty(0, dtype=torch.uint8), empty, empty, empty, empty], None
    side = packed_side(store, part[2], part[1], d, dt)
    if side is None:
        return None, None
    p = side.payload
    if side.kind == "turbo":
        lut = side.levels.to(dt).contiguous()
        codes, a, z = p["idx"], p["norm"], empty
    else:
        lut = code_values(side.bits, dt, p["q"].device)
        codes, a, z = p["q"], p["scale"], p["zero"]
    return [KIND_CODES[side.kind], side.bits, side.group, n_before, part[1], codes, a, z, lut,
            _byte_table(lut, side.bits)], side


def _bool_mask(attention_mask, seq: int, total: int):
    """``[B, L, total]`` bool (True = attend), ``None`` (no mask), or a string saying why the kernel cannot."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
        return "per-head attention masks"
    m = attention_mask[:, 0, -seq:, -total:]
    if m.dtype == torch.bool:
        return m
    keep = m == 0
    if not bool((keep | (m <= torch.finfo(m.dtype).min / 2)).all()):
        return "an additive attention bias (not a 0/-inf mask)"
    return keep


def native_fused_attention(query: torch.Tensor, kv, attention_mask, scaling: float, *, softcap=None,
                           sinks=None, sparse_v: float = 0.0):
    """Attention of ``query`` [B, Hq, L, D] over the stored + new rows; ``str`` (why not) when it cannot run."""
    from tqbench.kernels.cpu import native_module

    b, hq, seq, d = query.shape
    hkv = kv.new_k.shape[1]
    dv = kv.new_v.shape[-1]
    g = hq // hkv
    dt = torch.float64 if query.dtype == torch.float64 else torch.float32
    kb, kp, ka = layout(kv.k_parts)
    vb, vp, va = layout(kv.v_parts)
    nbk, nbv = sum(x.shape[2] for x in kb), sum(x.shape[2] for x in vb)
    total = nbk + (kp[1] if kp else 0) + sum(x.shape[2] for x in ka) + kv.new_k.shape[2]
    mask = _bool_mask(attention_mask, seq, total)
    if isinstance(mask, str):
        return mask
    k_args, k_side = _side_args(kv.k_store, kp, nbk, d, dt)
    v_args, v_side = _side_args(kv.v_store, vp, nbv, dv, dt)
    if k_args is None or v_args is None:
        return f"no native kernel for {(kv.k_store if k_args is None else kv.v_store).codec.spec}"

    q = (query.to(dt) * scaling).reshape(b, hkv, g * seq, d).contiguous()
    qr = qmu = torch.empty(0, dtype=dt)
    if k_side is not None and k_side.kind == "turbo":
        qr = (q @ k_side.rotation.to(dt).T).contiguous()
        if k_side.mu is not None:
            qmu = (q * k_side.mu.to(dt)).sum(-1).contiguous()
    k_dense = torch.cat([x.to(dt) for x in (*kb, *ka, kv.new_k)], dim=2)
    v_dense = torch.cat([x.to(dt) for x in (*vb, *va, kv.new_v)], dim=2)
    threads = torch.get_num_threads()
    blocks = max(1, -(-BLOCKS_PER_THREAD * threads // (b * hkv)))
    sink_t = torch.empty(0, dtype=dt) if sinks is None else sinks.to(dt).contiguous()
    out_d, out_p, psum, counts = native_module().attend(
        q, qr, qmu, seq, total,
        *k_args, k_dense, *v_args, v_dense,
        torch.empty(0, dtype=torch.bool) if mask is None else mask.contiguous(),
        float(softcap or 0.0), sink_t, float(sparse_v), blocks,
    )
    out = out_d
    if v_side is not None and v_side.kind == "turbo":
        out = out + out_p @ v_side.rotation.to(dt)
        if v_side.mu is not None:
            out = out + psum[..., None] * v_side.mu.to(dt)
    layer = kv.layer
    nblk = max(1, min(blocks, -(-total // MIN_BLOCK)))
    workspace = (k_dense.numel() + v_dense.numel() + b * hkv * nblk * (3 + 2 * dv) * g * seq) * q.element_size()
    layer.native_workspace = max(getattr(layer, "native_workspace", 0), workspace)
    skipped, visited = (int(x) for x in counts.tolist())
    layer.sparse_v_rows[0] += skipped
    layer.sparse_v_rows[1] += visited
    return out.view(b, hq, seq, dv).to(query.dtype)
