"""Dense passthrough codecs: rows stored unchanged, bytes counted at the named width."""

from __future__ import annotations

import torch

from .base import Codec, Encoded

__all__ = ["DENSE_WIDTHS", "DenseCodec"]

DENSE_WIDTHS = {"fp16": 2, "bf16": 2, "fp32": 4}


class DenseCodec(Codec):
    """``fp16`` / ``bf16`` / ``fp32``. Field ``"x"``: the rows as given (so a dense policy is bit-exact)."""

    lossless = True

    def __init__(self, spec: str = "fp16") -> None:
        if spec not in DENSE_WIDTHS:
            raise ValueError(
                f"unknown dense codec {spec!r}: valid dense codecs are {', '.join(DENSE_WIDTHS)}"
            )
        self.spec = spec
        self.width = DENSE_WIDTHS[spec]

    def encode(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> Encoded:
        self.check_input(x)
        return {"x": x}

    def decode(self, enc: Encoded, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return enc["x"].to(dtype)

    def unit_bytes(self, head_dim: int) -> int:
        return self.width * head_dim

    def packed_nbytes(self, fields: dict) -> int:
        """Rows packed beside other heads' codes (a per-head list) are kept as given, counted at the named width."""
        return sum(buf.nbytes() // buf.data.element_size() * self.width for buf in fields.values() if buf.data is not None)
