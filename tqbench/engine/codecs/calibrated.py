"""``pcaq{b}``: keys in a basis fitted per (layer, KV head) on calibration K/Q (``calibrated_fit``), ``b`` bits
per coordinate on average (``pcaq2``, ``pcaq2.5``, ``pcaq3`` ...), split over the coordinates by reverse
water-filling on their variances, each coordinate quantized with its group's Lloyd-Max levels.

Per row: ``z = T (k - mu)`` (``T = B^-1``, ``mu`` the per-head mean of the prefill, as turbo's key centering),
``idx_j = nearest level of z_j / sigma_j`` at width ``bits_j``, packed into one LSB-first bit stream of
``sum(bits_j)`` bits: exactly ``ceil(b * D / 8)`` bytes per row, no norm or scale (field ``idx``). Decode:
``k_hat = mu + B_hat level[idx]`` (``B_hat``: the basis with sigma folded into its columns). State: ``mu`` (fp16
``[B, H, 1, D]``). Shared per layer (counted once per layer by the cache and the estimate): the basis (int8 +
one fp16 scale per column), and per width setting the bit map (uint8 ``[H, D]``) and the Lloyd-Max levels the
bit map uses (fp16).

Keys only: for values the measured transforms did not beat the random rotation (docs/incoming/i21t.md), so a
``pcaq`` value codec is refused with that reason. The fused mode scores the packed rows straight from their codes
(native CPU kernel, Triton and the torch reference; ``fused_tables`` gives them the per-head transform, widths and levels):
``q.k_hat = <B_hat^T q, level[idx]> + q.mu``, the query transformed once per step.
"""

from __future__ import annotations

import math

import torch

from tqbench.kernels.packing import pack_widths, unpack_widths

from .base import Codec, Encoded, compute_dtype, native_encoder
from .calibrated_fit import GROUP, MAX_BITS, level_offset, water_fill
from .names import CALIBRATED_SPECS, calibrated_bits, is_calibrated_spec
from .transforms_file import CalibratedTransforms, TransformsMismatch, load_transforms

__all__ = ["CALIBRATED_SPECS", "PcaKeyCodec", "calibrated_bits", "is_calibrated_spec", "pack_widths", "unpack_widths"]

#: the calibrated specs listed by ``tqbench --headless policies`` (any ``pcaq{b}`` with ``b*head_dim`` whole works)
#: per (fit, layer, width, dim, device, dtype): bit map, basis, encoder, sigma, levels, bounds (shared by codecs)
_TABLES: dict[tuple, tuple] = {}


class PcaKeyCodec(Codec):
    """``pcaq{b}`` for the keys of one layer (``layer``) under the transforms in ``calib`` ("" = shipped)."""

    layout = "pcaq"

    def __init__(self, bits: float, layer: int | None = None, calib: str = "", role: str = "k",
                 heads: tuple[int, ...] | None = None) -> None:
        if role != "k":
            raise ValueError(
                f"pcaq{bits:g} is a key codec (PCA in the metric of the queries): for values the measured "
                "calibrated transforms did not beat the random rotation; use turbo for V (e.g. v=turbo2)"
            )
        if isinstance(bits, bool) or not isinstance(bits, (int, float)) or not 0.5 <= bits <= MAX_BITS:
            raise ValueError(f"pcaq bits must be between 0.5 and {MAX_BITS}, got {bits!r}")
        self.bits = float(bits)
        self.layer = layer
        self.calib = calib or ""
        #: the layer's KV heads this codec serves, in row order (None: all of them): their fitted tables
        self.heads = None if heads is None else tuple(int(h) for h in heads)
        self.spec = f"pcaq{self.bits:g}"
        #: this codec's tables per (head_dim, device, dtype), kept for its lifetime: the rows it packs decode with
        #: the tables they were packed with, and the per-step paths skip the transforms file's freshness check
        self._mine: dict[tuple, tuple] = {}

    # -- the fit and this layer's tables --------------------------------------------------------------
    @property
    def transforms(self) -> CalibratedTransforms:
        return load_transforms(self.calib)

    def total_bits(self, head_dim: int) -> int:
        total = self.bits * head_dim
        if abs(total - round(total)) > 1e-9:
            raise ValueError(f"{self.spec}: {self.bits:g} bits x head_dim {head_dim} is not a whole number of bits "
                             f"per row; use a width that is a multiple of 1/{head_dim}")
        return int(round(total))

    def _layer_index(self) -> int:
        if self.layer is None:
            raise ValueError(f"{self.spec}: a calibrated codec serves one layer; build it with layer=<index> "
                             "(Policy.build_codec(spec, role, layer=...))")
        return self.layer

    def widths(self, head_dim: int) -> torch.Tensor:
        """Bits per coordinate ``int64 [H, D]`` for this layer's heads (water-filled; every row sums to ``b * D``)."""
        return self._layer_tables(head_dim, "cpu", torch.float32)[0]

    def _fit(self) -> dict[str, torch.Tensor]:
        """This layer's fitted tensors, for the heads this codec serves."""
        tr = self.transforms
        fit = tr.head(self._layer_index())
        if self.heads is None:
            return fit
        if any(not 0 <= h < tr.kv_heads for h in self.heads):
            raise TransformsMismatch(f"{self.spec}: heads {list(self.heads)} are not all KV heads of the calibrated "
                                     f"transforms ({tr.describe()}, {tr.kv_heads} KV heads)")
        index = torch.tensor(self.heads)
        return {name: t.index_select(0, index) for name, t in fit.items()}

    def _check_rows(self, heads: int, head_dim: int) -> None:
        if self.heads is None:
            self.transforms.check_geometry(heads, head_dim)
            return
        self.transforms.check_geometry(self.transforms.kv_heads, head_dim)
        if heads != len(self.heads):
            raise ValueError(f"{self.spec}: built for heads {list(self.heads)}, got rows of {heads} heads")

    def _layer_tables(self, head_dim: int, device, dtype: torch.dtype) -> tuple:
        mine = ("layer", head_dim, str(device), dtype)
        if mine not in self._mine:
            self._mine[mine] = self._shared_tables(head_dim, device, dtype)
        return self._mine[mine]

    def _shared_tables(self, head_dim: int, device, dtype: torch.dtype) -> tuple:
        tr = self.transforms
        key = (tr.path, tr.digest, self._layer_index(), self.heads, self.bits, head_dim, str(device), dtype)
        if key in _TABLES:
            return _TABLES[key]
        if len(_TABLES) > 512:  # a handful of fits x layers x widths: bounded
            _TABLES.clear()
        fit = self._fit()
        heads, d = fit["basis"].shape[0], fit["basis"].shape[-1]
        if d != head_dim:
            self._check_rows(heads, head_dim)
        total = self.total_bits(d)
        widths = torch.stack([water_fill(fit["var"][h], fit["mse"][h], total) for h in range(heads)])
        nlev = 1 << MAX_BITS
        levels = torch.zeros(heads, d, nlev, dtype=torch.float64)
        bounds = torch.full((heads, d, nlev - 1), math.inf, dtype=torch.float64)
        for h in range(heads):
            for j in range(d):
                w = int(widths[h, j])
                if w == 0:
                    continue
                lv = fit["levels"][h, j // GROUP, level_offset(w):level_offset(w) + (1 << w)].double()
                levels[h, j, : 1 << w] = lv
                bounds[h, j, : (1 << w) - 1] = 0.5 * (lv[1:] + lv[:-1])
        basis = fit["basis"].double() * fit["scale"].double()[:, None, :]  # B_hat: sigma folded into the columns
        enc = torch.linalg.inv(basis)  # the exact inverse of the stored basis: decode(encode) is consistent
        out = (widths, basis.to(device, dtype), enc.to(device, dtype), levels.to(device, dtype),
               bounds.to(device, dtype))
        _TABLES[key] = out
        return out

    def packed_side(self, payload: dict, n: int, head_dim: int, dtype: torch.dtype, state: dict):
        from tqbench.kernels.reference import PackedSide

        widths, transform, levels, maxw = self.fused_tables(head_dim, payload["idx"].device, dtype)
        return PackedSide(self.layout, maxw, payload, n, head_dim, levels=levels, rotation=transform, mu=state.get("mu"),
                          widths=widths)

    def fused_tables(self, head_dim: int, device, dtype: torch.dtype) -> tuple:
        """What the fused kernels read: ``(widths uint8 [H, D], transform [H, D, D], levels [H, D, 2**maxw], maxw)``
        with ``transform = B_hat^T`` (the query's coordinate ``j`` is ``<transform[h, j], q>``) and ``levels`` the
        per-coordinate Lloyd-Max values up to the widest width in use (cached with the layer's tables)."""
        key = ("fused", head_dim, str(device), dtype)
        if key not in self._mine:
            widths, basis, _, levels, _ = self._layer_tables(head_dim, device, dtype)
            maxw = max(int(widths.max()), 1)
            self._mine[key] = (widths.to(device=device, dtype=torch.uint8).contiguous(),
                               basis.transpose(-1, -2).contiguous(), levels[..., : 1 << maxw].contiguous(), maxw)
        return self._mine[key]

    # -- codec ----------------------------------------------------------------------------------------
    def calibrate(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self.check_input(x)
        layer = self._layer_index()
        self._check_rows(x.shape[1], x.shape[-1])
        self.transforms.head(layer)
        return {"mu": x.to(compute_dtype(x.dtype)).mean(dim=2, keepdim=True).to(torch.float16)}

    def _mu(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        if "mu" not in state:
            raise ValueError(f"{self.spec}: encode/decode need the state from calibrate() (missing 'mu')")
        return state["mu"]

    def encode(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> Encoded:
        self.check_input(x)
        b, h, t, d = x.shape
        cd = compute_dtype(x.dtype)
        widths, _, enc, _, bounds = self._layer_tables(d, x.device, cd)
        if widths.shape[0] != h:
            self._check_rows(h, d)
        xc = x.to(cd) - self._mu(state).to(cd)
        fast = self._native_encode(xc, enc, bounds)
        if fast is not None:
            return {"idx": fast}
        z = torch.einsum("bhtd,hjd->bhtj", xc, enc)  # standardized coordinates
        zt = z.permute(1, 3, 0, 2).reshape(h, d, b * t).contiguous()
        idx = torch.searchsorted(bounds.contiguous(), zt).view(h, d, b, t).permute(2, 0, 3, 1)
        packed = torch.stack([pack_widths(idx[:, i], widths[i]) for i in range(h)], dim=1)
        return {"idx": packed}

    def _native_encode(self, xc: torch.Tensor, enc: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor | None:
        """The quantize + pack of ``encode`` in one native CPU call (the decode step's append path), or None where
        it cannot run (the torch path runs, and ``encoder_fallback`` says why in the cache report)."""
        if xc.device.type != "cpu":
            return None
        mod = native_encoder(self)
        if mod is None:
            return None
        widths = self.fused_tables(xc.shape[-1], xc.device, xc.dtype)[0]
        return mod.pcaq_encode(xc.contiguous(), enc.contiguous(), bounds.contiguous(), widths)

    def decode(self, enc: Encoded, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        mu = self._mu(state)
        d = mu.shape[-1]
        cd = compute_dtype(dtype)
        widths, basis, _, levels, _ = self._layer_tables(d, enc["idx"].device, cd)
        packed = enc["idx"]
        h = packed.shape[1]
        idx = torch.stack([unpack_widths(packed[:, i], widths[i]) for i in range(h)], dim=1)  # [B, H, T, D]
        lv = levels[None, :, None].expand(idx.shape[0], h, idx.shape[2], d, levels.shape[-1])
        z = lv.gather(-1, idx[..., None]).squeeze(-1)
        y = torch.einsum("bhtj,hdj->bhtd", z, basis) + mu.to(cd)
        return y.to(dtype)

    # -- bytes ----------------------------------------------------------------------------------------
    def unit_bytes(self, head_dim: int) -> int:
        return (self.total_bits(head_dim) + 7) // 8

    def shared_items(self, head_dim: int) -> dict[str, int]:
        """Per layer: the basis (int8) + its column scales (fp16), whatever the width; per width the bit map
        (uint8) and the Lloyd-Max levels it uses (fp16, one table per group of coordinates and width in use).
        A codec serving some heads (``heads``) names them per head, so heads served by codecs of different
        widths count one basis each."""
        tr = self.transforms
        layer = self._layer_index()
        fit = self._fit()
        heads, d = fit["basis"].shape[0], fit["basis"].shape[-1]
        widths = self.widths(head_dim)
        levels = [0] * heads
        for h in range(heads):
            for g in range(0, d, GROUP):
                for w in {int(x) for x in widths[h, g:g + GROUP]} - {0}:
                    levels[h] += (1 << w) * 2
        tag = f"calib:{tr.digest}:L{layer}:k"
        if self.heads is None:
            return {f"{tag}:basis": heads * d * d + heads * d * 2,
                    f"{tag}:{self.spec}:bitmap+levels": heads * d + sum(levels)}
        out = {}
        for i, h in enumerate(self.heads):
            out[f"{tag}:h{h}:basis"] = d * d + d * 2
            out[f"{tag}:h{h}:{self.spec}:bitmap+levels"] = d + levels[i]
        return out

    def __repr__(self) -> str:
        heads = "" if self.heads is None else f", heads={self.heads}"
        return f"PcaKeyCodec({self.spec!r}, layer={self.layer}, calib={self.calib!r}{heads})"


__all__ += ["TransformsMismatch"]
