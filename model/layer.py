"""What every layer of the network is built on: the step it is called for and three primitives.

Owns ``Step`` (what one forward call knows about its tokens: their positions, hashed Engram
ids, image mask, the per-forward values layers hand each other, and the training-only
flags), ``RMSNorm``, ``embedding`` (a table built without values on the meta device) and
``linear`` (a projection that takes the GEMV kernel on a decode step's few rows). Module and
parameter names are the official checkpoint names.

Does not own: the kernels these call and their PyTorch twins (``model.kernels``), RoPE
(``model.rope``), nor the layers themselves (``model.model``, ``model.csa2``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from model import kernels
from model.graphs import SegmentGraphs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)  # kernels.rms_norm_ref off the fast path


def embedding(rows: int, dim: int) -> nn.Embedding:
    """``nn.Embedding(rows, dim)`` with torch's own N(0, 1) init, left out on the meta device,
    where the first ``normal_`` imports torch's Python decompositions (~1.3 s of every CLI
    start that loads a checkpoint) to make values the checkpoint then replaces."""
    table = nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))
    if not table.weight.is_meta:
        nn.init.normal_(table.weight)
    return table


def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``; on a decode step's few rows, by the GEMV kernel (``kernels.gemv_runs``)."""
    return kernels.gemv(x, layer.weight)[0] if kernels.gemv_runs(x, layer) else layer(x)


@dataclass
class Step:
    """What one forward call knows about its tokens (all rows share positions)."""
    start: int  # absolute position of the first token
    length: int  # tokens in this call
    hash_ids: torch.Tensor | None = None  # [B, S, n_engram_layers, n_cols]
    image_mask: torch.Tensor | None = None  # [B, S] True on image-span tokens
    shared: dict = field(default_factory=dict)  # per-forward: kv source, top-k, candidates
    # training only (model.training): bounded replay simulated per row — the window of
    # layer l holds no position below floor[b, l] (-1: no floor), as after a replay from there
    floor: torch.Tensor | None = None  # [B, n_layers] long
    dense: bool = False  # select every visible record (the indexer's dense warm-up)
    index_losses: list | None = None  # when a list, index layers append their KL to attention
    graphs: SegmentGraphs | None = None  # a CUDA decode step: cache-free segments replay as graphs
    new: bool = False  # every KV source stops just before ``start``: a step that continues the cache
    _positions: torch.Tensor | None = field(default=None, repr=False)

    @property
    def end(self) -> int:
        return self.start + self.length

    def positions(self, device) -> torch.Tensor:
        """[start, end) on ``device``, made once per step (every layer asks)."""
        if self._positions is None or self._positions.device != device:
            self._positions = torch.arange(self.start, self.end, device=device)
        return self._positions
