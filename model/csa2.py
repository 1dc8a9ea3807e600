"""The CSA2 KV sources' own modules: what makes the records and what picks among them.

Owns the ``Compressor`` (``ratio`` tokens pooled into one latent, on a source's pending
groups; a decode step's form on its fixed buffers), the ``Indexer`` (FP4 index keys and
queries, weighted-ReLU scores, the top-k records a query attends to; a decode step's form by
the fused kernel) and the candidate pool the candidate source layer makes and the index
layers after it honour (``candidate_blocks`` as a mask, ``candidate_rows`` as records).
Module and parameter names are the official checkpoint names.

Does not own: the cache buffers a source fills (``model.cache``), the attention that reads
the records (``model.model.Attention``), nor the kernels and their PyTorch twins
(``model.kernels``).
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from model import kernels
from model.args import ModelArgs
from model.cache import SourceKV
from model.kernels.reference import stable_topk, top_records
from model.layer import RMSNorm, Step, linear
from model.quant import KVFormat
from model.rope import apply_rope, rope_angles


class Compressor(nn.Module):
    """Pools ``ratio`` tokens into one 512-dim latent (ratio 1: a per-token projection)."""

    def __init__(self, args: ModelArgs, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.wkv = nn.Linear(args.hidden_size, args.head_dim, bias=False)
        self.wgate = nn.Linear(args.hidden_size, args.head_dim, bias=False) if ratio > 1 else None
        self.norm = RMSNorm(args.head_dim, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, step: Step, src: SourceKV) -> tuple[torch.Tensor | None, int]:
        """Latents (pre-RoPE) of the groups that complete, and the first group's position.
        Tokens the source already consumed are skipped."""
        skip = src.done - step.start
        assert skip >= 0, "a KV source cannot skip positions"
        x = x[:, skip:]
        if x.shape[1] == 0:
            return None, src.covered
        if self.wgate is None:
            return self.norm(self.wkv(x)), src.covered
        new_kv, new_gate = F.linear(x.float(), self.wkv.weight.float()), F.linear(x.float(), self.wgate.weight.float())
        src.remember(new_kv, new_gate, src.done)
        kv, gate = torch.cat([src.pending_kv, new_kv], dim=1), torch.cat([src.pending_gate, new_gate], dim=1)
        usable = kv.shape[1] // self.ratio * self.ratio
        src.set_pending(kv[:, usable:], gate[:, usable:])
        if usable == 0:
            return None, src.covered
        groups = (t[:, :usable].unflatten(1, (-1, self.ratio)) for t in (kv, gate))
        return self._pool(*groups, x.dtype), src.covered

    def _pool(self, kv: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Latents [B, G, D] of groups [B, G, ratio, D]: the softmax-gated sum, normalised."""
        return self.norm((kv * gate.softmax(dim=2)).sum(dim=2).to(dtype))

    def step_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``wkv`` and ``wgate`` in fp32 for :meth:`step`: cast once, not every step (the casts
        took ~50 us of a `small` step on the H200, session 24), again when either weight
        changes (in place or moved); the same values :meth:`forward` multiplies by (fp32
        weights themselves: a detached copy could take another matmul path, not bit-equal)."""
        w = (self.wkv.weight, self.wgate.weight)
        if all(t.dtype == torch.float32 for t in w):
            return w
        key = tuple((t._version, t.data_ptr(), t.dtype, t.device) for t in w)
        if self.__dict__.get("_fp32_key") != key:
            self.__dict__["_fp32"] = tuple(t.detach().float() for t in w)
            self.__dict__["_fp32_key"] = key
        return self.__dict__["_fp32"]

    def step(self, x: torch.Tensor, pos: torch.Tensor, src: SourceKV,
             emits: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:meth:`forward` of one decode step at ``pos`` [1] (a tensor: graph-safe), on the
        source's fixed buffers: the token's projection goes to the history ring, and when
        ``emits`` (its group completes here) the group is pooled from there. -> (latent
        [B, 1, D], the group's first position [1]) or None."""
        if self.wgate is None:
            return self.norm(self.wkv(x)), pos
        h = x.float()
        src.remember_at(*(F.linear(h, w) for w in self.step_weights()), pos)
        if not emits:
            return None
        first = pos - (self.ratio - 1)
        kv, gate = (t.unsqueeze(1) for t in src.recall(first + torch.arange(self.ratio, device=pos.device)))
        return self._pool(kv, gate, x.dtype), first


class Indexer(nn.Module):
    """Weighted-ReLU scores of FP4 queries against the group's FP4 keys, then top-k."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.args, self.layer = args, layer
        self.n_heads, self.head_dim = args.index_n_heads, args.index_head_dim
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(args.hidden_size, self.n_heads, bias=False)
        if layer in args.kv_source_layer_ids:
            self.wk = nn.Linear(args.head_dim, self.head_dim, bias=False)
            self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)

    def keys(self, latent: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, kv: KVFormat) -> torch.Tensor:
        """FP4 index keys of fresh latents (from the pre-RoPE latent), stored as ``kv`` stores them."""
        return kv.pack_index(apply_rope(self.k_norm(self.wk(latent)), positions, inv_freq))

    def query(self, x, q_res, pos: torch.Tensor, inv_freq, kv: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
        """FP4 queries [B, S, h, d] and head weights [B, S, h] (reads no cache), the weights
        as ``weights_proj`` gives them: their scale, n_heads^-0.5, is the scores' (a decode
        step's kernel applies it as it reads them)."""
        B, S, _ = x.shape
        if kernels.gemv_runs(q_res, self.wq_b):  # a decode step's few rows: the RoPE inside the GEMV
            angles = rope_angles(pos, inv_freq)
            (q,) = kernels.gemv(q_res, self.wq_b.weight, rope_out=(angles.cos, angles.sin, self.head_dim))
            q = q.view(B, S, self.n_heads, self.head_dim)
        else:
            q = apply_rope(linear(self.wq_b, q_res).view(B, S, self.n_heads, self.head_dim), pos, inv_freq)
        q = kv.index_query(q)
        return q, linear(self.weights_proj, x)

    def scores(self, x, q_res, step: Step, keys: torch.Tensor, inv_freq, kv: KVFormat, qw=None) -> torch.Tensor:
        """[B, S, n] index scores; -inf where a record is not yet visible to the query.
        ``qw``: the :meth:`query` of this step when already computed (a graphed decode step)."""
        pos = step.positions(x.device)
        q, w = qw or self.query(x, q_res, pos, inv_freq, kv)
        s = torch.einsum("bshd,bnd->bshn", q.float(), keys).relu_() * self.head_dim ** -0.5
        s = (s * (w.float() * self.n_heads ** -0.5).unsqueeze(-1)).sum(dim=2)
        visible = torch.arange(keys.shape[1], device=x.device) < ((pos + 1) // self.args.ratios[self.layer])[:, None]
        return s.masked_fill(~visible, float("-inf"))

    def select_step(self, x, q_res, pos: torch.Tensor, src: SourceKV, inv_freq, candidates=None, qw=None):
        """:meth:`forward` of one decode step at ``pos`` [1] (a tensor: graph-safe), by the
        fused kernel over the source's whole index buffer, the records not yet visible
        masked by ``pos``. -> (indices [B, 1, index_topk], -1 = none; the candidate pool
        when this layer makes it (:func:`candidate_rows`: its records), else ``candidates``,
        whose records alone a layer that honours it scores — what :meth:`select`'s mask
        picks). ``qw``: this step's :meth:`query` when already computed."""
        q, w = qw or self.query(x, q_res, pos, inv_freq, src.kv)
        ratio = self.args.ratios[self.layer]
        if isinstance(candidates, kernels.Beside):  # made beside the layers since the candidate source
            candidates = candidates.value()
        pool = candidates if self.args.uses_candidates(self.layer) else None  # scored alone, then mapped back
        # q holds FP4 values, exact in its own dtype: a bf16 query is one bf16 operand to the kernel's dots;
        # the records seen and the weights' scale are the kernel's to apply (two launches fewer each)
        s = kernels.indexer_scores(q[:, 0], w[:, 0], src.index, (pos, ratio), self.head_dim ** -0.5,
                                   None if pool is None else pool[:, 0], weight_scale=self.n_heads ** -0.5)[:, None]
        if self.layer == self.args.candidate_source_layer_id:
            pool_of = partial(_candidate_rows_at, ratio=ratio, topk_blocks=self.args.candidate_topk_blocks,
                              block=self.args.candidate_block_size)
            # read first by a later layer: where select.POOL_BESIDE, made on a side stream beside
            # this layer's own top-k and the layers between (a kernels.Beside, joined there)
            if kernels.beside_on(s, "select.POOL_BESIDE"):
                candidates = kernels.Beside(pool_of, s, pos, device=s.device)
            else:
                candidates = pool_of(s, pos)
        # top_records' choice, in record order, -1 after (a buffer of fewer records than top-k too)
        k = self.args.index_topk
        indices = kernels.topk_rows(s[:, 0], k, None if pool is None else pool[:, 0], width=k)[:, None]
        return indices, candidates

    def select(self, s: torch.Tensor, lens: torch.Tensor, candidates: torch.Tensor | None):
        """Top-k record indices [B, S, <= k] (-1 = none) of scores ``s`` [B, S, n] for queries
        that see ``lens`` [S] records; the candidate pool is made here (the candidate source)
        or honoured (the index layers after it). -> (indices, the pool or ``candidates``)."""
        if self.layer == self.args.candidate_source_layer_id:
            candidates = candidate_blocks(s, lens, self.args.candidate_topk_blocks, self.args.candidate_block_size)
        elif self.args.uses_candidates(self.layer) and candidates is not None:
            s = s.masked_fill(~candidates, float("-inf"))
        return top_records(s, self.args.index_topk), candidates

    def forward(self, x, q_res, step: Step, src: SourceKV, inv_freq) -> torch.Tensor | None:
        """Selected record indices [B, S, k] (-1 = none), or None when no record exists."""
        qw = step.shared.pop(("index_query", self.layer), None)  # computed in a graphed segment
        if src.n == 0:
            return None
        # the indexer learns from its own loss only (its inputs are cut from the graph; so
        # are the latents its keys come from, in Attention._update_source)
        keys = src.kv.unpack_index(src.view()[1], self.head_dim)
        s = self.scores(x.detach(), q_res.detach(), step, keys, inv_freq, src.kv, qw)
        if step.index_losses is not None:
            step.shared["index_scores"] = s
        if step.dense:
            visible = s > float("-inf")
            return torch.arange(s.shape[-1], device=s.device).expand_as(s).masked_fill(~visible, -1)
        lens = (step.positions(x.device) + 1) // self.args.ratios[self.layer]
        indices, pool = self.select(s, lens, step.shared.get("candidates"))
        if pool is not None:
            step.shared["candidates"] = pool
        return indices


def _block_scores(scores: torch.Tensor, lens: torch.Tensor, block: int) -> torch.Tensor:
    """The candidate pool's blocks of ``block`` records, scored by their max, the block of the
    query's newest visible record pinned (+inf)."""
    n = scores.shape[-1]
    padded = F.pad(scores, (0, -n % block), value=float("-inf"))
    blocks = padded.unflatten(-1, (-1, block)).amax(-1)
    newest = ((lens - 1) // block)[:, None]  # (S, 1); -1 when nothing is visible
    return blocks.masked_fill(torch.arange(blocks.shape[-1], device=scores.device) == newest, float("inf"))


def _pool_blocks(scores: torch.Tensor, lens: torch.Tensor, topk_blocks: int, block: int):
    """The candidate pool's choice: the best ``topk_blocks`` of :func:`_block_scores`. ->
    (the chosen blocks' scores and indices, -inf scores not kept; the number of blocks)."""
    blocks = _block_scores(scores, lens, block)
    values, indices = stable_topk(blocks, topk_blocks)
    return values, indices, blocks.shape[-1]


def candidate_blocks(scores: torch.Tensor, lens: torch.Tensor, topk_blocks: int, block: int) -> torch.Tensor:
    """The candidate pool (:func:`_pool_blocks`) as a mask: bool [B, S, n]."""
    values, indices, n_blocks = _pool_blocks(scores, lens, topk_blocks, block)
    keep = torch.zeros(*values.shape[:-1], n_blocks, dtype=torch.bool, device=scores.device)
    keep.scatter_(-1, indices, values > float("-inf"))
    return keep.repeat_interleave(block, dim=-1)[..., :scores.shape[-1]]


def _candidate_rows_at(scores: torch.Tensor, pos: torch.Tensor, *, ratio: int, topk_blocks: int,
                       block: int) -> torch.Tensor:
    """:func:`candidate_rows` for a decode step's query at ``pos`` of a source of ``ratio``."""
    return candidate_rows(scores, (pos + 1) // ratio, topk_blocks, block)


def candidate_rows(scores: torch.Tensor, lens: torch.Tensor, topk_blocks: int, block: int) -> torch.Tensor:
    """The candidate pool (:func:`_pool_blocks`'s choice) as its records: int64 [B, S, M],
    ascending, -1 after the last (M = ``block`` x the blocks chosen, at most ``topk_blocks``).
    A decode step scores these alone: at 128K records and a pool of 16K, an eighth of the
    indexer's and the top-k's work, and the same top-k as the mask's (ties still go to the
    lower index). The blocks are chosen by ``kernels.topk_rows``, in ascending order."""
    n = scores.shape[-1]
    blocks = _block_scores(scores, lens, block)
    chosen = kernels.topk_rows(blocks.flatten(0, -2), topk_blocks).view(*blocks.shape[:-1], -1)
    rows = (chosen[..., None] * block + torch.arange(block, device=scores.device)).flatten(-2)
    return rows.masked_fill((rows < 0) | (rows >= n), -1)  # an unused block (-1) makes rows -block..-1
