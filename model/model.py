"""The DeepSeek-V4.1-Flash text network in plain PyTorch: the reference every kernel matches.

Reads like the architecture (ARCHITECTURE.md §2): RMSNorm, the two RoPE tables, the
Compressor and Indexer of the CSA2 KV sources, the shared-latent Attention with its sink,
the MoE (``model.moe``), Engram, the mHC Block with its lagged ``pre``, and the
Transformer. Module and parameter names are the official checkpoint names, so loading is
a name-for-name copy. A decode step on CUDA replays as CUDA graphs (``model.graphs``):
where the fused kernels of ``model.kernels`` run, the whole step over every layer, cache
work included, is one graph (``Transformer.run_layers``); else two segments a layer.

Every forward goes through an explicit :class:`model.cache.Cache` (a fresh one when none
is given): the window entries, records and index keys the attention reads are the packed
bytes of that cache, so a full forward, chunked prefill and decode compute the same
function. Positions that a cache already covers are never compressed twice, which is
what makes bounded-replay prefill and resume a matter of choosing which layers to run.

Does not own: sampling, prefill strategies and session state (``model.engine``), weight
files (``model.checkpoint``), tokenization (``model.tokenizer``).
"""
from __future__ import annotations

import math
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from model import graphs, kernels
from model.args import ModelArgs
from model.cache import Cache, SourceKV, WindowRing
from model.engram import DEAD, NgramHasher
from model.kernels.reference import stable_topk, top_records
from model.moe import MoE
from model.quant import KVFormat, main_record_bytes
from model.vision import Aligner, VisionTransformer, encode_image_span, preprocess


# ----------------------------------------------------------------------------- basics

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)  # kernels.rms_norm_ref off the fast path


def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``; on a decode step's few rows, by the GEMV kernel (``kernels.gemv_runs``)."""
    return kernels.gemv(x, layer.weight)[0] if kernels.gemv_runs(x, layer) else layer(x)


def rope_inv_freq(dim: int, theta: float, yarn: dict | None = None) -> torch.Tensor:
    """Inverse frequencies of one RoPE table; ``yarn`` blends in the interpolated ones."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if not yarn:
        return inv
    orig, factor = yarn["original_max_position_embeddings"], yarn["factor"]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(yarn["beta_slow"])), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
               inverse: bool = False) -> torch.Tensor:
    """Rotate adjacent channel pairs of the trailing rope slice. x: [B, S, D] or [B, S, H, D]."""
    angles = rope_angles(positions, inv_freq)
    return kernels.rope(x, angles.cos, angles.neg_sin if inverse else angles.sin)  # kernels.rope_ref off the fast path


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
    graphs: graphs.SegmentGraphs | None = None  # a CUDA decode step: cache-free segments replay as graphs
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


class Ropes(nn.Module):
    """The main (window-only layers) and compress (ratio > 0 layers, YaRN) tables, fp32 in a
    model of any dtype: rounded to bf16 (up to 2^-9 relative) the main table's angles are
    off by up to 0.44 rad at position 1,000, 1.8 at 4,096 and 57 at 131,072."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        for name, table in self._tables().items():
            self.register_buffer(name, table, persistent=False)

    def _tables(self) -> dict[str, torch.Tensor]:
        """main, compress, and both side by side (``share_rope_angles``' one set of launches)."""
        a, rd = self.args, self.args.qk_rope_head_dim
        yarn = a.rope_scaling if (a.rope_scaling or {}).get("rope_type", "yarn") == "yarn" else None
        main, compress = rope_inv_freq(rd, a.rope_theta), rope_inv_freq(rd, a.compress_rope_theta, yarn)
        return {"main": main, "compress": compress, "both": torch.cat([main, compress])}

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)  # moved (and cast): made again in fp32 where they now live
        for name, table in self._tables().items():
            setattr(self, name, table.to(self.main.device))
        return self


# ----------------------------------------------------------------------------- CSA2 sources

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


def _fused_step(x: torch.Tensor, step: Step, kv: KVFormat) -> bool:
    """A :func:`_decode_step` where the fused kernels of ``model.kernels`` run (CUDA with
    Triton; ``DSAGENT_KERNELS=0`` turns them off)."""
    return _decode_step(x, step, kv) and kernels.enabled(x)


def _decode_step(x: torch.Tensor, step: Step, kv: KVFormat) -> bool:
    """One new position (not a replayed one) on a packed cache, outside training: a step the
    fused path can take (tests put it in place of :func:`_fused_step` to run that path on
    the kernels' PyTorch twins)."""
    return (x.shape[1] == 1 and step.new and kv.packed and step.floor is None and step.index_losses is None
            and not step.dense)


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


# ----------------------------------------------------------------------------- attention

class Attention(nn.Module):
    """Shared K=V latent attention over window entries plus selected compressed records."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.args, self.layer = args, layer
        self.ratio = args.ratios[layer]
        self._projections(args)
        self.compressor = Compressor(args, self.ratio) if layer in args.kv_source_layer_ids else None
        self.indexer = Indexer(args, layer) if layer in args.index_source_layer_ids else None

    def _projections(self, args: ModelArgs) -> None:
        """The query low-rank path, the K=V latent, the grouped output and the sinks."""
        self.n_heads, self.head_dim = args.num_attention_heads, args.head_dim
        self.wq_a = nn.Linear(args.hidden_size, args.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(args.hidden_size, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        group_in = self.n_heads * self.head_dim // args.o_groups
        self.wo_a = nn.Linear(group_in, args.o_groups * args.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(args.o_groups * args.o_lora_rank, args.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))

    def forward(self, x: torch.Tensor, step: Step, cache: Cache, ropes: Ropes) -> torch.Tensor:
        pos = step.positions(x.device)
        _, q_res, q, kv = self.project(x, pos, ropes, cache.kv)
        return self.output(self.core(x, q_res, q, kv, pos, step, cache, ropes), pos, ropes)

    def project(self, x: torch.Tensor, pos: torch.Tensor, ropes: Ropes, fmt: KVFormat, fused: bool = False,
                norm=None, early=None):
        """(x, q_res, RoPE'd queries, this step's window entries as ``fmt`` rounds them): reads
        no cache. ``fused`` (a decode step on the fused kernels, :meth:`decode_step` next): the
        K=V latent as it is, which :meth:`decode_step` turns into its window entry, and
        q_res only in a layer with an indexer (its query's input; made by the query's GEMV,
        which normalises its input either way). ``norm`` = (weight, eps):
        x is the mHC site's input before its RMSNorm (``kernels.hc_site``'s ``norm_later``),
        normalised inside the projections' GEMV where it runs (else first); the x returned
        is the normalised one, for x's other readers (x may then be a ``kernels.Collapsed``, which
        the GEMV makes). ``early`` (``fused``): a callable of
        the normalised x run as soon as the first projection has made it (on the kernels),
        before the query's projection (``Block.whole_layer``: :meth:`compress_beside`)."""
        B, S, _ = x.shape
        inv = self.rope_table(ropes)
        if not kernels.gemv_runs(x, self.wq_a, self.wkv):
            x = kernels.resolve(x)  # a kernels.Collapsed made
            if norm is not None:
                x = kernels.rms_norm(x, *norm)
            q_res, kv_lat = self.q_norm(self.wq_a(x)), self.wkv(x)
            q = apply_rope(linear(self.wq_b, q_res).view(B, S, self.n_heads, self.head_dim), pos, inv)
            return x, q_res, q, kv_lat if fused else self._window_values(kv_lat, pos, inv, fmt)
        # a decode step's few rows: both projections of x in one launch (with the site's norm,
        # where it was left to them); in a fused step the query's norm and RoPE inside its GEMV
        # (which keeps q_res where the indexer reads it)
        if norm is None:
            q_lat, kv_lat = kernels.gemv(x, self.wq_a.weight, self.wkv.weight)
        else:
            q_lat, kv_lat, x = kernels.gemv(x, self.wq_a.weight, self.wkv.weight, norm=norm, keep=True)
        if fused and early is not None:
            early(x)  # may leave a kernels.Beside for decode_step to join
        angles = rope_angles(pos, inv)
        rope = (angles.cos, angles.sin, self.head_dim)
        if fused:
            q, *q_res = kernels.gemv(q_lat, self.wq_b.weight, norm=(self.q_norm.weight, self.q_norm.eps),
                                     rope_out=rope, keep=self.indexer is not None)
            q_res = q_res[0] if q_res else None
        else:
            q_res = self.q_norm(q_lat)
            (q,) = kernels.gemv(q_res, self.wq_b.weight, rope_out=rope)
        q = q.view(B, S, self.n_heads, self.head_dim)
        return x, q_res, q, kv_lat if fused else self._window_values(kv_lat, pos, inv, fmt)

    def output(self, out: torch.Tensor, pos: torch.Tensor, ropes: Ropes, later: bool = False, turned: bool = False):
        """De-rotated attention output through the grouped low-rank output projection (on a
        decode step's few rows one GEMV de-rotates and projects). ``later``: ``wo_b``'s GEMV
        left as a ``kernels.Pending`` for the FFN site to fold its first launch into;
        ``turned``: ``out`` is de-rotated already (:meth:`decode_step`'s ``turn_back``)."""
        inv = self.rope_table(ropes)
        rows = out.flatten(2)
        if kernels.gemv_runs(rows, self.wo_a):
            angles = rope_angles(pos, inv)
            (lat,) = kernels.gemv(rows, self.wo_a.weight, groups=self.args.o_groups,
                                  rope_in=None if turned else (angles.cos, angles.neg_sin, self.head_dim))
        else:
            lat = self._grouped_wo_a(out if turned else apply_rope(out, pos, inv, inverse=True)).flatten(2)
        return kernels.gemv_later(lat, self.wo_b) if later else linear(self.wo_b, lat)

    def core(self, x, q_res, q, kv, pos, step: Step, cache: Cache, ropes: Ropes) -> torch.Tensor:
        """The part that reads and writes the cache: window ring, KV source, indexer, attention
        (a decode step on the fused kernels: :meth:`decode_step`, from ``Transformer.run_layers``)."""
        keys, key_mask = self._window_keys(kv, step, cache)
        records = None
        if self.ratio:
            self._update_source(x, step, cache, ropes)
            if self.indexer is not None:
                src = cache.sources[self.args.kv_source(self.layer)]
                step.shared["topk"] = self.indexer(x, q_res, step, src, ropes.compress)
                if step.index_losses is not None and "index_scores" in step.shared:
                    step.index_losses.append(self._index_loss(q, src, step.shared.pop("index_scores")))
            records = self._selected_records(cache, step)
        return self._attend(q, keys, key_mask, records)

    # -- one decode step on the fused kernels. Its cache work runs on the cache's fixed
    # buffers with the position as a tensor, so it can replay as a CUDA graph: the host
    # keeps the counts around it (before_step / after_step); the top-k and the candidate
    # pool pass from layer to layer inside the step (step_reads / decode_step's ``written``).

    def step_reads(self, shared: dict) -> dict[str, torch.Tensor]:
        """What this layer's decode step reads of the earlier layers' selection (``shared``:
        what they wrote): a layer without an indexer their top-k; one that honours the
        candidate pool that pool."""
        names = (("topk",) if self.ratio and self.indexer is None else ()) \
            + (("candidates",) if self.indexer is not None and self.args.uses_candidates(self.layer) else ())
        return {n: shared[n] for n in names if shared.get(n) is not None}

    def before_step(self, step: Step, cache: Cache) -> bool:
        """Room in the KV source for this step's record; whether its group completes here."""
        if self.compressor is None:
            return False
        cache.sources[self.layer].reserve(step.start)
        return (step.start + 1) % self.ratio == 0

    def after_step(self, step: Step, cache: Cache) -> None:
        """The host's side of :meth:`decode_step`: the source's counts."""
        if self.compressor is not None:
            cache.sources[self.layer].stepped(step.start)

    def step_memory(self, cache: Cache) -> tuple:
        """Addresses and shapes of the cache buffers :meth:`decode_step` reads or writes."""
        ring = cache.windows[self.layer]
        buffers = [ring.data, ring.pos]
        if self.compressor is not None:
            src = cache.sources[self.layer]
            buffers += [src.hist_kv, src.hist_gate, src.hist_pos]
        if self.ratio:
            src = cache.sources[self.args.kv_source(self.layer)]
            buffers += [src.records, src.index]
        return tuple((t.data_ptr(), tuple(t.shape)) for t in buffers)

    def decode_step(self, x, q_res, q, kv, pos, reads: dict, cache: Cache, ropes: Ropes, emits: bool, qw=None,
                    compressing=None, turn_back: bool = False):
        """:meth:`core` of one decode step at ``pos`` [1] on the fused kernels, graph-safe
        (nothing here reads a count from the host): the window-ring write, the compressor's
        record when ``emits``, the indexer's top-k (and candidate pool) over the whole
        buffers, the sparse attention. -> (output, what later layers read: () or (top-k,)
        or (top-k, candidate pool)). ``reads``: :meth:`step_reads`; ``qw``: the indexer's
        query when already computed; ``compressing``: :meth:`compress_beside`'s launch;
        ``turn_back``: the output de-rotated (``kernels.merge_turns_back``; then
        :meth:`output` with ``turned``)."""
        ring = cache.windows[self.layer]
        self._write_entry(kv, pos, ring, cache.kv, ropes)
        if compressing is not None:
            compressing.join()  # the source's new record and key, before the indexer reads them
        elif self.compressor is not None:
            self.compress(x, pos, cache.sources[self.layer], emits, ropes)
        written, topk = (), reads.get("topk")
        if self.indexer is not None:
            src = cache.sources[self.args.kv_source(self.layer)]
            topk, pool = self.indexer.select_step(x, q_res, pos, src, ropes.compress, reads.get("candidates"), qw)
            written = (topk, pool) if self.layer == self.args.candidate_source_layer_id else (topk,)
        records = None if topk is None else cache.sources[self.args.kv_source(self.layer)].records
        turn = None
        if turn_back:
            angles = rope_angles(pos, self.rope_table(ropes))
            turn = (angles.cos, angles.neg_sin)
        return self.fused_attend(q, pos, ring, records, topk, turn), written

    def compress(self, x, pos: torch.Tensor, src: SourceKV, emits: bool, ropes: Ropes) -> None:
        """The compressor's part of :meth:`decode_step`: this step's latent into the source's
        pending group, and the group's record and index key where it completes (``emits``)."""
        if self._compress_step(x, pos, src, emits, ropes):
            return
        made = self.compressor.step(x, pos, src, emits)
        if made is not None:
            latent, first = made
            src.write_at(first // self.ratio, src.kv.pack_main(apply_rope(latent, first, ropes.compress)),
                         self.indexer.keys(latent, first, ropes.compress, src.kv))

    def compress_beside(self, x, *, pos: torch.Tensor, cache: Cache, emits: bool, ropes: Ropes):
        """In a fused decode step, as soon as the site's input x is made: where
        ``pack.COMPRESS_BESIDE`` (a graph's capture) and the compressor pools groups of a bf16 x
        (ratio > 1: its launches start with torch's cast of x, not a dependent launch, the side
        stream's first), :meth:`compress` launched on a side stream beside the query's
        projections and the window entry -> that ``kernels.Beside`` (:meth:`decode_step`'s
        ``compressing``, joined before the indexer); else None."""
        if self.compressor is not None and self.ratio > 1 and x.dtype != torch.float32 \
                and kernels.beside_on(x, "pack.COMPRESS_BESIDE"):
            return kernels.Beside(self.compress, x, pos, cache.sources[self.layer], emits, ropes, device=x.device)
        return None

    def _compress_step(self, x, pos: torch.Tensor, src: SourceKV, emits: bool, ropes: Ropes) -> bool:
        """The compressor's part of :meth:`decode_step` in four launches (``kernels.compress_step``):
        what :meth:`Compressor.step` and the record's and index key's packs do. False where
        those kernels do not run; the caller then runs them."""
        comp, index = self.compressor, self.indexer
        weights = (comp.wkv.weight,) if comp.wgate is None else comp.step_weights()
        return kernels.compress_step(x, weights, (comp.norm.weight, comp.norm.eps),
                                     (src.hist_kv, src.hist_gate, src.hist_pos), src.records, src.index,
                                     index.wk.weight, (index.k_norm.weight, index.k_norm.eps), ropes.compress, pos,
                                     comp.ratio, emits)

    def rope_table(self, ropes: Ropes) -> torch.Tensor:
        """The frequency table this layer rotates by: YaRN's compress table where it has a KV
        source (ratio > 0), else the main one."""
        return ropes.compress if self.ratio else ropes.main

    def _window_values(self, kv_lat: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
        """This step's window entries from their K=V latent: normalised, rotated, as ``fmt`` rounds them."""
        return fmt.window(apply_rope(self.kv_norm(kv_lat), pos, inv))

    def _write_entry(self, kv_lat: torch.Tensor, pos: torch.Tensor, ring: WindowRing, fmt: KVFormat,
                     ropes: Ropes) -> None:
        """This step's window entry, from its K=V latent (``project(fused=True)``), into the
        ring: one kernel where it runs, else the norm, RoPE and FP8 rounding of :meth:`project`
        and the ring's write."""
        inv = self.rope_table(ropes)
        angles = rope_angles(pos, inv)
        if not kernels.window_entry(kv_lat, self.kv_norm.weight, self.kv_norm.eps, angles.cos, angles.sin,
                                    ring.data, ring.pos, pos):
            ring.write_step(self._window_values(kv_lat, pos, inv, fmt), pos)

    def _window_keys(self, kv: torch.Tensor, step: Step, cache: Cache):
        """Window keys [B, cap+S, D] and the per-query mask [1 or B, S, cap+S]; writes the ring."""
        ring = cache.windows[self.layer]
        old, old_pos = ring.read()
        pos = step.positions(kv.device)
        old_pos = old_pos.masked_fill(old_pos >= step.start, -1)  # replayed positions come from kv
        key_pos = torch.cat([old_pos, pos])
        mask = (key_pos[None, :] >= 0) & (key_pos[None, :] <= pos[:, None]) \
            & (key_pos[None, :] > pos[:, None] - self.args.sliding_window)
        mask = mask[None]
        if step.floor is not None:
            mask = mask & (key_pos[None, None, :] >= step.floor[:, self.layer, None, None])
        keys = torch.cat([old.to(kv.dtype), kv], dim=1)  # before the write: a float ring's read is its buffer
        ring.write(kv, pos)
        return keys, mask

    def _update_source(self, x: torch.Tensor, step: Step, cache: Cache, ropes: Ropes) -> None:
        if self.compressor is None:
            return
        src = cache.sources[self.layer]
        latent, first = self.compressor(x, step, src)
        if latent is not None:
            positions = first + self.ratio * torch.arange(latent.shape[1], device=x.device)
            records = src.kv.pack_main(apply_rope(latent, positions, ropes.compress))
            src.append(records, self.indexer.keys(latent.detach(), positions, ropes.compress, src.kv))

    def _selected_records(self, cache: Cache, step: Step):
        """(rows [B, S, k, D], valid [B, S, k]) gathered per query; while training, the
        dense-mask form (every record [B, n, D], selected [B, S, n]) of the same softmax."""
        idx = step.shared.get("topk")
        src = cache.sources[self.args.kv_source(self.layer)]
        if idx is None or src.n == 0:
            return None
        B, S, k = idx.shape
        packed = src.view()[0]
        if step.index_losses is not None:
            # a -1 (no record) goes to a spare column: clamped to 0, its False would land on
            # record 0 too, and of two writes to one place the last wins (on CUDA, either)
            selected = torch.zeros(B, S, src.n + 1, dtype=torch.bool, device=idx.device)
            selected.scatter_(-1, torch.where(idx >= 0, idx, src.n), True)
            return src.kv.unpack_main(packed, self.head_dim), selected[..., :src.n]
        rows = packed.gather(1, idx.clamp_min(0).reshape(B, S * k, 1).expand(-1, -1, packed.shape[-1]))
        return src.kv.unpack_main(rows, self.head_dim).view(B, S, k, -1), idx >= 0

    def _attend(self, q, keys, key_mask, records) -> torch.Tensor:
        """One softmax over window entries, selected records and the per-head sink."""
        scale = self.head_dim ** -0.5
        logits = [torch.einsum("bshd,bjd->bshj", q.float(), keys.float()) * scale]
        logits[0] = logits[0].masked_fill(~key_mask[:, :, None, :], float("-inf"))
        per_query = records is not None and records[0].dim() == 4
        if records is not None:
            rec, valid = records
            r = torch.einsum("bshd,bskd->bshk" if per_query else "bshd,bkd->bshk", q.float(), rec) * scale
            logits.append(r.masked_fill(~valid[:, :, None, :], float("-inf")))
        sink = self.attn_sink.float().view(1, 1, -1, 1).expand(*q.shape[:3], 1)
        probs = torch.cat(logits + [sink], dim=-1).softmax(dim=-1)
        n_win = keys.shape[1]
        out = torch.einsum("bshj,bjd->bshd", probs[..., :n_win], keys.float())
        if records is not None:
            out = out + torch.einsum("bshk,bskd->bshd" if per_query else "bshk,bkd->bshd",
                                     probs[..., n_win:-1], records[0])
        return out.to(q.dtype)

    def fused_attend(self, q: torch.Tensor, pos: torch.Tensor, ring: WindowRing, records: torch.Tensor | None,
                     idx: torch.Tensor | None, turn_back=None) -> torch.Tensor:
        """:meth:`_attend` of one decode step at position ``pos`` [1] (a tensor, so a graph can
        hold it), by the fused kernel on the packed ring (already holding this step's entry)
        and the packed records at the indexer's ``idx`` [B, 1, k] (``records``: the source's
        whole buffer, every selected row lies below its count); ``turn_back``: the kernel's."""
        B = q.shape[0]
        if idx is None:
            records = ring.data.new_empty(B, 0, main_record_bytes(self.head_dim))
            idx = torch.empty(B, 1, 0, dtype=torch.long, device=q.device)
        out = kernels.sparse_attention(q[:, 0], ring.data, None, records, idx[:, 0], self.attn_sink,
                                       self.head_dim ** -0.5, out_dtype=q.dtype,
                                       window_at=(ring.pos, pos, self.args.sliding_window), turn_back=turn_back)
        return out[:, None]

    def _index_loss(self, q: torch.Tensor, src: SourceKV, scores: torch.Tensor) -> torch.Tensor:
        """KL from this layer's dense attention over every visible record (averaged over heads,
        no gradient) to the indexer's softmax, per query with a visible record — the
        indexer's training signal (DeepSeek-V3.2's lightning-indexer objective)."""
        visible = scores > float("-inf")
        with torch.no_grad():
            rec = src.kv.unpack_main(src.view()[0], self.head_dim)
            r = torch.einsum("bshd,bnd->bshn", q.float(), rec) * self.head_dim ** -0.5
            target = r.masked_fill(~visible[:, :, None, :], float("-inf")).softmax(-1).nan_to_num(0.0).mean(2)
        logp = scores.masked_fill(~visible, -1e4).log_softmax(-1)
        kl = (target * (target.clamp_min(1e-12).log() - logp)).sum(-1)
        rows = visible.any(-1)
        return (kl * rows).sum() / rows.sum().clamp_min(1)

    def _grouped_wo_a(self, out: torch.Tensor) -> torch.Tensor:
        B, S = out.shape[:2]
        g, rows = self.args.o_groups, out.flatten(2)
        gemv = kernels.gemv if kernels.gemv_runs(rows, self.wo_a) else kernels.gemv_ref
        return gemv(rows, self.wo_a.weight, groups=g)[0].view(B, S, g, -1)


# ----------------------------------------------------------------------------- Engram

class EngramTable(nn.Module):
    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class Engram(nn.Module):
    """Hashed n-gram rows -> one key per hc stream and a shared value, gated into the streams."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.args = args
        self.slot = args.engram_layer_ids.index(layer)
        self.embed = EngramTable(args.engram_num_embeddings[self.slot], args.engram_head_dim)
        self.wkv = nn.Linear(args.engram_n_cols * args.engram_head_dim,
                             args.hidden_size * (args.hc_mult + 1), bias=False)
        self.q_weight = nn.Parameter(torch.ones(args.hc_mult, args.hidden_size))
        self.k_weight = nn.Parameter(torch.ones(args.hc_mult, args.hidden_size))

    def forward(self, streams: torch.Tensor, hash_ids: torch.Tensor, live: torch.Tensor | None,
                kv=None) -> torch.Tensor:
        """``kv``: :meth:`kv` of ``hash_ids`` when already launched (a ``kernels.Beside``)."""
        D, hc = self.args.hidden_size, self.args.hc_mult
        kv = self.kv(hash_ids) if kv is None else kv.value()
        key, value = kv.split([hc * D, D], dim=-1)
        return kernels.engram_gate(streams, key, value, self.q_weight, self.k_weight, live, self.args.rms_norm_eps)

    def kv(self, hash_ids: torch.Tensor) -> torch.Tensor:
        """The hashed rows' key and value [..., (hc + 1) * D]: they read no hidden state, so a
        decode step may make them beside its layers (``engram.BESIDE``). Through torch's
        linear layer (cuBLAS) on every path, not the GEMV kernel: the same bits beside the step
        or inline, with the CUDA graphs or without, and far fewer programs at once beside the
        layers' kernels than the GEMV's thousands."""
        return self.wkv(self.embed(hash_ids).flatten(-2).to(self.wkv.weight.dtype))


# ----------------------------------------------------------------------------- mHC block

def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_k pre_k * stream_k (``kernels.hc_collapse_ref``; one kernel on CUDA)."""
    return kernels.hc_collapse(streams, pre)


def hc_expand(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out_k = post_k * y + sum_j comb[j, k] * residual_j (``kernels.hc_expand_ref``; one kernel on CUDA)."""
    return kernels.hc_expand(y, residual, post, comb)


def expand_output(streams: torch.Tensor, output: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A site's ``output`` = (y, post, comb) added to ``streams`` (:func:`hc_expand`; y may be
    a ``kernels.Pending``)."""
    y, post, comb = output
    return hc_expand(y, streams, post, comb)


class Block(nn.Module):
    """One layer: [Engram] -> attention site -> FFN site, each collapsing with the *previous*
    site's ``pre`` (V4.1's lagged mHC) and expanding with its own ``post`` / ``comb``."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.args, self.layer = args, layer
        self.attn = Attention(args, layer)
        self.ffn = MoE(args)
        self.attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.engram = Engram(args, layer) if layer in args.engram_layer_ids else None
        mix, width = (2 + args.hc_mult) * args.hc_mult, args.hc_mult * args.hidden_size
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.zeros(mix, width)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros(mix)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3)))

    def forward(self, streams, pre, step: Step, cache: Cache, ropes: Ropes):
        streams = self.engram_site(streams, step.hash_ids, step.image_mask)
        taps = step.shared.get("taps")
        if isinstance(taps, dict) and self.layer in self.args.dspark_target_layer_ids:
            taps[self.layer] = streams.mean(dim=2)  # DSpark context: this layer's input, averaged over hc
        if step.graphs is None:
            a_pre, a_post, a_comb, x = self.attn_site(streams, pre)
            with shared_rope_angles():  # not around graph segments: each opens its own
                y = self.attn(x, step, cache, ropes)
            return self.ffn_site(y, streams, a_pre, a_post, a_comb, step.image_mask)
        # a CUDA decode step without the fused kernels: two graphs replay around the eager
        # cache work (with them Transformer.run_layers runs the step, one graph for all layers)
        pos = step.positions(streams.device)
        a_pre, a_post, a_comb, x, q_res, q, kv, *index_query = step.graphs.run(
            (self.layer, "attn"), partial(self.attn_segment, ropes=ropes, fmt=cache.kv), streams, pre, pos)
        if index_query:
            step.shared[("index_query", self.layer)] = tuple(index_query)
        out = self.attn.core(x, q_res, q, kv, pos, step, cache, ropes)
        return step.graphs.run((self.layer, "ffn"), partial(self.projected_ffn_site, ropes=ropes),
                               out, pos, streams, a_pre, a_post, a_comb)

    def engram_site(self, streams, hash_ids, image_mask=None, kv=None):
        """The Engram memory added to the streams, in a layer that has one (``hash_ids``:
        the step's, every Engram layer's columns; ``kv``: as ``Engram.forward``'s)."""
        if self.engram is None or hash_ids is None:
            return streams
        return self.engram(streams, hash_ids[:, :, self.engram.slot], None if image_mask is None else ~image_mask, kv)

    def whole_layer(self, streams, pre, pos, shared: dict, *, ropes: Ropes, cache: Cache, emits: bool,
                    image_mask=None, expand=None):
        """One decode step of the layer, fused kernels on: (streams, pre, (y, post, comb), *what
        later layers read). The FFN's output y is NOT yet in the streams: the next layer's
        attention site adds it (its ``expand``), or the caller (:func:`expand_output`);
        ``expand``: the layer before's, likewise. ``shared``: what earlier layers
        wrote. Inside the step's :func:`shared_rope_angles` scope (``Transformer._step_layers``)."""
        streams, a_pre, a_post, a_comb, x, norm = self.site("attn", streams, pre, expand=expand, overlap=True,
                                                            norm_later=True)
        compressing = []  # the compressor launched beside, as soon as x is made

        def early(x):
            compressing.append(self.attn.compress_beside(x, pos=pos, cache=cache, emits=emits, ropes=ropes))

        x, q_res, q, kv, *qw = self.projections(x, pos, ropes=ropes, fmt=cache.kv, fused=True, norm=norm,
                                                early=early)
        turn = kernels.merge_turns_back(q)
        out, written = self.attn.decode_step(x, q_res, q, kv, pos, self.attn.step_reads(shared), cache, ropes,
                                             emits, tuple(qw) or None, compressing[0] if compressing else None,
                                             turn_back=turn)
        return (*self.ffn_output(self.attn.output(out, pos, ropes, later=True, turned=turn), streams, a_pre, a_post,
                                 a_comb, image_mask, overlap=True), *written)

    def attn_site(self, streams, pre):
        """The attention site's mixes and its normalised input (reads no cache)."""
        _, a_pre, a_post, a_comb, x, _ = self.site("attn", streams, pre)
        return a_pre, a_post, a_comb, x

    def projected_attn_site(self, streams, pre, pos, *, ropes: Ropes, fmt: KVFormat):
        """:meth:`attn_site` and :meth:`projections`."""
        a_pre, a_post, a_comb, x = self.attn_site(streams, pre)
        return (a_pre, a_post, a_comb, *self.projections(x, pos, ropes=ropes, fmt=fmt))

    def projections(self, x, pos, *, ropes: Ropes, fmt: KVFormat, fused: bool = False, norm=None, early=None):
        """The attention's projections of the site's input (``Attention.project``, ``fused``,
        ``norm`` and ``early`` as there) and, in a layer with an indexer, its query and head weights
        (``Indexer.query``): (x normalised, q_res, q, kv, *index)."""
        x, q_res, q, kv = self.attn.project(x, pos, ropes, fmt, fused, norm, early)
        index = () if self.attn.indexer is None else self.attn.indexer.query(x, q_res, pos, ropes.compress, fmt)
        return (x, q_res, q, kv, *index)

    def attn_segment(self, streams, pre, pos, *, ropes: Ropes, fmt: KVFormat):
        """:meth:`projected_attn_site` as a graph segment: with its own RoPE-angle scope."""
        with shared_rope_angles():
            return self.projected_attn_site(streams, pre, pos, ropes=ropes, fmt=fmt)

    def projected_ffn_site(self, out, pos, streams, a_pre, a_post, a_comb, *, ropes: Ropes, image_mask=None):
        """The attention's output projection (``Attention.output``), then :meth:`ffn_site`."""
        return self.ffn_site(self.attn.output(out, pos, ropes), streams, a_pre, a_post, a_comb, image_mask)

    def ffn_site(self, y, streams, a_pre, a_post, a_comb, image_mask=None):
        """Attention output expanded into the streams, then the whole FFN site (reads no cache)."""
        streams, f_pre, output = self.ffn_output(y, streams, a_pre, a_post, a_comb, image_mask)
        return expand_output(streams, output), f_pre

    def ffn_output(self, y, streams, a_pre, a_post, a_comb, image_mask=None, overlap: bool = False):
        """:meth:`ffn_site` short of its last expand: (streams, pre, (the FFN's output, post,
        comb)), what ``hc_expand`` or the next site's ``expand`` adds to the streams. With
        ``overlap`` (the whole-step decode) the site's norm is left to the MoE's gate launch
        and the FFN's output may be a ``kernels.Pending`` (its last launch left for the next
        site to fold its first one into); ``y`` may be one."""
        streams, f_pre, f_post, f_comb, x, norm = self.site("ffn", streams, a_pre, expand=(y, a_post, a_comb),
                                                            overlap=overlap, norm_later=overlap)
        return streams, f_pre, (self.ffn(x, image_mask, norm=norm, later=overlap), f_post, f_comb)

    def site(self, name: str, streams, pre, expand=None, overlap: bool = False, norm_later: bool = False):
        """``kernels.hc_site`` of the attention or FFN site: (streams, pre, post, comb, the
        site's input, the norm it still wants); ``expand``: the site before's output to add to
        the streams first; ``overlap``: its ``overlap`` (the whole-step decode, which joins at
        its end); ``norm_later``: its ``norm_later`` — where the kernel left the site's RMSNorm
        to x's reader, the last value is that norm's (weight, eps), else None (x normalised)."""
        norm = self.attn_norm if name == "attn" else self.ffn_norm
        out = kernels.hc_site(streams, pre, getattr(self, f"hc_{name}_fn"), getattr(self, f"hc_{name}_scale"),
                              getattr(self, f"hc_{name}_base"), norm.weight, eps=self.args.rms_norm_eps,
                              norm_eps=norm.eps, iters=self.args.hc_sinkhorn_iters, hc_eps=self.args.hc_eps,
                              expand=expand, overlap=overlap, norm_later=norm_later, name=name)
        later = norm_later and out[5]
        return (*out[:5], (norm.weight, norm.eps) if later else None)


# ----------------------------------------------------------------------------- model

class Transformer(nn.Module):
    """The V4.1 backbone. ``model(ids)`` is the exact full forward: logits [B, T, vocab]."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList([Block(args, i) for i in range(args.num_hidden_layers)])
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.ropes = Ropes(args)
        self.hasher: NgramHasher | None = None
        if args.vision is not None:
            self.vision = VisionTransformer(args.vision)
            self.aligner = Aligner(args.vision, args.hidden_size)
            self.image_start = nn.Parameter(torch.zeros(args.hidden_size))
            self.image_end = nn.Parameter(torch.zeros(args.hidden_size))
            self.image_newline = nn.Parameter(torch.zeros(args.hidden_size))
        if args.num_nextn_predict_layers:
            from model.dspark import DSpark  # imported here: model.dspark builds on this module

            self.mtp = DSpark(args)  # the draft stages, checkpoint names mtp.K.*
        self._graphs = graphs.SegmentGraphs()
        self.register_load_state_dict_post_hook(lambda module, keys: module.reset_graphs())

    def reset_graphs(self) -> None:
        """Forget captured decode graphs: they hold the addresses of the current weights."""
        self._graphs = graphs.SegmentGraphs()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.reset_graphs()  # a move or cast gave the weights new addresses
        return self

    def encode_image(self, image, *, grad: bool = False) -> torch.Tensor:
        """A decoded RGB PIL image -> its span embeddings [n_tokens, D] (start, rows+newlines, end);
        differentiable only when ``grad`` (training)."""
        if self.args.vision is None:
            raise ValueError("this checkpoint has no vision tower; it cannot read images")
        pixels, plan = preprocess(image, self.args.vision)
        with torch.set_grad_enabled(grad):
            span = encode_image_span(self.vision, self.aligner, self.image_start, self.image_newline,
                                     self.image_end, pixels.to(self.device, self.embed.weight.dtype), plan)
        return span.to(self.embed.weight.dtype)

    def bind_token_map(self, token_map: list[int]) -> None:
        """Engram needs the tokenizer-derived compressed token map (§2.9)."""
        self.hasher = NgramHasher.from_map(self.args, token_map)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_cache(self, batch: int = 1, kv: KVFormat = KVFormat.PACKED) -> Cache:
        return Cache(self.args, batch=batch, device=self.device, kv=kv)

    def forward(self, input_ids: torch.Tensor, cache: Cache | None = None, *,
                image_embeds: torch.Tensor | None = None, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run every layer on ``input_ids`` [B, S], continuing ``cache`` (fresh if None)."""
        cache = cache if cache is not None else self.new_cache(input_ids.shape[0])
        streams, pre, step = self.begin(input_ids, cache, start=cache.length,
                                        image_embeds=image_embeds, image_mask=image_mask)
        streams, pre = self.run_layers(streams, pre, step, cache, range(self.args.num_hidden_layers))
        cache.length = max(cache.length, step.end)
        return self.logits(streams, pre)

    def ffn_capturable(self, x: torch.Tensor) -> bool:
        """Whether every layer's MoE runs its fused kernels or its grouped experts on ``x``
        [B, S, D]: the per-expert loop reads expert ids on the host, which a CUDA graph cannot capture. The
        first layer answers for all (asked every decode step): their experts are stacked
        (``stack_experts``) and parametrized (training's QAT) together, and share their shapes."""
        ffn = self.layers[0].ffn
        return ffn.runs_fused(x.reshape(-1, x.shape[-1])) or ffn.runs_grouped(x)

    def begin(self, ids: torch.Tensor, cache: Cache, start: int, image_embeds=None, image_mask=None):
        """Embeddings copied into the hc streams, the one-hot first ``pre``, and the Step."""
        x = self.embed(ids)
        if image_mask is not None and image_embeds is not None:
            x = torch.where(image_mask.unsqueeze(-1), image_embeds.to(x.dtype), x)
        step = Step(start=start, length=ids.shape[1], image_mask=image_mask,
                    new=all(src.done == start for src in cache.sources.values()))
        if graphs.wanted(ids, image_mask, cache.kv.packed) and self.ffn_capturable(x):
            step.graphs = self._graphs.for_step()
        step.hash_ids = self.engram_hash(ids, cache, start, image_mask)
        streams = x.unsqueeze(2).expand(-1, -1, self.args.hc_mult, -1).contiguous()
        pre = torch.zeros(*streams.shape[:-1], dtype=torch.float32, device=x.device)
        pre[..., 0] = 1.0
        return streams, pre, step

    def engram_hash(self, ids, cache: Cache, start: int, image_mask=None) -> torch.Tensor | None:
        if not self.args.engram_layer_ids:
            return None
        if self.hasher is None:
            raise RuntimeError("this model has Engram layers: call bind_token_map() with the tokenizer's map")
        if image_mask is None:  # a decode step: one launch where the kernels run
            token_map, multipliers, primes, offsets = self.hasher.tables(ids.device)
            made = kernels.engram_step(ids, token_map, cache.engram_ids, cache.engram_pos, start, multipliers, primes,
                                       offsets, self.hasher.pad, DEAD)
            if made is not None:
                return made
        compressed = self.hasher.compress(ids, image_mask)
        history = cache.engram_history(start, self.args.engram_max_ngram_size - 1)
        hash_ids = self.hasher(compressed, history)
        cache.record_engram(compressed, start)
        return hash_ids

    def run_layers(self, streams, pre, step: Step, cache: Cache, layers: range):
        if _fused_step(streams, step, cache.kv):
            return self._fused_layers(streams, pre, step, cache, layers)
        for i in layers:
            streams, pre = self.layers[i](streams, pre, step, cache, self.ropes)
        return streams, pre

    def _fused_layers(self, streams, pre, step: Step, cache: Cache, layers: range):
        """A decode step of ``layers`` on the fused kernels; on CUDA ONE graph, cache work
        included, so the host runs only each layer's bookkeeping (``Attention.before_step`` /
        ``after_step``) around one replay. The graph holds the cache's buffers, whose
        addresses stay put; it is captured again when one moves (a new cache, a grown
        buffer), and once per pattern of compressor groups completing (a ratio-2 source:
        odd and even positions). DSpark's taps, when asked for, come out of the step."""
        blocks = [self.layers[i] for i in layers]
        emits = tuple(b.attn.before_step(step, cache) for b in blocks)
        taps = step.shared.get("taps")
        tapped = tuple(b.layer for b in blocks if b.layer in self.args.dspark_target_layer_ids) \
            if isinstance(taps, dict) else ()
        fn = partial(self._step_layers, blocks=blocks, cache=cache, emits=emits, tapped=tapped,
                     image_mask=step.image_mask)
        inputs = (streams, pre, step.positions(streams.device)) + (() if step.hash_ids is None else (step.hash_ids,))
        if step.graphs is None:
            streams, pre, *tap_values = fn(*inputs)
        else:
            streams, pre, *tap_values = step.graphs.run(
                ("step", layers.start, layers.stop, emits, tapped), fn, *inputs,
                version=tuple(b.attn.step_memory(cache) for b in blocks))
        for b in blocks:
            b.attn.after_step(step, cache)
        if tapped:  # a graph's outputs are rewritten by its next replay: the drafter gets copies
            taps.update(zip(tapped, (t.clone() if step.graphs is not None else t for t in tap_values)))
        return streams, pre

    def _step_layers(self, streams, pre, pos, *hash_ids, blocks, cache: Cache, emits: tuple, tapped: tuple,
                     image_mask=None):
        """The layers of :meth:`_fused_layers`: (streams, pre, *the tapped layers' inputs).
        One RoPE-angle scope for them all: every layer rotates at the same position, under
        one of two frequency tables, so cos / sin are made twice a step, not in every layer.
        A layer's FFN output is added to the streams by the next layer's attention-site kernel
        (``Block.whole_layer``'s ``expand``), one launch fewer a layer; on its own before a layer
        that reads the streams first (Engram, a DSpark tap) and after the last. While a CUDA
        graph is captured, the Engram layers' projections (which read only the step's inputs)
        may be launched first on a side stream (``engram.BESIDE``), each joined at its layer, and
        the candidate pool made beside the layers after its source (``select.POOL_BESIDE``),
        joined where it is first read."""
        shared, taps = {}, []  # what each layer writes for the later ones: the top-k, the candidate pool
        pending = None  # the layer before's FFN output, added by the next attention site's kernel
        with shared_rope_angles():
            share_rope_angles(pos, self.ropes)  # a step reads both tables
            beside = bool(hash_ids) and kernels.beside_on(streams, "engram.BESIDE")
            engram_kv = {b.layer: kernels.Beside(b.engram.kv, hash_ids[0][:, :, b.engram.slot], device=streams.device)
                         for b in blocks if beside and b.engram is not None}  # kept until the step's end
            for b, e in zip(blocks, emits):
                if pending is not None and ((b.engram is not None and hash_ids) or b.layer in tapped):
                    streams, pending = expand_output(streams, pending), None
                streams = b.engram_site(streams, hash_ids[0] if hash_ids else None, image_mask, engram_kv.get(b.layer))
                if b.layer in tapped:
                    taps.append(streams.mean(dim=2))
                streams, pre, pending, *written = b.whole_layer(streams, pre, pos, shared, ropes=self.ropes,
                                                                cache=cache, emits=e, image_mask=image_mask,
                                                                expand=pending)
                shared.update(zip(("topk", "candidates"), written))
        if pending is not None:
            streams = expand_output(streams, pending)
        kernels.mhc_join()  # the last site's split, where it ran beside: pre is an output
        for made in (*engram_kv.values(), shared.get("candidates")):  # a capture ends with its side stream joined
            if isinstance(made, kernels.Beside):
                made.join()
        return (streams, pre, *taps)

    def logits(self, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        return linear(self.head, self.final_hidden(streams, pre)).float()  # a decode step's rows: the GEMV

    def final_hidden(self, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        return self.norm(hc_collapse(streams, pre))

    def project_decoder_source(self, streams, pre, step: Step, cache: Cache) -> None:
        """CED: the decoder's KV source turns the encoder output into global KV and index
        keys for every token, without running the decoder layers (ARCHITECTURE.md §2.7)."""
        layer = self.layers[self.args.decoder_start]
        if layer.engram is not None and step.hash_ids is not None:
            streams = layer.engram(streams, step.hash_ids[:, :, layer.engram.slot], None)
        x = layer.attn_norm(hc_collapse(streams, pre))
        layer.attn._update_source(x, step, cache, self.ropes)

