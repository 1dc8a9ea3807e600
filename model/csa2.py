"""The CSA2 KV sources' own modules: what makes the records and what picks among them.

Owns the ``Compressor`` (``ratio`` tokens pooled into one latent, on a source's pending
groups), the ``Indexer`` (FP4 index keys and queries, weighted-ReLU scores, the top-k records
a query attends to) and the candidate pool the candidate source layer makes and the index
layers after it honour (``candidate_blocks`` as a mask, ``candidate_rows`` as records).
Module and parameter names are the official checkpoint names.

Does not own: the cache buffers a source fills (``model.cache``), the attention that reads
the records (``model.block.Attention``), nor a decode step's graph-safe forms of these
(``model.decode_step``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model import kernels
from model.args import ModelArgs
from model.cache import SourceKV
from model.layer import RMSNorm, Step
from model.linear import Linear
from model.quant import KVFormat
from model.rope import apply_rope


def reads_packed(step: Step, kv: KVFormat) -> bool:
    """Whether this step's attention and indexer read the cache's bytes in place
    (``kernels.sparse_prefill``, ``kernels.prefill_index_scores``: kernel or twin by device): where
    the fast path asked for it (``Step.packed_reads``) on a packed cache, outside training;
    else the reference's float keys."""
    return (step.packed_reads and kv.packed and step.index_losses is None and step.floor is None and not step.dense
            and step.graphs is None and not torch.is_grad_enabled())


class Compressor(nn.Module):
    """Pools ``ratio`` tokens into one 512-dim latent (ratio 1: a per-token projection)."""

    def __init__(self, args: ModelArgs, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.wkv = Linear(args.hidden_size, args.head_dim)
        self.wgate = Linear(args.hidden_size, args.head_dim) if ratio > 1 else None
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
        new_kv, new_gate = kernels.fp32_linear(x, self.wkv.weight), kernels.fp32_linear(x, self.wgate.weight)
        src.remember(new_kv, new_gate, src.done)
        kv, gate = torch.cat([src.pending_kv, new_kv], dim=1), torch.cat([src.pending_gate, new_gate], dim=1)
        usable = kv.shape[1] // self.ratio * self.ratio
        src.set_pending(kv[:, usable:], gate[:, usable:])
        if usable == 0:
            return None, src.covered
        groups = (t[:, :usable].unflatten(1, (-1, self.ratio)) for t in (kv, gate))
        return self.pool(*groups, x.dtype), src.covered

    def pool(self, kv: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Latents [B, G, D] of groups [B, G, ratio, D]: the softmax-gated sum, normalised."""
        return self.norm((kv * gate.softmax(dim=2)).sum(dim=2).to(dtype))


class Indexer(nn.Module):
    """Weighted-ReLU scores of FP4 queries against the group's FP4 keys, then top-k."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.args, self.layer = args, layer
        self.n_heads, self.head_dim = args.index_n_heads, args.index_head_dim
        self.wq_b = Linear(args.q_lora_rank, self.n_heads * self.head_dim)
        self.weights_proj = Linear(args.hidden_size, self.n_heads)
        if layer in args.kv_source_layer_ids:
            self.wk = Linear(args.head_dim, self.head_dim)
            self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)

    def keys(self, latent: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, kv: KVFormat) -> torch.Tensor:
        """FP4 index keys of fresh latents (from the pre-RoPE latent), stored as ``kv`` stores them."""
        return kv.pack_index(apply_rope(self.k_norm(self.wk(latent)), positions, inv_freq, in_place=True))

    def query(self, x, q_res, pos: torch.Tensor, inv_freq, kv: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
        """FP4 queries [B, S, h, d] and head weights [B, S, h] (reads no cache), the weights
        as ``weights_proj`` gives them: their scale, n_heads^-0.5, is the scores' (a decode
        step's kernel applies it as it reads them)."""
        B, S, _ = x.shape
        q = apply_rope(self.wq_b(q_res).view(B, S, self.n_heads, self.head_dim), pos, inv_freq, in_place=True)
        q = kv.index_query(q)
        return q, self.weights_proj(x)

    def scores(self, x, q_res, step: Step, keys: torch.Tensor, inv_freq, kv: KVFormat, qw=None) -> torch.Tensor:
        """[B, S, n] index scores; -inf where a record is not yet visible to the query.
        ``qw``: the :meth:`query` of these tokens when already computed."""
        pos = step.positions(x.device)
        q, w = qw or self.query(x, q_res, pos, inv_freq, kv)
        s = torch.einsum("bshd,bnd->bshn", q.float(), keys).relu_() * self.head_dim ** -0.5
        s = (s * (w.float() * self.n_heads ** -0.5).unsqueeze(-1)).sum(dim=2)
        visible = torch.arange(keys.shape[1], device=x.device) < ((pos + 1) // self.args.ratios[self.layer])[:, None]
        return s.masked_fill(~visible, float("-inf"))

    def packed_scores(self, x, q_res, step: Step, src: SourceKV, inv_freq, qw=None) -> torch.Tensor:
        """:meth:`scores` read off the source's FP4 index keys in place
        (``kernels.prefill_index_scores``; no [S, heads, n] products are kept)."""
        pos = step.positions(x.device)
        q, w = qw or self.query(x, q_res, pos, inv_freq, src.kv)
        keys = src.view()[1]
        return torch.stack([kernels.prefill_index_scores(q[b], w[b], keys[b], pos, self.args.ratios[self.layer],
                                                         self.head_dim ** -0.5, weight_scale=self.n_heads ** -0.5)
                            for b in range(q.shape[0])])

    def select(self, s: torch.Tensor, lens: torch.Tensor, candidates: torch.Tensor | None):
        """Top-k record indices [B, S, <= k] (-1 = none) of scores ``s`` [B, S, n] for queries
        that see ``lens`` [S] records; the candidate pool is made here (the candidate source)
        or honoured (the index layers after it). -> (indices, the pool or ``candidates``)."""
        if self.layer == self.args.candidate_source_layer_id:
            candidates = candidate_blocks(s, lens, self.args.candidate_topk_blocks, self.args.candidate_block_size)
        elif self.args.uses_candidates(self.layer) and candidates is not None:
            s = s.masked_fill(~candidates, float("-inf"))
        return kernels.top_records(s, self.args.index_topk), candidates

    def forward(self, x, q_res, step: Step, src: SourceKV, inv_freq, query=None) -> torch.Tensor | None:
        """Selected record indices [B, S, k] (-1 = none), or None when no record exists.
        ``query``: :meth:`query` of these tokens, where the caller made it already."""
        if src.n == 0:
            return None
        if reads_packed(step, src.kv):
            s = self.packed_scores(x, q_res, step, src, inv_freq, query)
        else:
            # the indexer learns from its own loss only (its inputs are cut from the graph; so
            # are the latents its keys come from, in Attention.update_source)
            keys = src.kv.unpack_index(src.view()[1], self.head_dim)
            s = self.scores(x.detach(), q_res.detach(), step, keys, inv_freq, src.kv, query)
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


def candidate_blocks(scores: torch.Tensor, lens: torch.Tensor, topk_blocks: int, block: int) -> torch.Tensor:
    """The candidate pool as a mask: bool [B, S, n]. The best ``topk_blocks`` of
    :func:`_block_scores` (``kernels.top_records``: ties to the lower block, -inf never)."""
    blocks = _block_scores(scores, lens, block)
    n_blocks = blocks.shape[-1]
    chosen = kernels.top_records(blocks, topk_blocks)  # -1: none; a spare column takes those
    keep = torch.zeros(*blocks.shape[:-1], n_blocks + 1, dtype=torch.bool, device=scores.device)
    keep.scatter_(-1, torch.where(chosen >= 0, chosen, n_blocks), True)
    return keep[..., :n_blocks].repeat_interleave(block, dim=-1)[..., :scores.shape[-1]]


def candidate_rows(scores: torch.Tensor, lens: torch.Tensor, topk_blocks: int, block: int) -> torch.Tensor:
    """The candidate pool (:func:`candidate_blocks`' choice) as its records: int64 [B, S, M],
    ascending, -1 after the last (M = ``block`` x the blocks chosen, at most ``topk_blocks``).
    A decode step scores these alone: at 128K records and a pool of 16K, an eighth of the
    indexer's and the top-k's work, and the same top-k as the mask's (ties still go to the
    lower index). The blocks are chosen by ``kernels.topk_rows``, in ascending order."""
    n = scores.shape[-1]
    blocks = _block_scores(scores, lens, block)
    chosen = kernels.topk_rows(blocks.flatten(0, -2), topk_blocks).view(*blocks.shape[:-1], -1)
    rows = (chosen[..., None] * block + torch.arange(block, device=scores.device)).flatten(-2)
    return rows.masked_fill((rows < 0) | (rows >= n), -1)  # an unused block (-1) makes rows -block..-1
