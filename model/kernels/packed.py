"""A weight held as the checkpoint stores it, as the decode GEMV takes it.

Its own module, beside ``collapsed.py``: the GEMV kernel (``model.kernels.matvec``) and the
package that dispatches to it both read it, and its maker (``model.linear.Linear.gemv_weight``)
supplies what it knows of the checkpoint's formats — the block one scale covers, the
dequantisation of the twin — so that nothing here imports ``model.checkpoint`` (which
imports ``model.kernels``).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch


class Packed(NamedTuple):
    """``fmt`` "fp8": ``data`` e4m3 [O, D] with one ue8m0 ``scale`` per ``block`` (rows,
    inputs; a V4.1 ``wo_a`` may carry 128-blocks where its layer says 32), or "fp4": ``data``
    int8 [O, D / 2] of e2m1 pairs (the even input in the low nibble) with one ue8m0 scale per
    1 x 32; ``block`` None where the shapes name none; ``in_features`` D; ``dense(dtype)`` the
    weight dequantised as the checkpoint reader does (the twin's)."""
    data: torch.Tensor
    scale: torch.Tensor
    fmt: str
    block: tuple[int, int] | None
    in_features: int
    dense: Callable[[torch.dtype], torch.Tensor]

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.in_features

    def scale_block(self) -> tuple[int, int] | None:
        """(rows, inputs) one scale covers; None where the shapes name no block."""
        return self.block

    def decodable(self) -> bool:
        """Whether the GEMV kernel decodes it: power-of-two scale blocks, whole bytes of FP4 pairs."""
        return (self.block is not None and all(b & (b - 1) == 0 for b in self.block)
                and (self.fmt == "fp8" or self.in_features % 2 == 0))
