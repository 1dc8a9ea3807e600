"""What every layer of the network is built on: the step it is called for and two primitives.

Owns ``Step`` (what one forward call knows about its tokens: their positions, hashed Engram
ids, image mask, the per-forward values layers hand each other, and the training-only
flags), ``RMSNorm`` and ``embedding`` (a table built without values on the meta device).
Module and parameter names are the official checkpoint names.

Does not own: the norm's kernel and its PyTorch twin (``model.kernels``), the projections
(``model.linear``), RoPE (``model.rope``), nor the layers themselves (``model.block``,
``model.csa2``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from model import kernels


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


@dataclass
class Step:
    """What one forward call knows about its tokens (all rows share positions)."""
    start: int  # absolute position of the first token
    length: int  # tokens in this call
    hash_ids: torch.Tensor | None = None  # [B, S, n_engram_layers, n_cols]
    engram_rows: dict | None = None  # Engram slot -> its rows of hash_ids, fetched ahead from a table in host memory
    image_mask: torch.Tensor | None = None  # [B, S] True on image-span tokens
    shared: dict = field(default_factory=dict)  # per-forward: kv source, top-k, candidates
    # training only (model.training): bounded replay simulated per row — the window of
    # layer l holds no position below floor[b, l] (-1: no floor), as after a replay from there
    floor: torch.Tensor | None = None  # [B, n_layers] long
    dense: bool = False  # select every visible record (the indexer's dense warm-up)
    index_losses: list | None = None  # when a list, index layers append their KL to attention
    graphs: object = None  # how a fast path replays this step (``model.decode_step``); the layers never read it
    # set by the fast path (``model.decode_step.begin``): several tokens of inference whose attention
    # and indexer read the cache's bytes in place (``kernels.sparse_prefill`` / ``prefill_index_scores``)
    packed_reads: bool = False
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
