"""TurboQuant (arXiv 2504.19874): norm + random rotation + per-coordinate Lloyd-Max codebook.

- :class:`TurboCodec` ``turbo{b}`` (b = 1..4): fields ``idx`` (packed b-bit indices) and ``norm`` (fp16).
- :class:`TurboProdCodec` ``turbo{b}-qjl`` (b = 2..4): a (b-1)-bit TurboCodec plus a 1-bit QJL sign sketch of
  the residual: fields ``idx``, ``norm``, ``qjl``, ``rnorm``. Inner products with the decoded rows are
  unbiased (over the random sketch) whatever the MSE stage stores, norm correction included.
- :class:`TurboSplitCodec` ``turbo{b}`` with fractional b (1.5, 2.5, 3.5): the ``round(frac*d)`` channels
  with the largest mean |x| (chosen per head by ``calibrate``) at ``ceil(b)`` bits, the rest at ``floor(b)``
  bits, each subset an independent TurboQuant instance: fields ``idx_hi``, ``norm_hi``, ``idx_lo``,
  ``norm_lo``; state ``perm`` (int16 ``[B, H, 1, D]``, hi channels first).

With ``center=True`` every variant subtracts a per-head mean (state ``mu``, fp16 ``[B, H, 1, D]``).
"""

from __future__ import annotations

import math

import torch

from tqbench.kernels.packing import (
    byte_table,
    lookup_packed,
    max_values,
    pack_bits,
    packed_nbytes,
    unpack_bits,
)

from .base import Codec, Encoded, compute_dtype, native_encoder
from .codebooks import lloyd_max_codebook
from .rotation import ROTATIONS, gaussian_matrix, gaussian_matrix_bytes, rotation_bytes, rotation_matrix

__all__ = ["TurboCodec", "TurboProdCodec", "TurboSplitCodec"]

_FP16_MAX = torch.finfo(torch.float16).max
#: (rotation kind, seed, head_dim, device, dtype) -> the rotation matrix: a constant, never written, one copy per
#: process (a model's layers and sides read the same 16 KB+ table: fewer bytes for the decode step's caches to hold)
_SHARED_ROTATIONS: dict[tuple, torch.Tensor] = {}
_Device = torch.device | str | None


def _check_common(rotation: str, center: bool, norm_correction: bool, seed: int) -> None:
    if rotation not in ROTATIONS:
        raise ValueError(f"unknown rotation {rotation!r}: valid rotations are {', '.join(ROTATIONS)}")
    for name, flag in (("center", center), ("norm_correction", norm_correction)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be True or False, got {flag!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")


def _to_fp16_norm(n: torch.Tensor) -> torch.Tensor:
    return n.clamp(0, _FP16_MAX).to(torch.float16)


class _Centered(Codec):
    """Shared centering logic: ``calibrate`` stores the per-head mean; encode/decode subtract/add it."""

    center: bool = False

    def calibrate(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self.check_input(x)
        if not self.center:
            return {}
        return {"mu": x.to(compute_dtype(x.dtype)).mean(dim=2, keepdim=True).to(torch.float16)}

    def _mu(self, state: dict[str, torch.Tensor]) -> torch.Tensor | None:
        if not self.center:
            return None
        if "mu" not in state:
            raise ValueError(f"{self.spec}: center=True needs the state from calibrate() (missing 'mu')")
        return state["mu"]

    def _center(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        xc = x.to(compute_dtype(x.dtype))
        mu = self._mu(state)
        return xc if mu is None else xc - mu.to(xc.dtype)

    def _uncenter(self, y: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        mu = self._mu(state)
        return y if mu is None else y + mu.to(y.dtype)


class TurboCodec(_Centered):
    """TurboQuant-MSE at ``bits`` (1..4) bits per coordinate. Fields ``idx`` ``[B,H,T,ceil(D*b/8)]``, ``norm``."""

    layout = "turbo"

    def __init__(
        self,
        bits: int = 4,
        rotation: str = "qr",
        center: bool = False,
        norm_correction: bool = True,
        seed: int = 0,
    ) -> None:
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 4:
            raise ValueError(f"turbo bits must be an integer in 1..4, got {bits!r}")
        _check_common(rotation, center, norm_correction, seed)
        self.bits, self.rotation, self.center = bits, rotation, center
        self.norm_correction, self.seed = norm_correction, seed
        self.spec = f"turbo{bits}"
        self._consts: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._dims: set[int] = set()

    # -- constants for the fused path -----------------------------------------------------------
    #: scores and value sums can be computed from indices in the rotated domain (see ARCHITECTURE.md)
    rotated_domain = True

    def _tables(
        self, head_dim: int, device: _Device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = (head_dim, str(torch.device(device) if device is not None else "cpu"), dtype)
        if key not in self._consts:
            shared = (self.rotation, self.seed, *key)  # codecs of one rotation share one copy (every layer's K, V)
            if shared not in _SHARED_ROTATIONS:
                _SHARED_ROTATIONS[shared] = rotation_matrix(head_dim, self.rotation, self.seed).to(device=device,
                                                                                                  dtype=dtype)
            levels = lloyd_max_codebook(head_dim, self.bits)
            bounds = (0.5 * (levels[1:] + levels[:-1])).to(device=device, dtype=dtype)
            self._consts[key] = (_SHARED_ROTATIONS[shared], levels.to(device=device, dtype=dtype), bounds)
            self._dims.add(head_dim)
        return self._consts[key]

    def _dim(self, head_dim: int | None) -> int:
        if head_dim is not None:
            return head_dim
        if len(self._dims) != 1:
            raise ValueError(
                f"{self.spec}: pass head_dim (this codec has seen head dims {sorted(self._dims)})"
            )
        return next(iter(self._dims))

    def rotation_tensor(
        self, device: _Device = None, dtype: torch.dtype = torch.float32, head_dim: int | None = None
    ) -> torch.Tensor:
        """The orthogonal ``R`` ``[D, D]``: rotated row = ``u @ R.T``, decoded row = ``c[idx] @ R``.

        ``head_dim`` defaults to the one this codec has encoded (a codec serves one layer).
        """
        return self._tables(self._dim(head_dim), device, dtype)[0]

    def codebook_tensor(
        self, device: _Device = None, dtype: torch.dtype = torch.float32, head_dim: int | None = None
    ) -> torch.Tensor:
        """The sorted Lloyd-Max levels ``c`` ``[2**bits]`` for unit rows (scale by ``norm``)."""
        return self._tables(self._dim(head_dim), device, dtype)[1]

    def packed_side(self, payload: dict, n: int, head_dim: int, dtype: torch.dtype, state: dict):
        from tqbench.kernels.reference import PackedSide

        dev = payload["idx"].device
        return PackedSide(self.layout, self.bits, payload, n, head_dim, levels=self.codebook_tensor(dev, dtype, head_dim),
                          rotation=self.rotation_tensor(dev, dtype, head_dim), mu=state.get("mu"))

    def unpack_indices(self, enc: Encoded, head_dim: int | None = None) -> torch.Tensor:
        """Codebook indices ``uint8 [B, H, T, D]``; ``D`` defaults to the packed width's (exact for encodable D)."""
        packed = enc["idx"]
        return unpack_bits(packed, self.bits, head_dim if head_dim is not None else self._dim_of(packed))

    def _dim_of(self, packed: torch.Tensor) -> int:
        """The head_dim a packed index row encodes (exact for every head_dim ``encode`` accepts)."""
        seen = [d for d in self._dims if packed_nbytes(d, self.bits) == packed.shape[-1]]
        return seen[0] if len(seen) == 1 else max_values(packed.shape[-1], self.bits)

    # -- core (also used by the prod and split variants) ---------------------------------------
    def _quantize(self, xc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``xc`` in compute dtype ``[..., d]`` -> (indices uint8 ``[..., d]``, fp16 norm ``[..., 1]``)."""
        rot, levels, bounds = self._tables(xc.shape[-1], xc.device, xc.dtype)
        n = torch.linalg.vector_norm(xc, dim=-1, keepdim=True)
        u_rot = (xc / n.clamp_min(torch.finfo(xc.dtype).tiny)) @ rot.T
        idx = torch.bucketize(u_rot, bounds)
        if self.norm_correction:  # least-squares scale of the row onto its dequantized direction
            c = levels[idx]
            n = n * (u_rot * c).sum(-1, keepdim=True) / (c * c).sum(-1, keepdim=True)
        return idx.to(torch.uint8), _to_fp16_norm(n)

    def _dequantize(self, idx: torch.Tensor, norm: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rot, levels, _ = self._tables(idx.shape[-1], idx.device, dtype)
        return (levels[idx.long()] @ rot) * norm.to(dtype)

    # -- codec -----------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> Encoded:
        self.check_input(x)
        if (problem := self.encode_problem(x.shape[-1])) is not None:
            raise ValueError(problem)
        xc = self._center(x, state)
        fast = self._triton_quantize_pack(xc) if xc.device.type == "cuda" else self._native_quantize_pack(xc)
        if fast is not None:
            return fast
        idx, norm = self._quantize(xc)
        return {"idx": pack_bits(idx, self.bits, check=False), "norm": norm}

    def encode_problem(self, d: int) -> str | None:
        """Why rows of head_dim ``d`` cannot be encoded (None: they can)."""
        if not self.center and max_values(packed_nbytes(d, self.bits), self.bits) != d:
            return (f"{self.spec}: head_dim {d} cannot be unpacked unambiguously "
                    f"(head_dim*{self.bits} must be a multiple of 8, or use center=True)")
        return None

    def _triton_quantize_pack(self, xc: torch.Tensor) -> Encoded | None:
        """``_quantize`` + ``pack_bits`` in one Triton launch (the GPU append path: ``kernels/turbo_quantize.py``),
        or None when it cannot run here (the torch path runs and ``encoder_fallback`` says why)."""
        from tqbench.kernels import triton_status

        ok, why = triton_status()
        if not ok:
            self.encoder_fallback = f"quantize-and-pack ran in torch (the Triton kernel cannot run: {why})"
            return None
        if xc.dtype != torch.float32:
            self.encoder_fallback = f"quantize-and-pack ran in torch ({xc.dtype} rows: the Triton kernel computes in fp32)"
            return None
        from tqbench.kernels.turbo_quantize import turbo_quantize

        rot, levels, _ = self._tables(xc.shape[-1], xc.device, xc.dtype)
        return turbo_quantize(xc, None, rot, levels, self.bits, self.norm_correction)

    def _native_quantize_pack(self, xc: torch.Tensor) -> Encoded | None:
        """``_quantize`` + ``pack_bits`` in one native CPU call (the decode step's append path), or None when the
        native kernel is not available here (the torch path above runs; ``native_status`` says why)."""
        if xc.device.type != "cpu" or xc.dtype not in (torch.float32, torch.float64):
            return None
        mod = native_encoder(self)
        if mod is None:
            return None
        rot, levels, bounds = self._tables(xc.shape[-1], xc.device, xc.dtype)
        codes, norm = mod.turbo_encode(xc.contiguous(), rot.contiguous(), levels.contiguous(), bounds.contiguous(),
                                       self.bits, self.norm_correction)
        return {"idx": codes, "norm": norm}

    def codebook_values(self, enc: Encoded, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
        """``c[idx]`` ``[B, H, T, D]``: the rotated-domain unit rows, straight from the packed bytes."""
        key = ("bytes", head_dim, enc["idx"].device, dtype)
        if key not in self._consts:
            self._consts[key] = byte_table(self._tables(head_dim, enc["idx"].device, dtype)[1], self.bits)
        return lookup_packed(enc["idx"], self.bits, head_dim, self._consts[key])

    def decode(self, enc: Encoded, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        mu = self._mu(state)
        d = mu.shape[-1] if mu is not None else self._dim_of(enc["idx"])
        cd = compute_dtype(dtype)
        rot = self._tables(d, enc["idx"].device, cd)[0]
        y = (self.codebook_values(enc, d, cd) @ rot) * enc["norm"].to(cd)
        return self._uncenter(y, state).to(dtype)

    def unit_bytes(self, head_dim: int) -> int:
        return packed_nbytes(head_dim, self.bits) + 2

    def shared_items(self, head_dim: int) -> dict[str, int]:
        """The rotation (per dim, kind, seed) and the codebook (per dim, bits) are separate objects."""
        return {
            f"rotation:{self.rotation}:seed{self.seed}:d{head_dim}": rotation_bytes(head_dim, self.rotation),
            f"codebook:lloyd-max:d{head_dim}:b{self.bits}": (1 << self.bits) * 4,
        }

    def __repr__(self) -> str:
        return (
            f"TurboCodec({self.spec!r}, rotation={self.rotation!r}, center={self.center}, "
            f"norm_correction={self.norm_correction}, seed={self.seed})"
        )


class TurboProdCodec(_Centered):
    """TurboQuant-prod: (b-1)-bit TurboCodec + 1-bit QJL of the residual. Fields ``idx norm qjl rnorm``."""

    def __init__(
        self,
        bits: int = 3,
        rotation: str = "qr",
        center: bool = False,
        norm_correction: bool = True,
        seed: int = 0,
    ) -> None:
        if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 4:
            raise ValueError(f"turbo-qjl bits must be an integer in 2..4, got {bits!r}")
        _check_common(rotation, center, norm_correction, seed)
        self.bits, self.center, self.seed = bits, center, seed
        self.mse = TurboCodec(bits - 1, rotation, False, norm_correction, seed)
        self.spec = f"turbo{bits}-qjl"
        self._sketch: dict[tuple, torch.Tensor] = {}

    def qjl_tensor(
        self, head_dim: int, device: _Device = None, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """The Gaussian sketch ``S`` ``[D, D]``: bits = ``sign(S r)``, residual = ``sqrt(pi/2)/D |r| S^T sign``."""
        key = (head_dim, str(torch.device(device) if device is not None else "cpu"), dtype)
        if key not in self._sketch:
            self._sketch[key] = gaussian_matrix(head_dim, self.seed).to(device=device, dtype=dtype)
        return self._sketch[key]

    def _head_dim(self, enc: Encoded, state: dict[str, torch.Tensor]) -> int:
        mu = self._mu(state)
        if mu is not None:
            return mu.shape[-1]
        return min(max_values(enc["qjl"].shape[-1], 1), max_values(enc["idx"].shape[-1], self.bits - 1))

    def encode(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> Encoded:
        self.check_input(x)
        d = x.shape[-1]
        xc = self._center(x, state)
        idx, norm = self.mse._quantize(xc)
        r = xc - self.mse._dequantize(idx, norm, xc.dtype)
        signs = (r @ self.qjl_tensor(d, xc.device, xc.dtype).T >= 0).to(torch.uint8)
        enc = {
            "idx": pack_bits(idx, self.bits - 1, check=False),
            "norm": norm,
            "qjl": pack_bits(signs, 1, check=False),
            "rnorm": _to_fp16_norm(torch.linalg.vector_norm(r, dim=-1, keepdim=True)),
        }
        if self._head_dim(enc, state) != d:
            raise ValueError(
                f"{self.spec}: head_dim {d} cannot be unpacked unambiguously "
                "(use a head_dim that is a multiple of 8, or center=True)"
            )
        return enc

    def decode(self, enc: Encoded, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        d = self._head_dim(enc, state)
        cd = compute_dtype(dtype)
        y = self.mse._dequantize(unpack_bits(enc["idx"], self.bits - 1, d), enc["norm"], cd)
        signs = unpack_bits(enc["qjl"], 1, d).to(cd) * 2 - 1
        gamma = math.sqrt(math.pi / 2) / d * enc["rnorm"].to(cd)
        y = y + gamma * (signs @ self.qjl_tensor(d, signs.device, cd))
        return self._uncenter(y, state).to(dtype)

    def unit_bytes(self, head_dim: int) -> int:
        return packed_nbytes(head_dim, self.bits - 1) + 2 + packed_nbytes(head_dim, 1) + 2

    def shared_items(self, head_dim: int) -> dict[str, int]:
        items = self.mse.shared_items(head_dim)
        items[f"qjl-gaussian:seed{self.seed}:d{head_dim}"] = gaussian_matrix_bytes(head_dim)
        return items

    def __repr__(self) -> str:
        return (
            f"TurboProdCodec({self.spec!r}, rotation={self.mse.rotation!r}, center={self.center}, "
            f"norm_correction={self.mse.norm_correction}, seed={self.seed})"
        )


class TurboSplitCodec(_Centered):
    """Outlier split at fractional ``bits``: ``round(frac*D)`` channels at ceil(b) bits, the rest at floor(b)."""

    def __init__(
        self,
        bits: float = 2.5,
        rotation: str = "qr",
        center: bool = False,
        norm_correction: bool = True,
        seed: int = 0,
    ) -> None:
        if (
            isinstance(bits, bool)
            or not isinstance(bits, int | float)
            or not 1 < bits < 4
            or bits == int(bits)
        ):
            raise ValueError(f"split turbo bits must be a fractional number between 1 and 4, got {bits!r}")
        _check_common(rotation, center, norm_correction, seed)
        lo = math.floor(bits)
        self.bits, self.frac, self.center, self.seed = float(bits), bits - lo, center, seed
        self.lo = TurboCodec(lo, rotation, False, norm_correction, seed)
        self.hi = TurboCodec(lo + 1, rotation, False, norm_correction, seed + 1)
        self.spec = f"turbo{bits:g}"

    def n_hi(self, head_dim: int) -> int:
        """Channels quantized at ``ceil(bits)`` bits."""
        n = round(self.frac * head_dim)
        if not 1 <= n <= head_dim - 1:
            raise ValueError(f"{self.spec}: head_dim {head_dim} is too small to split into two channel sets")
        return n

    def calibrate(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        state = super().calibrate(x)
        xc = self._center(x, state)
        n_hi = self.n_hi(x.shape[-1])
        order = xc.abs().mean(dim=2).argsort(dim=-1, descending=True, stable=True)
        hi, lo = order[..., :n_hi].sort(dim=-1).values, order[..., n_hi:].sort(dim=-1).values
        state["perm"] = torch.cat([hi, lo], dim=-1).unsqueeze(2).to(torch.int16)
        return state

    def _perm(self, state: dict[str, torch.Tensor], shape: torch.Size) -> torch.Tensor:
        if "perm" not in state:
            raise ValueError(
                f"{self.spec}: the outlier split needs the state from calibrate() (missing 'perm')"
            )
        return state["perm"].long().expand(shape)

    def encode(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> Encoded:
        self.check_input(x)
        n_hi = self.n_hi(x.shape[-1])
        xp = self._center(x, state).gather(-1, self._perm(state, x.shape))
        idx_hi, norm_hi = self.hi._quantize(xp[..., :n_hi])
        idx_lo, norm_lo = self.lo._quantize(xp[..., n_hi:])
        return {
            "idx_hi": pack_bits(idx_hi, self.hi.bits, check=False),
            "norm_hi": norm_hi,
            "idx_lo": pack_bits(idx_lo, self.lo.bits, check=False),
            "norm_lo": norm_lo,
        }

    def decode(self, enc: Encoded, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        if "perm" not in state:
            raise ValueError(
                f"{self.spec}: the outlier split needs the state from calibrate() (missing 'perm')"
            )
        d = state["perm"].shape[-1]
        n_hi, cd = self.n_hi(d), compute_dtype(dtype)
        y_hi = self.hi._dequantize(unpack_bits(enc["idx_hi"], self.hi.bits, n_hi), enc["norm_hi"], cd)
        y_lo = self.lo._dequantize(unpack_bits(enc["idx_lo"], self.lo.bits, d - n_hi), enc["norm_lo"], cd)
        yp = torch.cat([y_hi, y_lo], dim=-1)
        y = torch.empty_like(yp).scatter_(-1, self._perm(state, yp.shape), yp)
        return self._uncenter(y, state).to(dtype)

    def unit_bytes(self, head_dim: int) -> int:
        n_hi = self.n_hi(head_dim)
        return packed_nbytes(n_hi, self.hi.bits) + packed_nbytes(head_dim - n_hi, self.lo.bits) + 4

    def shared_items(self, head_dim: int) -> dict[str, int]:
        n_hi = self.n_hi(head_dim)
        return self.hi.shared_items(n_hi) | self.lo.shared_items(head_dim - n_hi)

    def __repr__(self) -> str:
        return (
            f"TurboSplitCodec({self.spec!r}, rotation={self.lo.rotation!r}, center={self.center}, "
            f"norm_correction={self.lo.norm_correction}, seed={self.seed})"
        )
