"""Quantisation as the model runs it: how a cache holds KV (:class:`KVFormat`) and the
straight-through estimator of QAT (:func:`straight_through`).

Owns: the choice between packed bytes, QAT floats and plain floats, and that packing and
fake-quantising go through ``model.kernels`` (a Triton kernel where one runs, else its
twin). Does not own: the number formats and byte layouts themselves — those are
``model.blockfp``'s, and are importable from here too (``model.quant.pack_main``, ...) —
nor where records live (``model.cache``).
"""
from __future__ import annotations

import torch

from model import kernels
from model.blockfp import (  # noqa: F401 (re-exported: callers import the formats from here)
    FP4_MAX, FP8_MAX, INDEX_BLOCK, RECORD_BLOCK, WINDOW_BLOCK, dequantize_fp4_weight, dequantize_fp8_weight,
    e2m1_decode, e2m1_encode, fake_quant_fp4, fake_quant_fp8, fake_quant_fp8_weight, fp8_block_from_shapes,
    index_record_bytes, main_record_bytes, pack_index, pack_main, pack_nibbles, pack_window, pow2_ceil,
    quantize_fp4_weight, quantize_fp8_weight, ue8m0_decode, ue8m0_encode, unpack_index, unpack_main,
    unpack_nibbles, unpack_window, window_record_bytes,
)


# ----------------------------------------------------------------------------- KV formats

def straight_through(x: torch.Tensor, quantised: torch.Tensor) -> torch.Tensor:
    """``quantised`` in the forward pass (exactly: not ``x + (quantised - x)``, whose sum can
    round), the identity's gradient to ``x`` in the backward pass; no kernel either way (the
    subtract-and-add spelling launched two each way, ~800 a training step of ``tiny``)."""
    return _StraightThrough.apply(x, quantised)


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, quantised: torch.Tensor) -> torch.Tensor:
        return quantised  # autograd hands out a view of it: no copy

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class KVFormat:
    """How a cache holds KV. ``PACKED``: ``model.blockfp``'s byte layouts (inference, the store).
    ``TRAIN``: the same values as floats, with straight-through gradients (QAT training).
    ``FLOAT``: floats without any KV quantisation (the unquantised reference of the eval).
    Attention sees identical numbers under PACKED and TRAIN."""

    def __init__(self, name: str, packed: bool, quantise: bool):
        self.name, self.packed, self.quantise = name, packed, quantise

    def __repr__(self) -> str:
        return f"KVFormat.{self.name}"

    def _fake(self, x: torch.Tensor, quant) -> torch.Tensor:
        if not self.quantise:
            return x
        if torch.is_grad_enabled() and x.requires_grad:  # the values alone: the kernel runs, no graph is built
            return straight_through(x, quant(x.detach()))
        return quant(x)

    # fresh values, as attention and the indexer see them
    def window(self, kv: torch.Tensor) -> torch.Tensor:
        return self._fake(kv, kernels.fake_quant_fp8)

    def index_query(self, q: torch.Tensor) -> torch.Tensor:
        return self._fake(q, lambda t: kernels.fake_quant_fp4(t, INDEX_BLOCK))

    # stored rows: width and dtype of one row of ``dim`` channels
    def window_row(self, dim: int) -> tuple[int, torch.dtype]:
        return (window_record_bytes(dim), torch.uint8) if self.packed else (dim, torch.float32)

    def main_row(self, dim: int) -> tuple[int, torch.dtype]:
        return (main_record_bytes(dim), torch.uint8) if self.packed else (dim, torch.float32)

    def index_row(self, dim: int) -> tuple[int, torch.dtype]:
        return (index_record_bytes(dim), torch.uint8) if self.packed else (dim, torch.float32)

    def pack_window(self, kv: torch.Tensor) -> torch.Tensor:
        """``kv`` is already what :meth:`window` returned."""
        return kernels.pack_window(kv) if self.packed else kv.float()

    def unpack_window(self, rows: torch.Tensor, dim: int) -> torch.Tensor:
        return unpack_window(rows, dim) if self.packed else _snapshot(rows)

    def pack_main(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return kernels.pack_main(x)
        return self._fake(x.float(), lambda t: kernels.fake_quant_fp4(t, RECORD_BLOCK, e4m3_scales=True))

    def unpack_main(self, rows: torch.Tensor, dim: int) -> torch.Tensor:
        return unpack_main(rows, dim) if self.packed else _snapshot(rows)

    def pack_index(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return kernels.pack_index(x)
        return self._fake(x.float(), lambda t: kernels.fake_quant_fp4(t, INDEX_BLOCK))

    def unpack_index(self, rows: torch.Tensor, dim: int) -> torch.Tensor:
        return unpack_index(rows, dim) if self.packed else _snapshot(rows)


def _snapshot(rows: torch.Tensor) -> torch.Tensor:
    """Float rows as read now: a copy when they carry gradients, since the cache keeps
    writing into its buffers in place after autograd has saved what it read."""
    return rows.clone() if rows.requires_grad else rows


KVFormat.PACKED = KVFormat("PACKED", packed=True, quantise=True)
KVFormat.TRAIN = KVFormat("TRAIN", packed=False, quantise=True)
KVFormat.FLOAT = KVFormat("FLOAT", packed=False, quantise=False)
