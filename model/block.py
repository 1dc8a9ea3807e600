"""One layer of the V4.1 network as the paper draws it: the shared-latent Attention, Engram
and the mHC Block with its lagged ``pre`` (ARCHITECTURE.md §2).

The Attention reads window entries and the records its indexer selects in one softmax with
the per-head sink, de-rotates its output and projects it through the grouped low-rank
``wo_a`` and ``wo_b``; its CSA2 mode (Full / Reindex / Reuse) is which of the CSA2 sources
(``model.csa2``) the layer owns or reads. Engram gates hashed n-gram rows into the streams.
A Block is [Engram] -> attention site -> FFN site, each site collapsing the hc streams with
the *previous* site's ``pre`` and expanding with its own ``post`` / ``comb``.

Every forward goes through an explicit :class:`model.cache.Cache`: the window entries,
records and index keys the attention reads are the packed bytes of that cache, so a full
forward, chunked prefill and decode compute the same function. Module and parameter names
are the official checkpoint names.

Does not own: the projections' kernels (``model.linear``), the mHC and norm operations'
kernels and twins (``model.kernels``: each is one function of tensors, kernel or twin chosen
by device), the CSA2 sources (``model.csa2``), the MoE (``model.moe``), the Transformer
around the layers (``model.model``), nor the fused decode step that runs these layers'
parameters through whole-layer kernels (``model.decode_step``: it reads this module; this
module never calls it).
"""
from __future__ import annotations

import torch
from torch import nn

from model import kernels
from model.args import ModelArgs
from model.cache import Cache, SourceKV
from model.csa2 import Compressor, Indexer, reads_packed
from model.layer import RMSNorm, Step
from model.linear import ALONE, Linear, Table, World, grouped_linear
from model.moe import MoE
from model.quant import KVFormat
from model.rope import Ropes, apply_rope, shared_rope_angles

# the records a training query reads: its top-k gathered, as inference reads them (on, the
# default), or every record under a mask (the dense-mask form, which the indexer's dense warm-up
# always takes: it selects every record)
GATHERED_TRAINING = True
# queries a band of a chunk's window attention (``Attention._banded_window``): each scored
# against its band's W + b entries. A CPU prefill of the default (2,200 tokens, one thread,
# best of 3, 2026-12-07): CED 1.47 / 1.42 / 1.35 / 1.29 s at b = 128 / 64 / 32 / 16, 8 as 16
WINDOW_BAND = 16


# ----------------------------------------------------------------------------- attention

class Attention(nn.Module):
    """Shared K=V latent attention over window entries plus selected compressed records."""

    def __init__(self, args: ModelArgs, layer: int, world: World = ALONE, engram: str = "device"):
        super().__init__()
        self.args, self.layer = args, layer
        self.ratio = args.ratios[layer]
        self._projections(args, world)
        self.compressor = Compressor(args, self.ratio) if layer in args.kv_source_layer_ids else None
        self.indexer = Indexer(args, layer) if layer in args.index_source_layer_ids else None

    def _projections(self, args: ModelArgs, world: World = ALONE) -> None:
        """The query low-rank path, the K=V latent, the grouped output and the sinks. Over a
        ``world`` of N ranks each holds H/N heads and their G/N output groups (``wq_b`` and
        ``wo_a`` split by columns, ``wo_b`` by rows: one all-reduce); the latent is everyone's."""
        heads, self.head_dim = args.num_attention_heads, args.head_dim
        self.n_heads, self.o_groups = world.share(heads, "num_attention_heads"), world.share(args.o_groups, "o_groups")
        self.wq_a = Linear(args.hidden_size, args.q_lora_rank)
        self.q_norm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
        self.wq_b = Linear(args.q_lora_rank, heads * self.head_dim, split="column", world=world)
        self.wkv = Linear(args.hidden_size, self.head_dim)
        self.kv_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        group_in = heads * self.head_dim // args.o_groups
        self.wo_a = Linear(group_in, args.o_groups * args.o_lora_rank, split="column", world=world)
        self.wo_b = Linear(args.o_groups * args.o_lora_rank, args.hidden_size, split="row", world=world)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))

    def forward(self, x: torch.Tensor, step: Step, cache: Cache, ropes: Ropes) -> torch.Tensor:
        pos = step.positions(x.device)
        q_res, q, kv = self.project(x, pos, ropes, cache.kv)
        return self.output(self.core(x, q_res, q, kv, pos, step, cache, ropes), pos, ropes)

    def project(self, x: torch.Tensor, pos: torch.Tensor, ropes: Ropes, fmt: KVFormat):
        """(q_res [B, S, q_lora], RoPE'd queries [B, S, H, D], this step's window entries as
        ``fmt`` rounds them [B, S, D]): reads no cache."""
        B, S, _ = x.shape
        inv = self.rope_table(ropes)
        q_res, kv_lat = self.q_norm(self.wq_a(x)), self.wkv(x)
        q = apply_rope(self.wq_b(q_res).view(B, S, self.n_heads, self.head_dim), pos, inv, in_place=True)
        return q_res, q, self.window_values(kv_lat, pos, inv, fmt)

    def output(self, out: torch.Tensor, pos: torch.Tensor, ropes: Ropes) -> torch.Tensor:
        """The attention output [B, S, H, D] de-rotated, through the grouped ``wo_a`` and ``wo_b``."""
        turned = apply_rope(out, pos, self.rope_table(ropes), inverse=True, in_place=True)
        return self.wo_b(grouped_linear(self.wo_a, turned.flatten(2), self.o_groups))

    def core(self, x, q_res, q, kv, pos, step: Step, cache: Cache, ropes: Ropes, index_query=None) -> torch.Tensor:
        """The part that reads and writes the cache: window ring, KV source, indexer, attention.
        ``index_query``: the indexer's :meth:`Indexer.query` of these tokens, where the caller
        made it already."""
        packed = self._packed_window(kv, step, cache)
        if packed is None:
            keys, key_mask = (self._banded_window if x.shape[1] > 2 * WINDOW_BAND
                              else self._window_keys)(kv, step, cache)
        records = None
        if self.ratio:
            self.update_source(x, step, cache, ropes)
            if self.indexer is not None:
                src = cache.sources[self.args.kv_source(self.layer)]
                step.shared["topk"] = self.indexer(x, q_res, step, src, ropes.compress, index_query)
                if step.index_losses is not None and "index_scores" in step.shared:
                    step.index_losses.append(self._index_loss(q, src, step.shared.pop("index_scores")))
            if packed is None:
                records = self._selected_records(cache, step)
        if packed is not None:
            return self._attend_packed(q, *packed, cache, step)
        return self.attend(q, keys, key_mask, records)

    def rope_table(self, ropes: Ropes) -> torch.Tensor:
        """The frequency table this layer rotates by: YaRN's compress table where it has a KV
        source (ratio > 0), else the main one."""
        return ropes.compress if self.ratio else ropes.main

    def window_values(self, kv_lat: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
        """Window entries from their K=V latent: normalised, rotated, as ``fmt`` rounds them."""
        return fmt.window(apply_rope(self.kv_norm(kv_lat), pos, inv, in_place=True))

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

    def _banded_window(self, kv: torch.Tensor, step: Step, cache: Cache):
        """:meth:`_window_keys` for a chunk of more than two bands, cut in bands of b =
        ``WINDOW_BAND`` queries: the entries of positions [start - W, start + S) in order (the
        ring's where it holds them), padded to whole bands, as overlapping spans [B, n, W + b,
        D] — band i's queries, positions start + [ib, (i + 1)b), see only span i's entries,
        positions start + [ib - W, (i + 1)b) — and the mask [1 or B, S, W + b] of each query
        over its band's span; writes the ring. :meth:`attend` scores a query against W + b
        entries, not all cap + S of them."""
        ring, W, b = cache.windows[self.layer], self.args.sliding_window, WINDOW_BAND
        S, bands = kv.shape[1], -(-kv.shape[1] // b)
        slots, old_pos = ring.before(step.start, W)
        old = ring.read()[0]  # read before the write
        pad = bands * b - S
        keys = torch.cat([old[:, slots].to(kv.dtype), kv, kv.new_zeros(kv.shape[0], pad, kv.shape[2])], dim=1)
        key_pos = torch.cat([old_pos, step.positions(kv.device), old_pos.new_full((pad,), -1)])
        spans = keys.unfold(1, W + b, b).transpose(2, 3)  # [B, n, W + b, D]
        span_pos = key_pos.unfold(0, W + b, b)  # [n, W + b]
        pos = (step.start + torch.arange(bands * b, device=kv.device)).view(bands, b, 1)
        mask = (span_pos[:, None] >= 0) & (span_pos[:, None] <= pos) & (span_pos[:, None] > pos - W)
        mask = mask.view(1, bands * b, W + b)[:, :S]
        if step.floor is not None:
            floor_pos = span_pos.repeat_interleave(b, 0)[None, :S]  # [1, S, W + b]
            mask = mask & (floor_pos >= step.floor[:, self.layer, None, None])
        ring.write(kv, step.positions(kv.device))
        return spans, mask

    def _packed_window(self, kv: torch.Tensor, step: Step, cache: Cache):
        """Where the prefill kernel attends (``model.csa2.reads_packed``): (the FP8 window
        entries of positions [start - window, end) in order [B, window + S, bytes], their
        positions, -1 where the ring holds none); writes the ring. Else None, and
        :meth:`_window_keys` makes the reference's keys."""
        if not reads_packed(step, cache.kv):
            return None
        ring, span = cache.windows[self.layer], self.args.sliding_window
        pos = step.positions(kv.device)
        slots, old_pos = ring.before(step.start, span)
        old, new = ring.data[:, slots], cache.kv.pack_window(kv)  # the old rows read before the write
        ring.write_packed(new, pos)
        return torch.cat([old, new], dim=1), torch.cat([old_pos, pos])

    def _attend_packed(self, q, window, window_pos, cache: Cache, step: Step) -> torch.Tensor:
        """:meth:`attend` on the packed bytes (:meth:`_packed_window`'s and the source's
        records at the step's selection), each sequence by ``kernels.sparse_prefill``."""
        idx = step.shared.get("topk") if self.ratio else None
        src = cache.sources[self.args.kv_source(self.layer)] if idx is not None else None
        records = src.view()[0] if src is not None and src.n else None
        return torch.stack([kernels.sparse_prefill(
            q[b], window[b], window_pos, None if records is None else records[b], None if records is None else idx[b],
            self.attn_sink, self.head_dim ** -0.5, out_dtype=q.dtype) for b in range(q.shape[0])])

    def update_source(self, x: torch.Tensor, step: Step, cache: Cache, ropes: Ropes) -> None:
        """This layer's KV source (where it owns one): the groups that complete become FP4
        records (rotated) and index keys."""
        if self.compressor is None:
            return
        src = cache.sources[self.layer]
        latent, first = self.compressor(x, step, src)
        if latent is not None:
            positions = first + self.ratio * torch.arange(latent.shape[1], device=x.device)
            records = src.kv.pack_main(apply_rope(latent, positions, ropes.compress))
            src.append(records, self.indexer.keys(latent.detach(), positions, ropes.compress, src.kv))

    def _selected_records(self, cache: Cache, step: Step):
        """(rows [B, S, k, D], valid [B, S, k]) gathered per query; in the indexer's dense
        warm-up (and while training, with ``GATHERED_TRAINING`` off) the dense-mask form (every
        record [B, n, D], selected [B, S, n]) of the same softmax."""
        idx = step.shared.get("topk")
        src = cache.sources[self.args.kv_source(self.layer)]
        if idx is None or src.n == 0:
            return None
        B, S, k = idx.shape
        packed = src.view()[0]
        if step.dense or (step.index_losses is not None and not GATHERED_TRAINING):
            # a -1 (no record) goes to a spare column: clamped to 0, its False would land on
            # record 0 too, and of two writes to one place the last wins (on CUDA, either)
            selected = torch.zeros(B, S, src.n + 1, dtype=torch.bool, device=idx.device)
            selected.scatter_(-1, torch.where(idx >= 0, idx, src.n), True)
            return src.kv.unpack_main(packed, self.head_dim), selected[..., :src.n]
        # whole rows by their index in [B * n] (index_select copies rows; gather, element by element)
        picks = (idx.clamp_min(0) + src.n * torch.arange(B, device=idx.device).view(B, 1, 1)).flatten()
        if src.n < S * k:  # fewer records than picks (a prefill's chunk): each decoded once, then picked
            rows = src.kv.unpack_main(packed, self.head_dim)
            return rows.flatten(0, 1).index_select(0, picks).view(B, S, k, -1), idx >= 0
        rows = packed.flatten(0, 1).index_select(0, picks).view(B, S * k, -1)
        return src.kv.unpack_main(rows, self.head_dim).view(B, S, k, -1), idx >= 0

    def attend(self, q, keys, key_mask, records) -> torch.Tensor:
        """One softmax over window entries, selected records and the per-head sink. ``keys``:
        the window entries every query sees [B, J, D], or :meth:`_banded_window`'s spans [B, n,
        W + b, D], b queries a span; ``key_mask`` [1 or B, S, J or W + b] which of them each sees."""
        scale = self.head_dim ** -0.5
        band = keys.shape[2] - self.args.sliding_window if keys.dim() == 4 else 0
        logits = [_window_product(q.float(), keys.float(), "bshd,bjd->bshj", band) * scale]
        logits[0] = logits[0].masked_fill(~key_mask[:, :, None, :], float("-inf"))
        per_query = records is not None and records[0].dim() == 4
        if records is not None:
            rec, valid = records
            r = torch.einsum("bshd,bskd->bshk" if per_query else "bshd,bkd->bshk", q.float(), rec) * scale
            logits.append(r.masked_fill(~valid[:, :, None, :], float("-inf")))
        sink = self.attn_sink.float().view(1, 1, -1, 1).expand(*q.shape[:3], 1)
        probs = torch.cat(logits + [sink], dim=-1).softmax(dim=-1)
        n_win = key_mask.shape[-1]
        out = _window_product(probs[..., :n_win], keys.float(), "bshj,bjd->bshd", band)
        if records is not None:
            out = out + torch.einsum("bshk,bskd->bshd" if per_query else "bshk,bkd->bshd",
                                     probs[..., n_win:-1], records[0])
        return out.to(q.dtype)

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


def _window_product(a: torch.Tensor, keys: torch.Tensor, form: str, band: int) -> torch.Tensor:
    """``einsum(form, a, keys)`` for ``a`` [B, S, H, x]; with ``keys`` [B, n, W + band, D]
    (:meth:`Attention._banded_window`'s spans), query rows [i band, (i + 1) band) of ``a``
    with span i alone."""
    if keys.dim() == 3:
        return torch.einsum(form, a, keys)
    B, S, H = a.shape[:3]
    n = keys.shape[1]
    a = torch.nn.functional.pad(a, (0, 0, 0, 0, 0, n * band - S)).view(B, n, band, H, a.shape[-1])
    out = torch.einsum(form.replace("b", "bn"), a, keys)
    return out.reshape(B, n * band, H, out.shape[-1])[:, :S]


# ----------------------------------------------------------------------------- Engram

class Engram(nn.Module):
    """Hashed n-gram rows -> one key per hc stream and a shared value, gated into the streams."""

    def __init__(self, args: ModelArgs, layer: int, world: World = ALONE, host: bool = False):
        super().__init__()
        self.args = args
        self.slot = args.engram_layer_ids.index(layer)
        self.embed = Table(args.engram_num_embeddings[self.slot], args.engram_head_dim, world=world, host=host)
        self.wkv = Linear(args.engram_n_cols * args.engram_head_dim, args.hidden_size * (args.hc_mult + 1), gemv=False)
        self.q_weight = nn.Parameter(torch.ones(args.hc_mult, args.hidden_size))
        self.k_weight = nn.Parameter(torch.ones(args.hc_mult, args.hidden_size))

    def forward(self, streams: torch.Tensor, hash_ids: torch.Tensor, live: torch.Tensor | None,
                rows=None) -> torch.Tensor:
        return self.gate(streams, self.kv(hash_ids, rows), live)

    def kv(self, hash_ids: torch.Tensor, rows=None) -> torch.Tensor:
        """The hashed rows' key and value [..., (hc + 1) * D], in the model's float dtype (that of
        ``q_weight``: the table and the projection may be packed). ``rows``: the table's rows of
        ``hash_ids`` fetched before the layer ran (a table in host memory: ``Table.fetch``).
        A plain projection never by the GEMV kernel (``gemv=False``): a decode step may make them
        beside its layers (``model.decode_step``), where cuBLAS's few programs suit, and either
        way they are the same bits; a packed one by the GEMV on its bytes, both ways too."""
        rows = self.embed(hash_ids) if rows is None else self.embed.ready(rows)
        return self.wkv(rows.flatten(-2).to(self.q_weight.dtype))

    def gate(self, streams: torch.Tensor, kv: torch.Tensor, live: torch.Tensor | None) -> torch.Tensor:
        """:meth:`kv`'s value gated into the streams by each stream's key."""
        D, hc = self.args.hidden_size, self.args.hc_mult
        key, value = kv.split([hc * D, D], dim=-1)
        return kernels.engram_gate(streams, key, value, self.q_weight, self.k_weight, live, self.args.rms_norm_eps)


# ----------------------------------------------------------------------------- mHC block

def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_k pre_k * stream_k (``kernels.hc_collapse_ref``; one kernel on CUDA)."""
    return kernels.hc_collapse(streams, pre)


def hc_expand(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out_k = post_k * y + sum_j comb[j, k] * residual_j (``kernels.hc_expand_ref``; one kernel on CUDA)."""
    return kernels.hc_expand(y, residual, post, comb)


def expand_output(streams: torch.Tensor, output: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A site's ``output`` = (y, post, comb) added to ``streams`` (:func:`hc_expand`)."""
    y, post, comb = output
    return hc_expand(y, streams, post, comb)


class Block(nn.Module):
    """One layer: [Engram] -> attention site -> FFN site, each collapsing with the *previous*
    site's ``pre`` (V4.1's lagged mHC) and expanding with its own ``post`` / ``comb``."""

    def __init__(self, args: ModelArgs, layer: int, world: World = ALONE, engram: str = "device"):
        super().__init__()
        self.args, self.layer = args, layer
        self.attn = Attention(args, layer, world)
        self.ffn = MoE(args, world=world)
        self.attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.engram = Engram(args, layer, world, engram == "host") if layer in args.engram_layer_ids else None
        self._mixes(args)

    def _mixes(self, args: ModelArgs) -> None:
        """Each site's mHC projection of the flattened streams, its bias and its scales."""
        mix, width = (2 + args.hc_mult) * args.hc_mult, args.hc_mult * args.hidden_size
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.zeros(mix, width)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros(mix)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3)))

    def forward(self, streams, pre, step: Step, cache: Cache, ropes: Ropes):
        """(streams, pre) [B, S, hc, D], [B, S, hc] -> the same after this layer."""
        streams = self.engram_site(streams, step.hash_ids, step.image_mask, step.engram_rows)
        taps = step.shared.get("taps")
        if isinstance(taps, dict) and self.layer in self.args.dspark_target_layer_ids:
            taps[self.layer] = streams.mean(dim=2)  # DSpark context: this layer's input, averaged over hc
        a_pre, a_post, a_comb, x = self.attn_site(streams, pre)
        with shared_rope_angles():
            y = self.attn(x, step, cache, ropes)
        return self.ffn_site(y, streams, a_pre, a_post, a_comb, step.image_mask)

    def engram_site(self, streams, hash_ids, image_mask=None, rows: dict | None = None):
        """The Engram memory added to the streams, in a layer that has one (``hash_ids``:
        the step's, every Engram layer's columns; ``rows``: ``Step.engram_rows``)."""
        if self.engram is None or hash_ids is None:
            return streams
        return self.engram(streams, hash_ids[:, :, self.engram.slot], None if image_mask is None else ~image_mask,
                           (rows or {}).get(self.engram.slot))

    def attn_site(self, streams, pre):
        """The attention site's mixes and its normalised input (reads no cache)."""
        _, a_pre, a_post, a_comb, x = self.site("attn", streams, pre)
        return a_pre, a_post, a_comb, x

    def ffn_site(self, y, streams, a_pre, a_post, a_comb, image_mask=None):
        """Attention output expanded into the streams, then the whole FFN site (reads no cache)."""
        streams, f_pre, f_post, f_comb, x = self.site("ffn", streams, a_pre, expand=(y, a_post, a_comb))
        return hc_expand(self.ffn(x, image_mask), streams, f_post, f_comb), f_pre

    def site(self, name: str, streams, pre, expand=None):
        """The attention or FFN site (``kernels.hc_site``): (streams, pre, post, comb, the
        site's normalised input); ``expand``: the site before's (y, post, comb), added to the
        streams first."""
        norm = self.attn_norm if name == "attn" else self.ffn_norm
        return kernels.hc_site(streams, pre, getattr(self, f"hc_{name}_fn"), getattr(self, f"hc_{name}_scale"),
                               getattr(self, f"hc_{name}_base"), norm.weight, eps=self.args.rms_norm_eps,
                               norm_eps=norm.eps, iters=self.args.hc_sinkhorn_iters, hc_eps=self.args.hc_eps,
                               expand=expand)
