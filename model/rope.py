"""Rotary position embeddings: the two frequency tables and the rotation that reads them.

Owns the inverse frequencies of a table (``rope_inv_freq``, YaRN blended in for the compress
table), the model's two tables kept in fp32 whatever the model's dtype (``Ropes``), the
rotation of a tensor's trailing rope slice (``apply_rope``), and the cos / sin of a set of
positions (``RopeAngles``), shared by every rotation at the same positions within one
scope (``shared_rope_angles``, ``share_rope_angles``, ``rope_angles``).

Does not own: the rotation kernel and its PyTorch twin (``model.kernels``: ``kernels.rope``,
``kernels.rope_ref``), nor which layer uses which table (``model.block.Attention``).
"""
from __future__ import annotations

import math
import threading
from contextlib import contextmanager

import torch
from torch import nn

from model import kernels
from model.args import ModelArgs


def rope_inv_freq(dim: int, theta: float, yarn: dict | None = None) -> torch.Tensor:
    """Inverse frequencies of one RoPE table; ``yarn`` blends in the interpolated ones. Made
    on the CPU whatever the default device (the same bits everywhere; callers move it)."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
    if not yarn:
        return inv
    orig, factor = yarn["original_max_position_embeddings"], yarn["factor"]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(yarn["beta_slow"])), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / max(high - low, 1e-3)).clamp(0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
               inverse: bool = False, in_place: bool = False) -> torch.Tensor:
    """Rotate adjacent channel pairs of the trailing rope slice. x: [B, S, D] or [B, S, H, D].
    ``in_place``: x is a temporary the caller does not read again (``kernels.rope``)."""
    angles = rope_angles(positions, inv_freq)
    # kernels.rope_ref off the fast path
    return kernels.rope(x, angles.cos, angles.neg_sin if inverse else angles.sin, in_place=in_place)


_ANGLES = threading.local()  # .memo: the angles of the layer call in progress, or None


@contextmanager
def shared_rope_angles():
    """Within the block: every RoPE at the same positions tensor with the same frequency
    table (a layer's queries, its window entry, its de-rotated output, its indexer query;
    in a fused decode step every layer's) reuses one cos / sin — the same values, computed
    once (on a GPU, ~4 launches each).
    Each scope starts empty, nested ones too: a CUDA graph segment opens its own, so its
    capture never reads angles an eager warm-up computed outside the graph's memory."""
    outer = getattr(_ANGLES, "memo", None)
    _ANGLES.memo = []
    try:
        yield
    finally:
        _ANGLES.memo = outer


class RopeAngles:
    """cos / sin [S, rd/2] of some positions under a frequency table; -sin made on first use
    (or given: :func:`share_rope_angles`)."""

    def __init__(self, positions: torch.Tensor, inv_freq: torch.Tensor):
        freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
        self.cos, self.sin, self._neg_sin = freqs.cos(), freqs.sin(), None

    @classmethod
    def made(cls, cos: torch.Tensor, sin: torch.Tensor, neg_sin: torch.Tensor) -> "RopeAngles":
        """Angles already made (:func:`share_rope_angles`)."""
        angles = cls.__new__(cls)
        angles.cos, angles.sin, angles._neg_sin = cos, sin, neg_sin
        return angles

    @property
    def neg_sin(self) -> torch.Tensor:
        if self._neg_sin is None:
            self._neg_sin = -self.sin
        return self._neg_sin


def share_rope_angles(positions: torch.Tensor, ropes: "Ropes") -> None:
    """Within :func:`shared_rope_angles`' scope: the angles of ``positions`` under both of
    ``ropes``' tables made at once from ``ropes.both`` (the two side by side) — cos, sin and
    -sin, five launches where each table took five — and left for :func:`rope_angles` to find.
    The same elementwise operations on the same values as :class:`RopeAngles`: the same bits
    (each table's a column slice: contiguous for one position, a decode step's)."""
    memo = getattr(_ANGLES, "memo", None)
    if memo is None:
        return
    freqs = positions.float()[:, None] * ropes.both.to(positions.device)[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    neg_sin, at = -sin, 0
    for table in (ropes.main, ropes.compress):
        part = slice(at, at + table.numel())
        memo.append((positions, table, RopeAngles.made(cos[:, part], sin[:, part], neg_sin[:, part])))
        at += table.numel()


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> RopeAngles:
    """The angles of ``positions`` under ``inv_freq``, shared within :func:`shared_rope_angles`
    (matched by identity: both tensors are alive while the scope is)."""
    memo = getattr(_ANGLES, "memo", None)
    for p, f, angles in memo or ():
        if p is positions and f is inv_freq:
            return angles
    angles = RopeAngles(positions, inv_freq)
    if memo is not None:
        memo.append((positions, inv_freq, angles))
    return angles



class Ropes(nn.Module):
    """The main (window-only layers) and compress (ratio > 0 layers, YaRN) tables, fp32 in a
    model of any dtype: rounded to bf16 (up to 2^-9 relative) the main table's angles are
    off by up to 0.44 rad at position 1,000, 1.8 at 4,096 and 57 at 131,072."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        # made on the CPU, then moved where the model is built (a ``torch.device`` context): the
        # tables' arithmetic on meta tensors would first import torch's Python decompositions
        for name, table in self._tables().items():
            self.register_buffer(name, table.to(torch.get_default_device()), persistent=False)

    def _tables(self) -> dict[str, torch.Tensor]:
        """main, compress, and both side by side (``share_rope_angles``' one set of launches)."""
        a, rd = self.args, self.args.qk_rope_head_dim
        yarn = a.rope_scaling if (a.rope_scaling or {}).get("rope_type", "yarn") == "yarn" else None
        main, compress = rope_inv_freq(rd, a.rope_theta), rope_inv_freq(rd, a.compress_rope_theta, yarn)
        return {"main": main, "compress": compress, "both": torch.cat([main, compress])}

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)  # moved (and cast): made again in fp32 where they now live
        self.make_on(self.main.device)
        return self

    def make_on(self, device) -> None:
        """The tables made again on ``device``: a model built on the meta device, once loaded
        (``to_empty`` would go through torch's Python decompositions, ~0.6 s)."""
        for name, table in self._tables().items():
            setattr(self, name, table.to(device))
