"""The DeepSeek-V4.1-Flash text network in plain PyTorch: the reference every kernel matches.

Reads like the architecture (ARCHITECTURE.md §2): the shared-latent Attention with its
sink over the window and the CSA2 KV sources, the MoE (``model.moe``), Engram, the mHC
Block with its lagged ``pre``, and the Transformer, with the choice of which decode steps
take the fused path (``_fused_step``). Module and parameter names are the official
checkpoint names, so loading is a name-for-name copy. A decode step on CUDA replays as
CUDA graphs (``model.graphs``): where the fused kernels of ``model.kernels`` run, the
whole step over every layer, cache work included, is one graph
(``Transformer.run_layers``); else two segments a layer.

Every forward goes through an explicit :class:`model.cache.Cache` (a fresh one when none
is given): the window entries, records and index keys the attention reads are the packed
bytes of that cache, so a full forward, chunked prefill and decode compute the same
function. Positions that a cache already covers are never compressed twice, which is
what makes bounded-replay prefill and resume a matter of choosing which layers to run.

Does not own: the layers' basics, ``Step``, ``RMSNorm`` and ``linear`` (``model.layer``),
the two RoPE tables and the rotation (``model.rope``), the CSA2 sources' Compressor,
Indexer and candidate pool (``model.csa2``), sampling, prefill strategies and session
state (``model.engine``), weight files (``model.checkpoint``), tokenization
(``model.tokenizer``).
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from model import graphs, kernels
from model.args import ModelArgs
from model.cache import Cache, SourceKV, WindowRing
from model.csa2 import Compressor, Indexer
from model.engram import DEAD, NgramHasher
from model.layer import RMSNorm, Step, embedding, linear
from model.moe import MoE
from model.quant import KVFormat, main_record_bytes
from model.rope import Ropes, apply_rope, rope_angles, share_rope_angles, shared_rope_angles
from model.vision import Aligner, VisionTransformer, encode_image_span, preprocess


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


class Transformer(nn.Module):
    """The V4.1 backbone. ``model(ids)`` is the exact full forward: logits [B, T, vocab]."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed = embedding(args.vocab_size, args.hidden_size)
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

