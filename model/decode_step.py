"""The fast decode step: a Transformer's parameters run through whole-layer kernels and CUDA graphs.

The reference network (``model.model``, ``model.block``, ``model.csa2``, ``model.moe``) is
the spec and knows nothing of launches, graphs or side streams. This module runs a decode
step of the same network on the same parameters, fast, and computes the same function:

- **the fused step** (:func:`takes_fused`: one new token a row on CUDA with Triton, or the
  kernels' PyTorch twins where a test asks): every layer's work in ~13 kernels, the cache
  work included, on the cache's fixed buffers with the position as a tensor, so the whole
  step over every layer replays as ONE CUDA graph; the host keeps the counts around the
  replay (:func:`_before_step` / :func:`_after_step`). The mHC site before each projection
  leaves its RMSNorm to the projection's GEMV (``norm_later``), a layer's FFN output is
  added to the streams by the next layer's site kernel (``expand``), the Engram
  projections, a ratio-2 compressor and the candidate pool run on a side stream beside the
  layers (``kernels.Beside``);
- **segmented graphs** where the fused kernels do not run on CUDA: two graphs a layer (the
  attention site with its projections, the FFN site with the output projection and the
  MoE) around the eager cache work of :meth:`model.block.Attention.core`;
- else the reference's own ``Transformer.run_layers``.

The engine, the speculator and the benchmarks enter here (:func:`begin`,
:func:`run_layers`, :func:`forward`); training and the reference's own forward do not.
Captured graphs live in ``Transformer.derived``, which the model empties when its weights
move. Does not own: the kernels (``model.kernels``), the graphs' capture and replay
(``model.graphs``), nor the maths, which is the reference modules'.
"""
from __future__ import annotations

from functools import partial

import torch

from model import graphs, kernels
from model.block import Attention, Block, expand_output
from model.cache import Cache, SourceKV, WindowRing
from model.csa2 import Compressor, Indexer, candidate_rows
from model.engram import DEAD
from model.layer import Step
from model.linear import Table, grouped_linear
from model.moe import MoE
from model.quant import KVFormat, main_record_bytes
from model.rope import Ropes, apply_rope, rope_angles, share_rope_angles, shared_rope_angles


# ----------------------------------------------------------------------------- entry points

def is_decode_step(x: torch.Tensor, step: Step, kv: KVFormat) -> bool:
    """One new position (not a replayed one) on a packed cache, outside training: a step the
    fused path can take (tests put it in place of :func:`takes_fused` to run that path on
    the kernels' PyTorch twins)."""
    return (x.shape[1] == 1 and step.new and kv.packed and step.floor is None and step.index_losses is None
            and not step.dense)


def takes_fused(x: torch.Tensor, step: Step, kv: KVFormat) -> bool:
    """A :func:`is_decode_step` where the fused kernels of ``model.kernels`` run (CUDA with
    Triton; ``DSAGENT_KERNELS=0`` turns them off)."""
    return is_decode_step(x, step, kv) and kernels.enabled(x)


def graphs_of(model) -> graphs.SegmentGraphs:
    """The model's captured decode graphs (made on first use; dropped when its weights move)."""
    if "graphs" not in model.derived:
        model.derived["graphs"] = graphs.SegmentGraphs()
    return model.derived["graphs"]


def asks_packed_reads(x: torch.Tensor, tokens: int) -> bool:
    """Whether a step of ``tokens`` tokens on ``x``'s device has its attention and indexer read
    the cache's bytes in place (``Step.packed_reads``): a prefill's chunk or a verify where the
    kernels run (``kernels.attends_packed``); a decode step has its own fused path."""
    return tokens > 1 and kernels.attends_packed(x)


def begin(model, ids: torch.Tensor, cache: Cache, start: int, image_embeds=None, image_mask=None):
    """``Transformer.begin``, with a decode step's Engram hashing in one launch (where it
    runs) and its graphs chosen: a one-token text step on CUDA whose every MoE can be captured."""
    hash_ids = _hash_step(model, ids, cache, start) if image_mask is None else None
    streams, pre, step = model.begin(ids, cache, start, image_embeds=image_embeds, image_mask=image_mask,
                                     hash_ids=hash_ids)
    step.packed_reads = asks_packed_reads(streams, ids.shape[1])
    if (graphs.wanted(ids, image_mask, cache.kv.packed) and captures_collectives(model.world)
            and ffn_capturable(model, streams[:, :, 0])):
        step.graphs = graphs_of(model).for_step()
    return streams, pre, step


def run_layers(model, streams, pre, step: Step, cache: Cache, layers: range):
    """``Transformer.run_layers`` on the fastest path that computes it here. Over several ranks
    the fused step sums what the reference sums (``wo_b``'s rows, the routed experts, the
    Engram rows: :func:`_output`, ``MoE.routed_and_shared``, ``Table.forward``), eagerly."""
    if takes_fused(streams, step, cache.kv):
        return _fused_layers(model, streams, pre, step, cache, layers)
    if step.graphs is not None:
        for i in layers:
            streams, pre = _segmented_layer(model.layers[i], streams, pre, step, cache, model.ropes)
        return streams, pre
    return model.run_layers(streams, pre, step, cache, layers)


def forward(model, input_ids: torch.Tensor, cache: Cache | None = None, *, image_embeds=None,
            image_mask=None) -> torch.Tensor:
    """``model(input_ids, cache)`` through :func:`begin` and :func:`run_layers`."""
    cache = cache if cache is not None else model.new_cache(input_ids.shape[0])
    streams, pre, step = begin(model, input_ids, cache, cache.length, image_embeds=image_embeds,
                               image_mask=image_mask)
    streams, pre = run_layers(model, streams, pre, step, cache, range(model.args.num_hidden_layers))
    cache.length = max(cache.length, step.end)
    return model.logits(streams, pre)


def captures_collectives(world) -> bool:
    """Whether a CUDA graph can hold the world's collectives on CUDA tensors: none alone, or
    NCCL's (a capture records them as the step's other kernels; every rank captures and
    replays the same ones in the same order, so the ranks' collectives still meet). Gloo's
    run on the host and cannot be captured: such a world decodes eagerly."""
    if not world.joined:
        return True
    import torch.distributed as dist

    return "nccl" in str(dist.get_backend(world.group)).lower()


def ffn_capturable(model, x: torch.Tensor) -> bool:
    """Whether every layer's MoE runs its fused kernels or its grouped experts on ``x``
    [B, S, D]: the per-expert loop reads expert ids on the host, which a CUDA graph cannot
    capture. The first layer answers for all (asked every decode step): their experts are
    stacked (``stack_experts``: floats, or FP4 as stored) and parametrized (training's QAT)
    together, and share their shapes."""
    ffn = model.layers[0].ffn
    return moe_runs_fused(ffn, x.reshape(-1, x.shape[-1])) or ffn.runs_grouped(x)


def _hash_step(model, ids: torch.Tensor, cache: Cache, start: int) -> torch.Tensor | None:
    """A decode step's Engram rows and the look-back ring's write in one launch, or None
    (no Engram, or the kernel does not run here: ``Transformer.engram_hash`` then hashes)."""
    if not model.args.engram_layer_ids or model.hasher is None:
        return None
    token_map, multipliers, primes, offsets = model.hasher.tables(ids.device)
    return kernels.engram_step(ids, token_map, cache.engram_ids, cache.engram_pos, start, multipliers, primes,
                               offsets, model.hasher.pad, DEAD)


# ----------------------------------------------------------------------------- the fused step

def _fused_layers(model, streams, pre, step: Step, cache: Cache, layers: range):
    """A decode step of ``layers`` on the fused kernels; on CUDA ONE graph, cache work
    included, so the host runs only each layer's bookkeeping (:func:`_before_step` /
    :func:`_after_step`) around one replay. The graph holds the cache's buffers, whose
    addresses stay put; it is captured again when one moves (a new cache, a grown buffer),
    and once per pattern of compressor groups completing (a ratio-2 source: odd and even
    positions). DSpark's taps, when asked for, come out of the step."""
    blocks = [model.layers[i] for i in layers]
    emits = tuple(_before_step(b.attn, step, cache) for b in blocks)
    taps = step.shared.get("taps")
    tapped = tuple(b.layer for b in blocks if b.layer in model.args.dspark_target_layer_ids) \
        if isinstance(taps, dict) else ()
    fetched = step.engram_rows or {}  # host-held tables' rows: inputs of the step, copied in before it
    host = tuple(sorted(fetched))
    fn = partial(_step_layers, model.ropes, blocks=blocks, cache=cache, emits=emits, tapped=tapped,
                 image_mask=step.image_mask, host=host)
    inputs = (streams, pre, step.positions(streams.device)) + (() if step.hash_ids is None else (step.hash_ids,)) \
        + tuple(Table.ready(fetched[slot]) for slot in host)
    if step.graphs is None:
        streams, pre, *tap_values = fn(*inputs)
    else:
        streams, pre, *tap_values = step.graphs.run(
            ("step", layers.start, layers.stop, emits, tapped, host), fn, *inputs,
            version=tuple(_step_memory(b.attn, cache) for b in blocks))
    for b in blocks:
        _after_step(b.attn, step, cache)
    if tapped:  # a graph's outputs are rewritten by its next replay: the drafter gets copies
        taps.update(zip(tapped, (t.clone() if step.graphs is not None else t for t in tap_values)))
    return streams, pre


def _step_layers(ropes: Ropes, streams, pre, pos, *engram, blocks, cache: Cache, emits: tuple, tapped: tuple,
                 image_mask=None, host: tuple = ()):
    """The layers of :func:`_fused_layers`: (streams, pre, *the tapped layers' inputs).
    One RoPE-angle scope for them all: every layer rotates at the same position, under
    one of two frequency tables, so cos / sin are made twice a step, not in every layer.
    A layer's FFN output is added to the streams by the next layer's attention-site kernel
    (:func:`_whole_layer`'s ``expand``), one launch fewer a layer; on its own before a layer
    that reads the streams first (Engram, a DSpark tap) and after the last. While a CUDA
    graph is captured, the Engram layers' projections (which read only the step's inputs)
    may be launched first on a side stream (``engram.BESIDE``), each joined at its layer, and
    the candidate pool made beside the layers after its source (``select.POOL_BESIDE``),
    joined where it is first read. ``engram``: the step's hashed ids, then the rows of the
    Engram slots ``host`` (tables in host memory, fetched before the step)."""
    hash_ids, rows = engram[:1], dict(zip(host, engram[1:]))
    shared, taps = {}, []  # what each layer writes for the later ones: the top-k, the candidate pool
    pending = None  # the layer before's FFN output, added by the next attention site's kernel
    with shared_rope_angles():
        share_rope_angles(pos, ropes)  # a step reads both tables
        beside = bool(hash_ids) and kernels.beside_on(streams, "engram.BESIDE")
        engram_kv = {b.layer: kernels.Beside(b.engram.kv, hash_ids[0][:, :, b.engram.slot], rows.get(b.engram.slot),
                                             device=streams.device)
                     for b in blocks if beside and b.engram is not None}  # kept until the step's end
        for b, e in zip(blocks, emits):
            if pending is not None and ((b.engram is not None and hash_ids) or b.layer in tapped):
                streams, pending = expand_output(streams, pending), None
            streams = _engram_site(b, streams, hash_ids[0] if hash_ids else None, image_mask, engram_kv.get(b.layer),
                                   rows)
            if b.layer in tapped:
                taps.append(streams.mean(dim=2))
            streams, pre, pending, *written = _whole_layer(b, streams, pre, pos, shared, ropes=ropes, cache=cache,
                                                           emits=e, image_mask=image_mask, expand=pending)
            shared.update(zip(("topk", "candidates"), written))
    if pending is not None:
        streams = expand_output(streams, pending)
    kernels.mhc_join()  # the last site's split, where it ran beside: pre is an output
    for made in (*engram_kv.values(), shared.get("candidates")):  # a capture ends with its side stream joined
        if isinstance(made, kernels.Beside):
            made.join()
    return (streams, pre, *taps)


def _engram_site(block: Block, streams, hash_ids, image_mask=None, kv=None, rows: dict | None = None):
    """``Block.engram_site``; ``kv``: the layer's Engram rows launched beside (a ``kernels.Beside``);
    ``rows``: ``Step.engram_rows``' form."""
    if kv is None:
        return block.engram_site(streams, hash_ids, image_mask, rows)
    return block.engram.gate(streams, kv.value(), None if image_mask is None else ~image_mask)


def _whole_layer(block: Block, streams, pre, pos, shared: dict, *, ropes: Ropes, cache: Cache, emits: bool,
                 image_mask=None, expand=None):
    """One decode step of the layer: (streams, pre, (y, post, comb), *what later layers
    read). The FFN's output y is NOT yet in the streams: the next layer's attention site
    adds it (its ``expand``), or the caller (``expand_output``); ``expand``: the layer
    before's, likewise. ``shared``: what earlier layers wrote."""
    attn = block.attn
    streams, a_pre, a_post, a_comb, x, norm = _site(block, "attn", streams, pre, expand=expand, overlap=True,
                                                    norm_later=True)
    compressing = []  # the compressor launched beside, as soon as x is made

    def early(x):
        compressing.append(_compress_beside(attn, x, pos=pos, cache=cache, emits=emits, ropes=ropes))

    x, q_res, q, kv = _project(attn, x, pos, ropes, norm=norm, early=early)
    qw = None if attn.indexer is None else _index_query(attn.indexer, x, q_res, pos, ropes.compress, cache.kv)
    turn = kernels.merge_turns_back(q)
    out, written = _attention_step(attn, x, q_res, q, kv, pos, _step_reads(attn, shared), cache, ropes, emits, qw,
                                   compressing[0] if compressing else None, turn_back=turn)
    y = _output(attn, out, pos, ropes, turned=turn)
    streams, f_pre, f_post, f_comb, x, norm = _site(block, "ffn", streams, a_pre, expand=(y, a_post, a_comb),
                                                    overlap=True, norm_later=True)
    return streams, f_pre, (moe_step(block.ffn, x, image_mask, norm=norm), f_post, f_comb), *written


def _site(block: Block, name: str, streams, pre, expand=None, overlap: bool = False, norm_later: bool = False):
    """``kernels.hc_site`` of the attention or FFN site: (streams, pre, post, comb, the site's
    input, the norm it still wants); ``overlap``: its ``overlap`` (the whole-step decode,
    which joins at its end); ``norm_later``: where the kernel left the site's RMSNorm to x's
    reader, the last value is that norm's (weight, eps), else None (x normalised)."""
    norm = block.attn_norm if name == "attn" else block.ffn_norm
    out = kernels.hc_site(streams, pre, getattr(block, f"hc_{name}_fn"), getattr(block, f"hc_{name}_scale"),
                          getattr(block, f"hc_{name}_base"), norm.weight, eps=block.args.rms_norm_eps,
                          norm_eps=norm.eps, iters=block.args.hc_sinkhorn_iters, hc_eps=block.args.hc_eps,
                          expand=expand, overlap=overlap, norm_later=norm_later, name=name)
    later = norm_later and out[5]
    return (*out[:5], (norm.weight, norm.eps) if later else None)


def _project(attn: Attention, x, pos: torch.Tensor, ropes: Ropes, norm=None, early=None):
    """(x normalised, q_res, RoPE'd queries, the K=V latent as it is — :func:`_write_entry`
    turns it into the window entry). ``norm`` = (weight, eps): x is the mHC site's input
    before its RMSNorm, normalised inside the projections' GEMV where it runs (else first; x
    may be a ``kernels.Collapsed``, which the GEMV makes); ``early``: a callable of the
    normalised x, run as soon as the first projection has made it, before the query's."""
    B, S, _ = x.shape
    inv = attn.rope_table(ropes)
    if not kernels.gemv_runs(x, attn.wq_a, attn.wkv):
        x = kernels.resolve(x)
        if norm is not None:
            x = kernels.rms_norm(x, *norm)
        q_res, kv_lat = attn.q_norm(attn.wq_a(x)), attn.wkv(x)
        q = apply_rope(attn.wq_b(q_res).view(B, S, attn.n_heads, attn.head_dim), pos, inv)
        return x, q_res, q, kv_lat
    # both projections of x in one launch (with the site's norm, where it was left to them);
    # the query's norm and RoPE inside its GEMV (which keeps q_res where the indexer reads it)
    if norm is None:
        q_lat, kv_lat = kernels.gemv(x, attn.wq_a.gemv_weight(), attn.wkv.gemv_weight())
    else:
        q_lat, kv_lat, x = kernels.gemv(x, attn.wq_a.gemv_weight(), attn.wkv.gemv_weight(), norm=norm,
                                        keep=True)
    if early is not None:
        early(x)  # may leave a kernels.Beside for _attention_step to join
    angles = rope_angles(pos, inv)
    q, *q_res = kernels.gemv(q_lat, attn.wq_b.gemv_weight(), norm=(attn.q_norm.weight, attn.q_norm.eps),
                             rope_out=(angles.cos, angles.sin, attn.head_dim), keep=attn.indexer is not None)
    return x, q_res[0] if q_res else None, q.view(B, S, attn.n_heads, attn.head_dim), kv_lat


def _index_query(indexer: Indexer, x, q_res, pos: torch.Tensor, inv_freq, kv: KVFormat):
    """``Indexer.query``; on a decode step's few rows the RoPE inside the query's GEMV."""
    if not kernels.gemv_runs(q_res, indexer.wq_b):
        return indexer.query(x, q_res, pos, inv_freq, kv)
    B, S, _ = x.shape
    angles = rope_angles(pos, inv_freq)
    (q,) = kernels.gemv(q_res, indexer.wq_b.gemv_weight(), rope_out=(angles.cos, angles.sin, indexer.head_dim))
    return kv.index_query(q.view(B, S, indexer.n_heads, indexer.head_dim)), indexer.weights_proj(x)


def _output(attn: Attention, out: torch.Tensor, pos: torch.Tensor, ropes: Ropes, turned: bool = False):
    """``Attention.output`` on a decode step's rows: one GEMV de-rotates and projects through
    ``wo_a`` (``turned``: the attention de-rotated already), then ``wo_b``'s."""
    inv = attn.rope_table(ropes)
    rows = out.flatten(2)
    if kernels.gemv_runs(rows, attn.wo_a):
        angles = rope_angles(pos, inv)
        (lat,) = kernels.gemv(rows, attn.wo_a.gemv_weight(), groups=attn.o_groups,
                              rope_in=None if turned else (angles.cos, angles.neg_sin, attn.head_dim))
    else:
        turned_out = out if turned else apply_rope(out, pos, inv, inverse=True)
        lat = grouped_linear(attn.wo_a, turned_out.flatten(2), attn.o_groups)
    if kernels.gemv_runs(lat, attn.wo_b):  # a rank's rows of wo_b: the ranks' partial sums added, as Linear adds them
        return attn.wo_b.world.sum(kernels.gemv(lat, attn.wo_b.gemv_weight())[0])
    return attn.wo_b(lat)


def _step_reads(attn: Attention, shared: dict) -> dict[str, torch.Tensor]:
    """What this layer's decode step reads of the earlier layers' selection (``shared``:
    what they wrote): a layer without an indexer their top-k; one that honours the
    candidate pool that pool."""
    names = (("topk",) if attn.ratio and attn.indexer is None else ()) \
        + (("candidates",) if attn.indexer is not None and attn.args.uses_candidates(attn.layer) else ())
    return {n: shared[n] for n in names if shared.get(n) is not None}


def _before_step(attn: Attention, step: Step, cache: Cache) -> bool:
    """Room in the KV source for this step's record; whether its group completes here."""
    if attn.compressor is None:
        return False
    cache.sources[attn.layer].reserve(step.start)
    return (step.start + 1) % attn.ratio == 0


def _after_step(attn: Attention, step: Step, cache: Cache) -> None:
    """The host's side of :func:`_attention_step`: the source's counts."""
    if attn.compressor is not None:
        cache.sources[attn.layer].stepped(step.start)


def _step_memory(attn: Attention, cache: Cache) -> tuple:
    """Addresses and shapes of the cache buffers :func:`_attention_step` reads or writes."""
    ring = cache.windows[attn.layer]
    buffers = [ring.data, ring.pos]
    if attn.compressor is not None:
        src = cache.sources[attn.layer]
        buffers += [src.hist_kv, src.hist_gate, src.hist_pos]
    if attn.ratio:
        src = cache.sources[attn.args.kv_source(attn.layer)]
        buffers += [src.records, src.index]
    return tuple((t.data_ptr(), tuple(t.shape)) for t in buffers)


def _attention_step(attn: Attention, x, q_res, q, kv, pos, reads: dict, cache: Cache, ropes: Ropes, emits: bool,
                    qw=None, compressing=None, turn_back: bool = False):
    """``Attention.core`` of one decode step at ``pos`` [1], graph-safe (nothing here reads a
    count from the host): the window-ring write, the compressor's record when ``emits``, the
    indexer's top-k (and candidate pool) over the whole buffers, the sparse attention. ->
    (output, what later layers read: () or (top-k,) or (top-k, candidate pool)). ``reads``:
    :func:`_step_reads`; ``qw``: the indexer's query; ``compressing``: :func:`_compress_beside`'s
    launch; ``turn_back``: the output de-rotated (``kernels.merge_turns_back``)."""
    ring = cache.windows[attn.layer]
    _write_entry(attn, kv, pos, ring, cache.kv, ropes)
    if compressing is not None:
        compressing.join()  # the source's new record and key, before the indexer reads them
    elif attn.compressor is not None:
        _compress(attn, x, pos, cache.sources[attn.layer], emits, ropes)
    written, topk = (), reads.get("topk")
    if attn.indexer is not None:
        src = cache.sources[attn.args.kv_source(attn.layer)]
        topk, pool = _select_step(attn.indexer, x, q_res, pos, src, ropes.compress, reads.get("candidates"), qw)
        written = (topk, pool) if attn.layer == attn.args.candidate_source_layer_id else (topk,)
    records = None if topk is None else cache.sources[attn.args.kv_source(attn.layer)].records
    turn = None
    if turn_back:
        angles = rope_angles(pos, attn.rope_table(ropes))
        turn = (angles.cos, angles.neg_sin)
    return _fused_attend(attn, q, pos, ring, records, topk, turn), written


def _write_entry(attn: Attention, kv_lat: torch.Tensor, pos: torch.Tensor, ring: WindowRing, fmt: KVFormat,
                 ropes: Ropes) -> None:
    """This step's window entry, from its K=V latent, into the ring: one kernel where it
    runs, else the norm, RoPE and FP8 rounding of ``Attention.window_values`` and the ring's write."""
    inv = attn.rope_table(ropes)
    angles = rope_angles(pos, inv)
    if not kernels.window_entry(kv_lat, attn.kv_norm.weight, attn.kv_norm.eps, angles.cos, angles.sin,
                                ring.data, ring.pos, pos):
        ring.write_step(attn.window_values(kv_lat, pos, inv, fmt), pos)


def _fused_attend(attn: Attention, q: torch.Tensor, pos: torch.Tensor, ring: WindowRing,
                  records: torch.Tensor | None, idx: torch.Tensor | None, turn_back=None) -> torch.Tensor:
    """``Attention.attend`` of one decode step at position ``pos`` [1] (a tensor, so a graph
    can hold it), by the fused kernel on the packed ring (already holding this step's entry)
    and the packed records at the indexer's ``idx`` [B, 1, k] (``records``: the source's
    whole buffer, every selected row lies below its count); ``turn_back``: the kernel's."""
    B = q.shape[0]
    if idx is None:
        records = ring.data.new_empty(B, 0, main_record_bytes(attn.head_dim))
        idx = torch.empty(B, 1, 0, dtype=torch.long, device=q.device)
    out = kernels.sparse_attention(q[:, 0], ring.data, None, records, idx[:, 0], attn.attn_sink,
                                   attn.head_dim ** -0.5, out_dtype=q.dtype,
                                   window_at=(ring.pos, pos, attn.args.sliding_window), turn_back=turn_back)
    return out[:, None]


# ----------------------------------------------------------------------------- the KV source's step

def _compress(attn: Attention, x, pos: torch.Tensor, src: SourceKV, emits: bool, ropes: Ropes) -> None:
    """The compressor's part of :func:`_attention_step`: this step's latent into the source's
    pending group, and the group's record and index key where it completes (``emits``)."""
    if _compress_kernels(attn, x, pos, src, emits, ropes):
        return
    made = compressor_step(attn.compressor, x, pos, src, emits)
    if made is not None:
        latent, first = made
        src.write_at(first // attn.ratio, src.kv.pack_main(apply_rope(latent, first, ropes.compress)),
                     attn.indexer.keys(latent, first, ropes.compress, src.kv))


def _compress_beside(attn: Attention, x, *, pos: torch.Tensor, cache: Cache, emits: bool, ropes: Ropes):
    """As soon as the site's input x is made: where ``pack.COMPRESS_BESIDE`` (a graph's
    capture) and the compressor pools groups of a bf16 x (ratio > 1: its launches start
    with torch's cast of x, not a dependent launch, the side stream's first),
    :func:`_compress` launched on a side stream beside the query's projections and the
    window entry -> that ``kernels.Beside`` (joined before the indexer); else None."""
    if attn.compressor is not None and attn.ratio > 1 and x.dtype != torch.float32 \
            and kernels.beside_on(x, "pack.COMPRESS_BESIDE"):
        return kernels.Beside(_compress, attn, x, pos, cache.sources[attn.layer], emits, ropes, device=x.device)
    return None


def _compress_kernels(attn: Attention, x, pos: torch.Tensor, src: SourceKV, emits: bool, ropes: Ropes) -> bool:
    """The compressor's part of :func:`_attention_step` in four launches (``kernels.compress_step``):
    what :func:`compressor_step` and the record's and index key's packs do. False where
    those kernels do not run; the caller then runs them."""
    comp, index = attn.compressor, attn.indexer
    weights = (comp.wkv.weight,) if comp.wgate is None else compressor_weights(comp)
    return kernels.compress_step(x, weights, (comp.norm.weight, comp.norm.eps),
                                 (src.hist_kv, src.hist_gate, src.hist_pos), src.records, src.index,
                                 index.wk.weight, (index.k_norm.weight, index.k_norm.eps), ropes.compress, pos,
                                 comp.ratio, emits)


def compressor_weights(comp: Compressor) -> tuple[torch.Tensor, torch.Tensor]:
    """``wkv`` and ``wgate`` in fp32 for :func:`compressor_step`: cast once, not every step
    (the casts took ~50 us of a `small` step on the H200), again when either weight changes
    (in place or moved); the same values ``Compressor.forward`` multiplies by (fp32 weights
    themselves: a detached copy could take another matmul path, not bit-equal)."""
    w = (comp.wkv.weight, comp.wgate.weight)
    if all(t.dtype == torch.float32 for t in w):
        return w
    key = tuple((t._version, t.data_ptr(), t.dtype, t.device) for t in w)
    if comp.__dict__.get("_fp32_key") != key:
        comp.__dict__["_fp32"] = tuple(t.detach().float() for t in w)
        comp.__dict__["_fp32_key"] = key
    return comp.__dict__["_fp32"]


def compressor_step(comp: Compressor, x: torch.Tensor, pos: torch.Tensor, src: SourceKV,
                    emits: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``Compressor.forward`` of one decode step at ``pos`` [1] (a tensor: graph-safe), on
    the source's fixed buffers: the token's projection goes to the history ring, and when
    ``emits`` (its group completes here) the group is pooled from there. -> (latent
    [B, 1, D], the group's first position [1]) or None."""
    if comp.wgate is None:
        return comp.norm(torch.nn.functional.linear(x, comp.wkv.weight)), pos  # cuBLAS, as the prefill's rows
    h = x.float()
    src.remember_at(*(torch.nn.functional.linear(h, w) for w in compressor_weights(comp)), pos)
    if not emits:
        return None
    first = pos - (comp.ratio - 1)
    kv, gate = (t.unsqueeze(1) for t in src.recall(first + torch.arange(comp.ratio, device=pos.device)))
    return comp.pool(kv, gate, x.dtype), first


def _select_step(indexer: Indexer, x, q_res, pos: torch.Tensor, src: SourceKV, inv_freq, candidates=None, qw=None):
    """``Indexer.forward`` of one decode step at ``pos`` [1] (a tensor: graph-safe), by the
    fused kernel over the source's whole index buffer, the records not yet visible masked
    by ``pos``. -> (indices [B, 1, index_topk], -1 = none; the candidate pool when this
    layer makes it (``candidate_rows``: its records), else ``candidates``, whose records
    alone a layer that honours it scores — what ``Indexer.select``'s mask picks)."""
    q, w = qw or indexer.query(x, q_res, pos, inv_freq, src.kv)
    args = indexer.args
    ratio = args.ratios[indexer.layer]
    if isinstance(candidates, kernels.Beside):  # made beside the layers since the candidate source
        candidates = candidates.value()
    pool = candidates if args.uses_candidates(indexer.layer) else None  # scored alone, then mapped back
    # q holds FP4 values, exact in its own dtype: a bf16 query is one bf16 operand to the kernel's dots;
    # the records seen and the weights' scale are the kernel's to apply (two launches fewer each)
    s = kernels.indexer_scores(q[:, 0], w[:, 0], src.index, (pos, ratio), indexer.head_dim ** -0.5,
                               None if pool is None else pool[:, 0], weight_scale=indexer.n_heads ** -0.5)[:, None]
    if indexer.layer == args.candidate_source_layer_id:
        pool_of = partial(_candidate_rows_at, ratio=ratio, topk_blocks=args.candidate_topk_blocks,
                          block=args.candidate_block_size)
        # read first by a later layer: where select.POOL_BESIDE, made on a side stream beside
        # this layer's own top-k and the layers between (a kernels.Beside, joined there)
        if kernels.beside_on(s, "select.POOL_BESIDE"):
            candidates = kernels.Beside(pool_of, s, pos, device=s.device)
        else:
            candidates = pool_of(s, pos)
    # top_records' choice, in record order, -1 after (a buffer of fewer records than top-k too)
    k = args.index_topk
    indices = kernels.topk_rows(s[:, 0], k, None if pool is None else pool[:, 0], width=k)[:, None]
    return indices, candidates


def _candidate_rows_at(scores: torch.Tensor, pos: torch.Tensor, *, ratio: int, topk_blocks: int,
                       block: int) -> torch.Tensor:
    """``candidate_rows`` for a decode step's query at ``pos`` of a source of ``ratio``."""
    return candidate_rows(scores, (pos + 1) // ratio, topk_blocks, block)


# ----------------------------------------------------------------------------- the MoE's step

def moe_runs_fused(moe: MoE, x: torch.Tensor) -> bool:
    """Whether text tokens ``x`` [N, D] run through ``kernels.moe_decode``: stacked,
    unparametrized weights (floats, or FP4 as stored with a shared expert the kernels decode)
    and ``kernels.moe_decode_runs``. Over several ranks the kernels compute this rank's part
    (its range of the experts, its share of the shared expert), summed as ``MoE`` sums it."""
    return (moe.grouped.w1.weight is not None and not moe.parametrized()
            and _shared_decodable(moe) and kernels.moe_decode_runs(x))


def _shared_decodable(moe: MoE) -> bool:
    """The shared expert as the fused kernels read it: floats beside float experts; beside FP4
    ones floats or packed weights of power-of-two scale blocks (``kernels.Packed.decodable``)."""
    weights = [getattr(moe.shared_experts, n).gemv_weight() for n in ("w1", "w3", "w2")]
    if moe.grouped.fmt == "plain":
        return all(isinstance(w, torch.Tensor) for w in weights)
    return all(isinstance(w, torch.Tensor) or w.decodable() for w in weights)


def moe_step(moe: MoE, x, image_mask=None, norm=None):
    """``MoE.forward`` of a decode step. ``norm`` = (weight, eps): x is an mHC site's input
    before its RMSNorm (maybe a ``kernels.Collapsed``, which the gate launch then makes),
    normalised here, by the fused kernels' gate launch where they run."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    if image_mask is None and moe_runs_fused(moe, flat):
        y = _moe_fused(moe, flat, norm)  # four kernels (model.kernels.moe)
        if y is not None:
            return y.to(x.dtype).view(shape)
    return _moe_torch(moe, flat, image_mask, norm).view(shape)


def _moe_torch(moe: MoE, flat, image_mask, norm) -> torch.Tensor:
    flat = kernels.resolve(flat)  # a kernels.Collapsed made
    if norm is not None:
        flat = kernels.rms_norm(flat, *norm)
    return moe.routed_and_shared(flat, image_mask)


def _moe_fused(moe: MoE, flat: torch.Tensor, norm=None):
    """``kernels.moe_decode`` (routed sum + shared, in the tokens' dtype, rounded from fp32 by
    the kernel; over several ranks this rank's fp32 part, summed over them, then rounded, as
    ``MoE.routed_and_shared`` does), or None if its kernels cannot be built here."""
    g, a, shared, world = moe.gate, moe.gate.args, moe.shared_experts, moe.world
    routed = (moe.grouped.w1, moe.grouped.w3, moe.grouped.w2)
    scales = None if moe.grouped.fmt == "plain" else tuple(r.scale for r in routed)  # FP4: bytes and scales
    y = kernels.moe_decode(flat, g.weight, g.bias, *(r.weight for r in routed),
                           shared.w1.gemv_weight(), shared.w3.gemv_weight(), shared.w2.gemv_weight(),
                           top_k=g.top_k, scoring=a.scoring_func, temp=a.gate_temp, norm=a.norm_topk_prob,
                           scale=a.routed_scaling_factor, limit=shared.limit,
                           out_dtype=torch.float32 if world.joined else flat.dtype,
                           x_norm=norm, scales=scales, first=moe.grouped.first)
    return y if y is None or not world.joined else world.sum(y).to(flat.dtype)


# ----------------------------------------------------------------------------- segmented graphs

def _segmented_layer(block: Block, streams, pre, step: Step, cache: Cache, ropes: Ropes):
    """``Block.forward`` of a CUDA decode step without the fused kernels: two graphs replay
    around the eager cache work."""
    streams = block.engram_site(streams, step.hash_ids, step.image_mask, step.engram_rows)
    taps = step.shared.get("taps")
    if isinstance(taps, dict) and block.layer in block.args.dspark_target_layer_ids:
        taps[block.layer] = streams.mean(dim=2)
    pos = step.positions(streams.device)
    a_pre, a_post, a_comb, x, q_res, q, kv, *index_query = step.graphs.run(
        (block.layer, "attn"), partial(_attn_segment, block, ropes=ropes, fmt=cache.kv), streams, pre, pos)
    out = block.attn.core(x, q_res, q, kv, pos, step, cache, ropes, tuple(index_query) or None)
    return step.graphs.run((block.layer, "ffn"), partial(_ffn_segment, block, ropes=ropes),
                           out, pos, streams, a_pre, a_post, a_comb)


def _attn_segment(block: Block, streams, pre, pos, *, ropes: Ropes, fmt: KVFormat):
    """The attention site, the projections and (a layer with an indexer) the index query,
    with their own RoPE-angle scope: (pre, post, comb, x, q_res, q, kv, *index query)."""
    with shared_rope_angles():
        a_pre, a_post, a_comb, x = block.attn_site(streams, pre)
        q_res, q, kv = block.attn.project(x, pos, ropes, fmt)
        index = () if block.attn.indexer is None else block.attn.indexer.query(x, q_res, pos, ropes.compress, fmt)
        return (a_pre, a_post, a_comb, x, q_res, q, kv, *index)


def _ffn_segment(block: Block, out, pos, streams, a_pre, a_post, a_comb, *, ropes: Ropes, image_mask=None):
    """The attention's output projection, then the FFN site."""
    return block.ffn_site(block.attn.output(out, pos, ropes), streams, a_pre, a_post, a_comb, image_mask)
