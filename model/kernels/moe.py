"""Triton MoE for decode steps: the router and every chosen expert of a few tokens in four
launches, where torch runs ~55 small kernels a layer (gate chain, sort by expert, gathers,
grouped GEMMs, SwiGLU, scatter back, sum, shared expert).

Owns ``moe_decode`` (what ``model.moe.MoE.forward`` computes for text tokens):
- ``_gate_logits_kernel`` (the gate's logits over every expert, fp32 from the stored
  weights, in partial sums over channel chunks: one program reading the whole weight took
  53 us a layer on the H200) and ``_gate_kernel``, one program per token: the partial sums
  added in chunk order, the score function, top-k on score + bias (ties to the lower expert id),
  the chosen scores normalised and scaled (``route`` launches the two: at 384 experts the logits
  split over blocks of experts as well as channel chunks, ``GATE_ROWS``);
- ``_up_kernel``, one program per (token, slot) pair and block of intermediate channels,
  the shared expert as one more slot of weight 1: ``w1`` and ``w3`` rows against the token,
  rounded to the activation dtype as the GEMM's output is, the SwiGLU with the training
  clamps, times the gate weight, rounded again as ``MoE`` rounds before ``w2`` (inputs wider
  than one tile take the channel loop, ``_up_sums``, a routed and a shared form);
- ``_down_kernel``, one program per token and block of output channels: each slot's ``w2``
  product rounded to the activation dtype, summed in slot order in fp32, then the shared
  expert's added (``MoE``'s order), so a step is deterministic; ``_down_slots_kernel`` (with
  ``DOWN_SLOTS``, the default since timed) the same sum with every slot's rows loaded in one tile
  (launched by ``down_slots``, which the tests call on their own rows).

From ``GROUPED_TOKENS`` tokens (a batched decode step) the experts run grouped instead: at
batch 16 and top-6 of 64, the 96 pairs share ~51 experts, and a kernel by pair reads each
shared expert's weights once per pair. ``_up_grouped_kernel`` / ``_down_grouped_kernel`` run
one program per expert (and block of rows) over the tokens that picked it, the tokens' block
in one tensor-core product, and write each pair's rows; ``_sum_slots_kernel`` sums a token's
slots in the same order as ``_down_kernel``. Five launches instead of four.

FP4 routed experts (a packed model's, stacked as stored) and its FP8 shared expert are read as
bytes and scales (``moe_decode``'s ``scales``). By pair they take the row kernels
(``fp4_rows``: ``_up_rows_kernel``, ``_down_rows_kernel`` writing each pair's product to its own
row, ``_sum_slots_kernel``): each thread's 16 bytes of a row one load, decoded and summed in
registers, scaled once a 32-input block. Grouped, each tile is decoded to the one the plain
kernels load (``_expert_tile``; ``_weight_at`` for the FP8) and computed alike.

One rank of an expert-parallel MoE (``moe_decode``'s ``first``) holds a range of the experts
and a share of the shared expert's intermediate channels (SI of I): the gate still routes over
every expert and writes each choice as its place in the rank's stack, -1 for another rank's,
which the expert kernels read no weight for and count zero; the output is the rank's part.

Not bit-exact with torch: dot products reduce in another order (and torch's top-k breaks
exact ties its own way), so outputs agree to rounding and the choice of experts only differs
on near-ties. Weight reads are the GEMVs' whole cost at decode sizes; each program streams
its rows once. Does not own: when it runs (``model.moe.MoE``, ``model.kernels``).
Imported only when Triton is importable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.kernels.fused import _chain, _e2m1, _rms_apply, _rms_factor, _round, _store, _ue8m0, chained, unfused
from model.kernels.collapsed import Collapsed
from model.kernels.packed import Packed
from model.kernels.streams import _collapsed

SCORING = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}
GATE_SPLITS = 32  # programs per token that share the gate's weight read
# a gate-logits program's experts (a power of two; the rows of ``E`` past it go to further
# programs) and its most channels a load: at V4.1-Flash's 384 experts x 5,120 channels, 32 programs
# of every row each (512, 128) left 100 of the H200's 132 SMs idle. The gate's two launches timed alone
# there (2026-12-06, H200, kernel_sweep.py --preset v41-flash --only gate, 48 settings): 12.1 us
# with (512, 128), 7.0 with these (16 rows 7.4; 64 splits the same; the top-k on one warp slower)
GATE_ROWS, GATE_BLOCK_D = 32, 256
# warps of the top-k program (a token's): each of its k picks is three reductions over the experts,
# across the warps (shared memory and a barrier each) where there are several
GATE_TOPK_WARPS = 4
# each gate-logits program (one chunk of channels) asks for its weight before its dependent
# launch's wait. Timed on the H200 (2026-12-03, 0813500, `small`, batch 1, 128K, bench_knobs, best of two
# alternated rounds): a step 3.716 -> 3.624 ms
GATE_EARLY = True
# tile sizes of the expert kernels: rows of w1 / w3 per up program and channels per load;
# output channels per down program and intermediate channels per load; warps of each.
# Chosen by scripts/kernel_sweep.py on the H200 at `small`, batch 1: a whole moe_decode took
# 60 us with (16, 256, 4) / (8, 256, 4), 44 us with these up tiles, 54 us with these down tiles
UP_BLOCK_I, UP_BLOCK_D, UP_WARPS = 4, 256, 4
# the up kernel's rows whole, one load each (UP_EARLY_BLOCK_I rows a program: 2 x 2 x 2,048 bf16,
# 16 KB at `small`, the GEMV's tile), the shared expert's asked for before the wait, where the
# loop above has one 256-channel chunk in flight. Timed as GATE_EARLY: a step 3.716 -> 3.545 ms
# alone, 3.569 -> 3.383 with GATE_EARLY and streams.NORM_LATER on; a whole moe_decode 27.7 -> 25.9 us
# (kernel_sweep.py --only up: 1 row 26.1, 4 rows 27.0, 8 warps 26.7-28.2)
UP_EARLY, UP_EARLY_BLOCK_I = True, 2
# the most bytes of w1 and w3 an early up program holds: wider inputs take fewer rows (``up_tile``),
# and past one row's worth (`v41-flash`'s 5,120 channels pad to 8,192: 32 KB a row) the loop
UP_EARLY_TILE_BYTES = 16384
DOWN_BLOCK_O, DOWN_BLOCK_I, DOWN_WARPS = 4, 512, 8
# the down sum with every slot's rows loaded together (``_down_slots_kernel``) rather than slot by
# slot (``_down_kernel``, which read its 22 MB at ~1.4 TB/s at `small`, batch 1, where the up kernel
# read its 44 MB at ~3.2 TB/s). Timed on the H200 (2026-12-02, 89beacf, `small`, bf16, batch 1, experts
# cycled from HBM): a whole moe_decode 37.1 -> 32.8 us (kernel_sweep.py --only down), a decode step
# at 4K context 5.93 -> 5.76 ms (three alternated pairs, 5.98/5.91/5.91 against 5.80/5.75/5.74);
# tiles within ~1.5 us of the sweep's best (8, 256, 8), inside its noise
DOWN_SLOTS = True
SLOTS_BLOCK_O, SLOTS_BLOCK_I, SLOTS_WARPS = 4, 256, 8
# (FP4 routed experts took tiles of their own in these kernels until the row kernels below replaced
# them: 16 x 256 x 8 warps at `small`'s width, the slot-by-slot down sum past 1,024 intermediate
# channels, each step's bytes loaded during the step before; docs/benchmarks.md has their figures)
# the down sum's experts' ids and whole weight tile asked for before its dependent launch's wait,
# as the GEMV (0b5cbd1) asks for its weights. Off: slower on the H200 (2026-12-03, 0813500, timed as
# GATE_EARLY: 3.716 -> 3.785 ms alone, 3.569 -> 3.651 beside the other two) — its programs, launched
# while the up kernel still streams, hold their tiles and take the SMs the up kernel's programs
# wait for. Kept as a knob: without the channel loop it is the form Triton's interpreter runs
DOWN_EARLY = False
# (2026-12-04, 55ed118: the down sum left for the next attention site to fold its dots launch into: a step
# 4-5% slower with it, and its code is gone (``streams``'s note says why). Its programs are still launched
# without FMA contraction (``unfused``), the bits the step had on the H200 when last checked there)
# Tried on 2026-12-03 (59331ce; a step at 128K, bench_knobs, two alternated rounds each): one output channel a
# down program with every slot's whole row of I in one load (80 registers where this tile took 178 —
# builds without the GPU's 16-byte specialisation; 40 as the GPU builds it, 88b7232)
# +3.6%; the gate's top-k made by the last gate-logits program of each token (an arrival count),
# one launch a layer fewer, +0.2% / -1.6% / +0.7% in three runs: no gain. Neither kept
# FP4 routed experts by pair take the row kernels (``_up_rows_kernel``, ``_down_rows_kernel``, then
# ``_sum_slots_kernel``): each thread's 16 bytes of a row (32 inputs, one scale; the shared expert's
# FP8 likewise, 16 inputs) one load, their products summed in the thread and scaled once, the row's
# sum across threads once after the loop. The tiles the plain kernels load, decoded (the form
# before), were bound by their instructions at V4.1-Flash's width: under the profiler the up kernel
# read at 0.83 TB/s and the down sum at 0.47 (SM busy 66%, 82% of their loads served by L1: each
# byte's scale and the row of inputs gathered per element, the sums reduced across threads every
# step). One H100, 2026-12-07, batch 1, 6 of 32 experts cycled from HBM, a whole moe_decode: 229 us
# -> 110 at `v41-flash`'s width, 46 -> 26 at `small`'s; a full-width decode step at 32K (`v41-flash
# --layers 8`, packed, bench_knobs, three rounds) 4.735 -> 4.000 ms with the shared expert still in
# the old loops (control 0.999), 3.80 ms with it in rows. The tiles: rows of w1 (and of w3) a
# program, bytes of a row a step, warps; the same for w2. The whole MoE over a sweep of 27 up and
# 36 down tiles (same machine and inputs): up best as it is (109.3 us; the next 114.1 at 2 x 512 x
# 1), down 102.5 us at these against 108.9 at (16, 128, 4). The inputs loaded in the weight tile's
# shape (``_fp4_rows_dot``): the whole MoE 106.9 -> 105.1-105.7 us (one H100, 2026-12-07, the two
# forms alternated twice, kernel_sweep.py at that width)
ROWS_UP_I, ROWS_UP_B, ROWS_UP_WARPS = 4, 512, 2
ROWS_DOWN_O, ROWS_DOWN_B, ROWS_DOWN_WARPS = 8, 256, 2
# the grouped form (``GROUPED_TOKENS`` tokens or more, where tokens share experts): one program
# per expert and block of rows, the tokens' block through tensor cores; untuned guesses
GROUPED_TOKENS = 4
G_UP_BLOCK_I, G_UP_BLOCK_D, G_UP_WARPS = 32, 128, 4
G_DOWN_BLOCK_O, G_DOWN_BLOCK_I, G_DOWN_WARPS = 32, 128, 4
SUM_BLOCK = 512


@triton.jit
def _from_bits(bits):
    """int16 bf16 bits -> their value in fp32 (exact)."""
    return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _held_expert(isel_ptr, p, ok):
    """Slot p's expert as its place in this rank's stack (0 for another rank's, id -1, whose
    weight is never read) and ``ok`` where this rank holds it, all False where not (a block &
    a scalar is a mask Triton's interpreter refuses)."""
    e = tl.load(isel_ptr + p)
    return tl.maximum(e, 0), tl.where(e >= 0, ok, False)


@triton.jit
def _swiglu(acc1, acc3, limit, BF16: tl.constexpr, CLAMP: tl.constexpr):
    """The SwiGLU of the w1 / w3 products, each first rounded to the activation dtype as the
    GEMMs' outputs are, with the training clamps."""
    g, u = _round(acc1, BF16), _round(acc3, BF16)
    if CLAMP:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _weight_at(w_ptr, sc_ptr, row, col, mask, IN, FMT: tl.constexpr, SR: tl.constexpr, SC: tl.constexpr):
    """Elements (``row``, ``col``) of a weight of IN inputs a row as fp32 (0 where masked), for
    indices of any shape (the kernels' tiles: rows x inputs, their transpose): FMT "plain" floats
    [rows, IN]; "fp8" e4m3 bytes [rows, IN] times one ue8m0 byte per SR x SC block — the values
    ``model.checkpoint`` dequantises, exact in fp32 (and in bf16: e4m3 times 2^k)."""
    if FMT == "plain":
        w = tl.load(w_ptr + row * IN + col, mask=mask, other=0.0).to(tl.float32)
    else:
        q = tl.load(w_ptr + row * IN + col, mask=mask, other=0)
        sb = tl.load(sc_ptr + (row // SR) * tl.cdiv(IN, SC) + col // SC, mask=mask, other=0)
        w = q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * _ue8m0(sb.to(tl.int32))
    return w


@triton.jit
def _fp4_tile(w_ptr, sc_ptr, row, row_ok, c0, IN, BLOCK: tl.constexpr):
    """Inputs [c0, c0 + BLOCK) of FP4 rows as fp32 (0 outside): ``row`` / ``row_ok`` of any
    shape [..., 1] (rows x 1, slots x rows x 1), the tile [..., BLOCK]; the weight e2m1 pairs
    [rows, IN / 2] (the even input in the low nibble) times one ue8m0 byte per 1 x 32, a
    stack's expert e at rows e * O + o, c0 even. Each row's BLOCK / 2 bytes are one contiguous
    load, both nibbles decoded and interleaved (``matvec._packed_tile``'s wide form), where each
    input loading its own byte took a load an input (on the H200, 2026-12-05: `small`'s down sum
    2.21 -> 1.89 ms a step, the up kernel 1.07 -> 1.02). The values ``model.checkpoint``
    dequantises, exact in fp32 (and in bf16: e2m1 times 2^k)."""
    low, high = _fp4_pairs(w_ptr, sc_ptr, row, row_ok, c0 // 2 + tl.arange(0, BLOCK // 2), IN)
    return tl.interleave(low, high)


@triton.jit
def _fp4_pairs(w_ptr, sc_ptr, row, row_ok, j, IN):
    """Bytes ``j`` of FP4 rows ``row`` (broadcast together, as are ``row_ok``) decoded: the
    even inputs' values and the odd ones' (low and high nibbles), each times its 1 x 32 scale."""
    ok = row_ok & (j < IN // 2)
    code = tl.load(w_ptr + row * (IN // 2) + j, mask=ok, other=0).to(tl.int32)
    s = _ue8m0(tl.load(sc_ptr + row * tl.cdiv(IN, 32) + j // 16, mask=ok, other=0).to(tl.int32))
    return _e2m1(code & 0xF) * s, _e2m1(code >> 4) * s


@triton.jit
def _fp4_tile_t(w_ptr, sc_ptr, row, row_ok, c0, IN, BLOCK: tl.constexpr):
    """``_fp4_tile``'s transpose, inputs [c0, c0 + BLOCK) down x rows across [BLOCK, R] for
    ``row`` / ``row_ok`` [1, R]: each row's bytes still one contiguous load (down the tile),
    both nibbles of a byte decoded and put in adjacent rows of the tile."""
    low, high = _fp4_pairs(w_ptr, sc_ptr, row, row_ok, c0 // 2 + tl.arange(0, BLOCK // 2)[:, None], IN)
    return tl.reshape(tl.permute(tl.join(low, high), (0, 2, 1)), [BLOCK, row.shape[1]])


@triton.jit
def _expert_tile(routed, w_ptr, w_sc, s_ptr, s_sc, e, O, r, r_ok, c0, IN, BLOCK: tl.constexpr, S_FMT: tl.constexpr,
                 SR: tl.constexpr, SC: tl.constexpr, S_IN=None):
    """Inputs [c0, c0 + BLOCK) x rows ``r`` as fp32 [BLOCK, len(r)] (0 outside): the transpose of
    routed expert e's FP4 weight [O, IN] in its stack or, where not ``routed``, of the shared
    expert's (S_FMT, SR x SC scales; S_IN inputs a row where given, else IN)."""
    if S_IN is None:
        S_IN = IN
    c = c0 + tl.arange(0, BLOCK)
    if routed:
        w = _fp4_tile_t(w_ptr, w_sc, e.to(tl.int64) * O + r[None, :], r_ok[None, :], c0, IN, BLOCK)
    else:
        w = _weight_at(s_ptr, s_sc, r[None, :], c[:, None], r_ok[None, :] & (c < S_IN)[:, None], S_IN, S_FMT, SR, SC)
    return w


@triton.jit
def _gate_logits_kernel(x_ptr, w_ptr, part_ptr, E, D, CHUNK, SPLITS, nw_ptr, eps, xn_ptr,
                        BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, EARLY: tl.constexpr = False,
                        NORM: tl.constexpr = False, BLOCK_X: tl.constexpr = 1, BF16: tl.constexpr = False,
                        cs_ptr=None, cpre_ptr=None, cy_ptr=None, cpost_ptr=None, ccomb_ptr=None,
                        COLLAPSE_IN: tl.constexpr = False, C_EXPAND: tl.constexpr = False, C_HC: tl.constexpr = 1,
                        PDL: tl.constexpr = False):
    """Partial gate logits of token t over channel chunk c and the BLOCK_E experts of block b:
    part[t, c, b * BLOCK_E:][:BLOCK_E] (the gate's weight is read by many programs at once
    rather than by one). EARLY (CHUNK == BLOCK_D, one
    load a program): the weight's chunk asked for before the dependent launch's wait. NORM
    (BLOCK_X >= D): x is an mHC site's input before its RMSNorm by ``nw``: every program takes
    the row's factor from the whole row and normalises its chunk with it; program 0 writes the
    normalised row to ``xn`` (the same bits: ``fused._rms_apply``) for the expert kernels.
    COLLAPSE_IN (with NORM; ``model.kernels.Collapsed``): x not in memory, each program makes
    the rows it reads from the site's streams (``streams._collapsed``, as the GEMV does)."""
    t, c, b = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    e = b * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < E
    if EARLY:
        d = c * BLOCK_D + tl.arange(0, BLOCK_D)
        w = tl.load(w_ptr + e[:, None] * D + d[None, :], mask=e_ok[:, None] & (d < D)[None, :], other=0.0)
    _chain(PDL)
    factor = 1.0
    if NORM:
        dx = tl.arange(0, BLOCK_X)
        if COLLAPSE_IN:
            row = _collapsed(cs_ptr, cy_ptr, cpost_ptr, ccomb_ptr, cpre_ptr, t, dx, dx < D, D, C_HC, C_EXPAND, BF16)
        else:
            row = tl.load(x_ptr + t * D + dx, mask=dx < D, other=0.0).to(tl.float32)
        factor = _rms_factor(row, D, eps)
        if (c == 0) & (b == 0):
            nw = tl.load(nw_ptr + dx, mask=dx < D, other=0.0).to(tl.float32)
            _store(xn_ptr + t * D + dx, _rms_apply(row, factor, nw, BF16), dx < D, BF16)
    incoming = (cs_ptr, cpre_ptr, cy_ptr, cpost_ptr, ccomb_ptr)
    if EARLY:
        x = _gate_input(x_ptr, nw_ptr, t, d, D, factor, NORM, BF16, *incoming, COLLAPSE_IN, C_EXPAND, C_HC)
        acc = tl.sum(w.to(tl.float32) * x[None, :], 1)
    else:
        acc = tl.zeros([BLOCK_E], dtype=tl.float32)
        for d0 in range(c * CHUNK, c * CHUNK + CHUNK, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            x = _gate_input(x_ptr, nw_ptr, t, d, D, factor, NORM, BF16, *incoming, COLLAPSE_IN, C_EXPAND, C_HC)
            w = tl.load(w_ptr + e[:, None] * D + d[None, :], mask=e_ok[:, None] & (d < D)[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * x[None, :], 1)
    tl.store(part_ptr + (t * SPLITS + c) * E + e, acc, mask=e_ok)


@triton.jit
def _gate_input(x_ptr, nw_ptr, t, d, D, factor, NORM: tl.constexpr, BF16: tl.constexpr, cs_ptr, cpre_ptr, cy_ptr,
                cpost_ptr, ccomb_ptr, COLLAPSE_IN: tl.constexpr, C_EXPAND: tl.constexpr, C_HC: tl.constexpr):
    """Channels ``d`` of token t's input in fp32 (made from the site's streams with
    COLLAPSE_IN), normalised by the row's ``factor`` with NORM."""
    if COLLAPSE_IN:
        x = _collapsed(cs_ptr, cy_ptr, cpost_ptr, ccomb_ptr, cpre_ptr, t, d, d < D, D, C_HC, C_EXPAND, BF16)
    else:
        x = tl.load(x_ptr + t * D + d, mask=d < D, other=0.0).to(tl.float32)
    if NORM:
        x = _rms_apply(x, factor, tl.load(nw_ptr + d, mask=d < D, other=0.0).to(tl.float32), BF16)
    return x


@triton.jit
def _gate_kernel(part_ptr, bias_ptr, wout_ptr, iout_ptr, E, SPLITS, temp, scale,
                 K: tl.constexpr, K_P2: tl.constexpr, BLOCK_E: tl.constexpr, SPLITS_P2: tl.constexpr,
                 SCORE: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr = False, FIRST=0, EL=0):
    """Token t's top-k over the partial logits: the route weights, and each chosen expert's
    place in this rank's stack of EL experts from global id FIRST on (-1: another rank's)."""
    _chain(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    logit = tl.zeros([BLOCK_E], dtype=tl.float32)
    for c in tl.static_range(SPLITS_P2):  # the chunks' partial sums added in chunk order
        logit += tl.load(part_ptr + (t * SPLITS + c) * E + e, mask=tl.where(c < SPLITS, e_ok, False), other=0.0)
    logit = logit / temp
    if SCORE == 0:  # sqrt(softplus), softplus with torch's threshold of 20
        ex = tl.exp(logit)
        log1p = tl.where(ex < 1e-3, ex * (1.0 - ex * (0.5 - ex / 3.0)), tl.log(1.0 + ex))
        score = tl.sqrt(tl.where(logit > 20.0, logit, log1p))
    elif SCORE == 1:
        score = 1.0 / (1.0 + tl.exp(-logit))
    else:
        z = tl.exp(tl.where(e_ok, logit, float("-inf")) - tl.max(tl.where(e_ok, logit, float("-inf")), 0))
        score = z / tl.sum(z, 0)
    choice = tl.where(e_ok, score + tl.load(bias_ptr + e, mask=e_ok, other=0.0).to(tl.float32), float("-inf"))
    ks = tl.arange(0, K_P2)
    picked_w = tl.zeros([K_P2], dtype=tl.float32)
    picked_i = tl.zeros([K_P2], dtype=tl.int64)
    for j in tl.static_range(K):
        best = tl.max(choice, 0)
        sel = tl.min(tl.where(choice == best, e, BLOCK_E), 0)
        picked_w = tl.where(ks == j, tl.sum(tl.where(e == sel, score, 0.0), 0), picked_w)
        picked_i = tl.where(ks == j, sel.to(tl.int64), picked_i)
        choice = tl.where(e == sel, float("-inf"), choice)
    if NORM:
        picked_w = picked_w / (tl.sum(picked_w, 0) + 1e-20)
    tl.store(wout_ptr + t * K + ks, picked_w * scale, mask=ks < K)
    local = picked_i - FIRST
    tl.store(iout_ptr + t * K + ks, tl.where((local >= 0) & (local < EL), local, -1), mask=ks < K)


@triton.jit
def _up_kernel(x_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, wsel_ptr, isel_ptr, h_ptr, NK, D, I, SI, limit,
               K: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr, BF16: tl.constexpr,
               CLAMP: tl.constexpr, EARLY: tl.constexpr = False, PDL: tl.constexpr = False):
    """Program (p, i-block): w1 / w3 rows of slot p's expert against its token. EARLY
    (BLOCK_D >= D): each weight's rows in one load, the shared expert's (p >= NK) asked for
    before the dependent launch's wait — a routed slot's expert is known only after it.
    A slot of another rank's expert (id -1) reads no weight and writes zeros; the shared
    expert has SI <= I rows here (a rank's share of its channels), the rest of its h row zeros."""
    p = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = i < I
    if EARLY:
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        rows = i[:, None] * D + d[None, :]
        if p < NK:
            _chain(PDL)
            t = p // K
            e, w_ok = _held_expert(isel_ptr, p, i_ok)
            gw = tl.load(wsel_ptr + p)
            m = w_ok[:, None] & d_ok[None, :]
            a = tl.load(w1_ptr + e * I * D + rows, mask=m, other=0.0, eviction_policy="evict_first")
            b = tl.load(w3_ptr + e * I * D + rows, mask=m, other=0.0, eviction_policy="evict_first")
        else:
            t = p - NK
            gw = 1.0
            m = (i < SI)[:, None] & d_ok[None, :]
            a = tl.load(s1_ptr + rows, mask=m, other=0.0, eviction_policy="evict_first")
            b = tl.load(s3_ptr + rows, mask=m, other=0.0, eviction_policy="evict_first")
            _chain(PDL)
        x = tl.load(x_ptr + t * D + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        acc1 = tl.sum(a.to(tl.float32) * x, 1)
        acc3 = tl.sum(b.to(tl.float32) * x, 1)
    else:
        _chain(PDL)
        # the routed and the shared loop apart: the slot's branch taken once, not in every step
        if p < NK:  # a routed slot: expert isel[p] of token p // K
            t = p // K
            e, w_ok = _held_expert(isel_ptr, p, i_ok)
            gw = tl.load(wsel_ptr + p)
            acc1, acc3 = _up_sums(x_ptr, w1_ptr + e * I * D, w3_ptr + e * I * D, t, i, w_ok, D, BLOCK_I, BLOCK_D)
        else:  # the shared expert of token p - NK
            t = p - NK
            gw = 1.0
            acc1, acc3 = _up_sums(x_ptr, s1_ptr, s3_ptr, t, i, i < SI, D, BLOCK_I, BLOCK_D)
    h = _swiglu(acc1, acc3, limit, BF16, CLAMP)
    if p < NK:
        h = gw * h
    _store(h_ptr + p * I + i, h, i_ok, BF16)


@triton.jit
def _up_sums(x_ptr, a_ptr, b_ptr, t, i, w_ok, D, BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr):
    """The up kernel's channel loop: rows ``i`` of two weights [rows, D] (a routed expert's in its
    stacks, or the shared expert's) against token t's channels, -> the two products [BLOCK_I] in fp32."""
    acc1 = tl.zeros([BLOCK_I], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_I], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_ok = d < D
        m = w_ok[:, None] & d_ok[None, :]
        a = tl.load(a_ptr + i[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + i[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
        # the token's channels after the weight's (their loads in flight together) and in the tile's
        # own shape, a row each (the SM's L1 serves the repeats): loaded as a row and broadcast, x
        # went through shared memory every step, four barriers between one step's weight loads and
        # the next's (the sm_90 build's SASS, read on the CPU: 6 BAR.SYNC -> 1, outside the loop)
        x = tl.load(x_ptr + t * D + d[None, :] + 0 * i[:, None], mask=d_ok[None, :] & (i >= 0)[:, None],
                    other=0.0).to(tl.float32)
        acc1 += tl.sum(a * x, 1)
        acc3 += tl.sum(b * x, 1)
    return acc1, acc3


@triton.jit
def _down_kernel(h_ptr, w2_ptr, s2_ptr, isel_ptr, out_ptr, NK, D, I, SI,
                 K: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, BF16: tl.constexpr,
                 OUT_BF16: tl.constexpr, PDL: tl.constexpr = False):
    """Token t's output channels ``o``: each slot's w2 product (a slot of another rank's
    expert, id -1, reads no weight: zero), then the shared expert's [D, SI] part."""
    _chain(PDL)
    t = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    o_ok = o < D
    total = tl.zeros([BLOCK_O], dtype=tl.float32)
    for j in tl.static_range(K + 1):  # the K routed slots in order, then the shared expert
        if j < K:
            p = t * K + j
            e, row_ok = _held_expert(isel_ptr, p, o_ok)
            w_ptr = w2_ptr + e * D * I
            IN = I
        else:
            p = NK + t
            row_ok = o_ok
            w_ptr = s2_ptr
            IN = SI
        acc = tl.zeros([BLOCK_O], dtype=tl.float32)
        for i0 in range(0, I, BLOCK_I):
            i = i0 + tl.arange(0, BLOCK_I)
            i_ok = i < I
            if BF16:
                h = _from_bits(tl.load(h_ptr + p * I + i, mask=i_ok, other=0))
            else:
                h = tl.load(h_ptr + p * I + i, mask=i_ok, other=0.0)
            m = row_ok[:, None] & (i < IN)[None, :]
            w = tl.load(w_ptr + o[:, None] * IN + i[None, :], mask=m, other=0.0)
            acc += tl.sum(w.to(tl.float32) * h[None, :], 1)
        total += _round(acc, BF16)
    _store(out_ptr + t * D + o, total, o_ok, OUT_BF16)  # bf16: rounded as MoE's cast back rounds it


@triton.jit
def _down_slots_kernel(h_ptr, w2_ptr, s2_ptr, isel_ptr, out_ptr, NK, D, I, SI,
                       K: tl.constexpr, S_P2: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr,
                       BF16: tl.constexpr, OUT_BF16: tl.constexpr, EARLY: tl.constexpr = False,
                       PDL: tl.constexpr = False):
    """``_down_kernel``'s sum with every slot's rows in one tile: each step of the channel loop
    loads the K routed slots' and the shared expert's ``BLOCK_O`` rows together (``S_P2`` >= K
    + 1 slots), where ``_down_kernel`` walks the slots one after another, a load in flight at a
    time. Each slot's product is rounded as there and the slots are added in the same order
    (a column holding one slot's value plus zeros is that value exactly).
    EARLY (BLOCK_I >= I): the chosen experts' ids and their whole tile are asked for before
    the dependent launch's wait, as the GEMV asks for its weights. The ids come from the gate
    kernel, two launches back: this kernel is scheduled only once every program of the up
    kernel between has passed its own wait, which returns when the gate has finished and its
    writes are visible; the ids are read past the SM's L1 (``.cg``) all the same.
    A slot of another rank's expert (id -1) reads no weight; the shared expert's w2 is [D, SI]."""
    t = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    o_ok = o < D
    if not EARLY:
        _chain(PDL)
    j = tl.arange(0, S_P2)
    routed, live = j < K, j < K + 1
    pair = tl.where(routed, t * K + j, NK + t)  # the slot's row of h: the shared expert's last
    if EARLY:
        e = tl.load(isel_ptr + t * K + j, mask=routed, other=0, cache_modifier=".cg")
    else:
        e = tl.load(isel_ptr + t * K + j, mask=routed, other=0)
    mine = routed & (e >= 0)  # a routed slot whose expert this rank holds
    rows = tl.where(mine, e * D, 0)[:, None] + o[None, :]  # [S, BLOCK_O]: w2[e] rows (routed slots)
    width = tl.where(routed, I, SI)[:, None, None]  # each slot's weight row: w2's I, the shared expert's SI
    read = (mine | (j == K))[:, None, None] & o_ok[None, :, None]  # whose weight rows are read
    acc = tl.zeros([S_P2, BLOCK_O], dtype=tl.float32)
    if EARLY:
        i = tl.arange(0, BLOCK_I)
        hm = live[:, None] & (i < I)[None, :]
        w = _slots_plain(w2_ptr, s2_ptr, rows, o, i, routed, read, width, I, SI)
        _chain(PDL)
        acc += tl.sum(w.to(tl.float32) * _slot_rows(h_ptr, pair, i, hm, I, BF16)[:, None, :], 2)
    else:
        for i0 in range(0, I, BLOCK_I):
            i = i0 + tl.arange(0, BLOCK_I)
            hm = live[:, None] & (i < I)[None, :]
            w = _slots_plain(w2_ptr, s2_ptr, rows, o, i, routed, read, width, I, SI)
            acc += tl.sum(w.to(tl.float32) * _slot_rows(h_ptr, pair, i, hm, I, BF16)[:, None, :], 2)
    acc = _round(acc, BF16)
    total = tl.zeros([BLOCK_O], dtype=tl.float32)
    for s in tl.static_range(K + 1):  # slot order, the shared expert last, as _down_kernel
        total += tl.sum(tl.where((j == s)[:, None], acc, 0.0), 0)
    _store(out_ptr + t * D + o, total, o_ok, OUT_BF16)


@triton.jit
def _slots_plain(w2_ptr, s2_ptr, rows, o, i, routed, read, width, I, SI):
    """Every slot's float w2 rows for channels ``i`` [S, BLOCK_O, len(i)]: a routed slot's
    ``rows`` of the stack [E, D, I], the shared slot's rows ``o`` of s2 [D, SI]; 0 where not
    ``read`` or past the slot's ``width``."""
    ptr = tl.where(routed[:, None, None], w2_ptr + rows[:, :, None] * I + i[None, None, :],
                   s2_ptr + o[None, :, None] * SI + i[None, None, :])
    return tl.load(ptr, mask=read & (i[None, None, :] < width), other=0.0)


@triton.jit
def _slot_rows(h_ptr, pair, i, hm, I, BF16: tl.constexpr):
    """Channels ``i`` of each slot's row of h [S, len(i)] in fp32 (bf16 stored as its bits)."""
    if BF16:
        h = _from_bits(tl.load(h_ptr + pair[:, None] * I + i[None, :], mask=hm, other=0))
    else:
        h = tl.load(h_ptr + pair[:, None] * I + i[None, :], mask=hm, other=0.0)
    return h


@triton.jit
def _expert_rows(isel_ptr, wsel_ptr, N, NK, K: tl.constexpr, K_P2: tl.constexpr, BLOCK_N: tl.constexpr):
    """The program's expert e (axis 0: the stack's; E = the last, the shared expert; a slot
    whose expert is another rank's, id -1, matches none), which of the N tokens
    it serves (the shared expert: every token), the row of each in the pair buffers (token
    t's slot j: t * K + j; the shared: NK + t), its gate weight, and whether it serves any.
    A token picks an expert at most once, so each token has at most one such row."""
    e = tl.program_id(0)
    E = tl.num_programs(0) - 1
    t = tl.arange(0, BLOCK_N)
    t_ok = t < N
    j = tl.arange(0, K_P2)
    tj = t[:, None] * K + j[None, :]
    tj_ok = t_ok[:, None] & (j < K)[None, :]
    match = (tl.load(isel_ptr + tj, mask=tj_ok, other=-1) == e) & (e < E)
    gw = tl.sum(tl.where(match, tl.load(wsel_ptr + tj, mask=tj_ok, other=0.0), 0.0), 1)
    slot = tl.sum(tl.where(match, j[None, :], 0), 1)
    has = tl.where(e < E, tl.max(match.to(tl.int32), 1) > 0, t_ok)
    row = tl.where(e < E, t * K + slot, NK + t).to(tl.int64)
    return e, E, has, row, tl.where(e < E, gw, 1.0), tl.max(has.to(tl.int32), 0) > 0


@triton.jit
def _up_grouped_kernel(x_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, wsel_ptr, isel_ptr, h_ptr, N, NK, D, I, SI, limit,
                       K: tl.constexpr, K_P2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr,
                       BLOCK_D: tl.constexpr, BF16: tl.constexpr, CLAMP: tl.constexpr, DOT: tl.constexpr,
                       PDL: tl.constexpr = False, w1_sc=None, w3_sc=None, s1_sc=None, s3_sc=None,
                       FMT: tl.constexpr = "plain", S_FMT: tl.constexpr = "plain", SR: tl.constexpr = 1,
                       SC: tl.constexpr = 1):
    """Program (e, i-block): expert e (E: the shared one) against every token that picked it,
    its w1 / w3 rows read once for all of them (one tensor-core product of the tokens' block);
    an expert no token picked reads nothing. The product is fp32 at ``DOT`` precision: TF32
    holds bf16 values exactly, so with bf16 weights and tokens it is exact products summed in
    fp32, as the bf16 GEMM's; fp32 takes "ieee". The shared expert has SI <= I rows (the rest
    of its h rows zeros)."""
    _chain(PDL)
    e, E, has, row, gw, live = _expert_rows(isel_ptr, wsel_ptr, N, NK, K, K_P2, BLOCK_N)
    if live:
        i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        if e < E:
            a_ptr = w1_ptr + e.to(tl.int64) * I * D
            b_ptr = w3_ptr + e.to(tl.int64) * I * D
            i_ok = i < I
        else:
            a_ptr = s1_ptr
            b_ptr = s3_ptr
            i_ok = i < SI
        t = tl.arange(0, BLOCK_N)
        acc1 = tl.zeros([BLOCK_N, BLOCK_I], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_N, BLOCK_I], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            d_ok = d < D
            xs = tl.load(x_ptr + t[:, None] * D + d[None, :], mask=has[:, None] & d_ok[None, :], other=0.0)
            cols = i[None, :] * D + d[:, None]  # [BLOCK_D, BLOCK_I]: the rows' transpose
            m = d_ok[:, None] & i_ok[None, :]
            if FMT == "plain":
                a = tl.load(a_ptr + cols, mask=m, other=0.0)
                b = tl.load(b_ptr + cols, mask=m, other=0.0)
            else:
                a = _expert_tile(e < E, w1_ptr, w1_sc, s1_ptr, s1_sc, e, I, i, i_ok, d0, D, BLOCK_D, S_FMT, SR, SC)
                b = _expert_tile(e < E, w3_ptr, w3_sc, s3_ptr, s3_sc, e, I, i, i_ok, d0, D, BLOCK_D, S_FMT, SR, SC)
            acc1 += tl.dot(xs.to(tl.float32), a.to(tl.float32), input_precision=DOT)
            acc3 += tl.dot(xs.to(tl.float32), b.to(tl.float32), input_precision=DOT)
        h = gw[:, None] * _swiglu(acc1, acc3, limit, BF16, CLAMP)
        _store(h_ptr + row[:, None] * I + i[None, :], h, has[:, None] & (i < I)[None, :], BF16)


@triton.jit
def _down_grouped_kernel(h_ptr, w2_ptr, s2_ptr, wsel_ptr, isel_ptr, part_ptr, N, NK, D, I, SI,
                         K: tl.constexpr, K_P2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_O: tl.constexpr,
                         BLOCK_I: tl.constexpr, BF16: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr = False,
                         w2_sc=None, s2_sc=None, FMT: tl.constexpr = "plain", S_FMT: tl.constexpr = "plain",
                         SR: tl.constexpr = 1, SC: tl.constexpr = 1):
    """Program (e, o-block): expert e's w2 rows read once against the h rows of every token
    that picked it; each pair's product, rounded to the activation dtype, to its own row of
    ``part`` (the slots are summed in order by ``_sum_slots_kernel``). The shared expert's w2
    is [D, SI]."""
    _chain(PDL)
    e, E, has, row, gw, live = _expert_rows(isel_ptr, wsel_ptr, N, NK, K, K_P2, BLOCK_N)
    if live:
        if e < E:
            w_ptr = w2_ptr + e.to(tl.int64) * D * I
            IN = I
        else:
            w_ptr = s2_ptr
            IN = SI
        o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        o_ok = o < D
        acc = tl.zeros([BLOCK_N, BLOCK_O], dtype=tl.float32)
        for i0 in range(0, I, BLOCK_I):
            i = i0 + tl.arange(0, BLOCK_I)
            i_ok = i < I
            hm = has[:, None] & i_ok[None, :]
            cols = o[None, :] * IN + i[:, None]  # [BLOCK_I, BLOCK_O]
            if FMT == "plain":
                w = tl.load(w_ptr + cols, mask=(i < IN)[:, None] & o_ok[None, :], other=0.0).to(tl.float32)
            else:
                w = _expert_tile(e < E, w2_ptr, w2_sc, s2_ptr, s2_sc, e, D, o, o_ok, i0, I, BLOCK_I, S_FMT, SR, SC,
                                 S_IN=SI)
            if BF16:  # h's bits, exactly a bf16 value
                h = _from_bits(tl.load(h_ptr + row[:, None] * I + i[None, :], mask=hm, other=0))
            else:
                h = tl.load(h_ptr + row[:, None] * I + i[None, :], mask=hm, other=0.0)
            acc += tl.dot(h, w, input_precision=DOT)
        tl.store(part_ptr + row[:, None] * D + o[None, :], _round(acc, BF16), mask=has[:, None] & o_ok[None, :])


@triton.jit
def _fp4_rows_dot(w_ptr, sc_ptr, row, row_ok, xw_ptr, xf_ptr, NB, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr,
                  BF16: tl.constexpr):
    """Rows ``row`` [BLOCK_R] of an FP4 weight of NB bytes a row (2 NB inputs, NB a multiple of 16)
    against one row of inputs -> [BLOCK_R] fp32. The bytes in tiles [BLOCK_R, BLOCK_B / 16, 16]:
    each 16 bytes (32 inputs, one ue8m0 scale) one thread's load, their 32 products summed in the
    thread and times their scale once, the row's blocks summed once after the loop. The inputs are
    bf16 pairs read as int32 words at ``xw`` (BF16: the even input in the low half) or fp32 at ``xf``,
    each thread its own rows' inputs (the weight tile's shape: the L1 serves the repeats), not one
    [blocks, 16] row broadcast over the tile's rows, which went through shared memory every step
    (sm_90: 28 barriers in the down kernel, 26 in the up kernel; so 2 and 1, none in a loop).
    Exact products (e2m1 times bf16), summed in fp32 in another order than the plain kernels'."""
    NB = tl.multiple_of(NB, 16)  # so each thread's 16 bytes are one aligned load, and summed in the thread
    blk = tl.arange(0, BLOCK_B // 16)
    q = tl.arange(0, 16)
    acc = tl.zeros([BLOCK_R, BLOCK_B // 16], dtype=tl.float32)
    for b0 in range(0, NB, BLOCK_B):
        j = b0 + blk[:, None] * 16 + q[None, :]  # [blocks, 16] bytes
        j_ok = j < NB
        m = row_ok[:, None, None] & j_ok[None, :, :]
        code = tl.load(w_ptr + row[:, None, None] * NB + j[None, :, :], mask=m, other=0).to(tl.int32)
        b = b0 // 16 + blk
        sb = tl.load(sc_ptr + row[:, None] * (NB // 16) + b[None, :], mask=row_ok[:, None] & (b < NB // 16)[None, :],
                     other=0).to(tl.int32)
        jx = j[None, :, :] + 0 * row[:, None, None]  # the inputs in the weight tile's shape (see below)
        if BF16:
            xw = tl.load(xw_ptr + jx, mask=m, other=0)
            xe = (xw << 16).to(tl.float32, bitcast=True)
            xo = (xw & -65536).to(tl.float32, bitcast=True)
        else:
            xe = tl.load(xf_ptr + 2 * jx, mask=m, other=0.0)
            xo = tl.load(xf_ptr + 2 * jx + 1, mask=m, other=0.0)
        part = tl.sum(_e2m1(code & 0xF) * xe + _e2m1(code >> 4) * xo, 2)
        acc += part * _ue8m0(sb)
    return tl.sum(acc, 1)


@triton.jit
def _shared_rows_dot(w_ptr, sc_ptr, row, row_ok, x_ptr, IN, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr,
                     BF16: tl.constexpr, FMT: tl.constexpr, SR: tl.constexpr, SC: tl.constexpr):
    """:func:`_fp4_rows_dot` for the shared expert's rows ``row`` [BLOCK_R] of IN inputs (a multiple
    of 16): FMT "fp8" e4m3 bytes times one ue8m0 byte per SR x SC block (SC a multiple of 16: each
    thread's 16 bytes one scale) or floats ("plain"); the inputs at ``x`` bf16 bits (BF16) or fp32.
    The routed rows' tiles: each thread's 16 bytes one load, summed in the thread, scaled once."""
    IN = tl.multiple_of(IN, 16)
    blk = tl.arange(0, BLOCK_B // 16)
    q = tl.arange(0, 16)
    acc = tl.zeros([BLOCK_R, BLOCK_B // 16], dtype=tl.float32)
    for c0 in range(0, IN, BLOCK_B):
        c = c0 + blk[:, None] * 16 + q[None, :]  # [blocks, 16] inputs
        c_ok = c < IN
        m = row_ok[:, None, None] & c_ok[None, :, :]
        cx = c[None, :, :] + 0 * row[:, None, None]  # the inputs in the weight tile's shape
        if BF16:
            x = _from_bits(tl.load(x_ptr + cx, mask=m, other=0))
        else:
            x = tl.load(x_ptr + cx, mask=m, other=0.0)
        if FMT == "plain":
            w = tl.load(w_ptr + row[:, None, None] * IN + c[None, :, :], mask=m, other=0.0).to(tl.float32)
            acc += tl.sum(w * x, 2)
        else:
            q8 = tl.load(w_ptr + row[:, None, None] * IN + c[None, :, :], mask=m, other=0)
            w = q8.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            b = c0 + blk * 16
            sb = tl.load(sc_ptr + (row // SR)[:, None] * tl.cdiv(IN, SC) + (b // SC)[None, :],
                         mask=row_ok[:, None] & (b < IN)[None, :], other=0).to(tl.int32)
            acc += tl.sum(w * x, 2) * _ue8m0(sb)
    return tl.sum(acc, 1)


@triton.jit
def _up_rows_kernel(x_ptr, xw_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, wsel_ptr, isel_ptr, h_ptr, NK, D, I, SI, limit,
                    K: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_B: tl.constexpr,
                    BF16: tl.constexpr, CLAMP: tl.constexpr, PDL: tl.constexpr = False, w1_sc=None, w3_sc=None,
                    s1_sc=None, s3_sc=None, FMT: tl.constexpr = "fp4", S_FMT: tl.constexpr = "plain",
                    SR: tl.constexpr = 1, SC: tl.constexpr = 1):
    """``_up_kernel``'s program (p, i-block) on FP4 routed experts: a routed slot's w1 / w3 rows by
    :func:`_fp4_rows_dot` against its token (``xw``: the rows' bf16 pairs as int32 words), the shared
    expert's (p >= NK) by :func:`_shared_rows_dot` (``x``: bf16 bits in BF16); then the same SwiGLU,
    route weight and roundings."""
    _chain(PDL)
    p = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = i < I
    if p < NK:
        t = p // K
        e, w_ok = _held_expert(isel_ptr, p, i_ok)
        gw = tl.load(wsel_ptr + p)
        rows = e.to(tl.int64) * I + i
        acc1 = _fp4_rows_dot(w1_ptr, w1_sc, rows, w_ok, xw_ptr + t * (D // 2), x_ptr + t * D, D // 2, BLOCK_I,
                             BLOCK_B, BF16)
        acc3 = _fp4_rows_dot(w3_ptr, w3_sc, rows, w_ok, xw_ptr + t * (D // 2), x_ptr + t * D, D // 2, BLOCK_I,
                             BLOCK_B, BF16)
    else:
        t = p - NK
        gw = 1.0
        acc1 = _shared_rows_dot(s1_ptr, s1_sc, i, i < SI, x_ptr + t * D, D, BLOCK_I, BLOCK_B, BF16, S_FMT, SR, SC)
        acc3 = _shared_rows_dot(s3_ptr, s3_sc, i, i < SI, x_ptr + t * D, D, BLOCK_I, BLOCK_B, BF16, S_FMT, SR, SC)
    h = _swiglu(acc1, acc3, limit, BF16, CLAMP)
    if p < NK:
        h = gw * h
    _store(h_ptr + p * I + i, h, i_ok, BF16)


@triton.jit
def _down_rows_kernel(h_ptr, hw_ptr, w2_ptr, s2_ptr, isel_ptr, part_ptr, NK, D, I, SI, BLOCK_O: tl.constexpr,
                      BLOCK_B: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr = False,
                      w2_sc=None, s2_sc=None, FMT: tl.constexpr = "fp4", S_FMT: tl.constexpr = "plain",
                      SR: tl.constexpr = 1, SC: tl.constexpr = 1):
    """Program (p, o-block): pair p's w2 product, rounded to the activation dtype, to row p of
    ``part`` (``_down_grouped_kernel``'s rows, for ``_sum_slots_kernel``): a routed slot's FP4 rows
    by :func:`_fp4_rows_dot` against its h row (``hw``: its bf16 pairs as int32 words), nothing for
    another rank's expert (id -1); the shared expert's (p >= NK) [D, SI] by :func:`_shared_rows_dot`."""
    _chain(PDL)
    p = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    o_ok = o < D
    if p < NK:
        e = tl.load(isel_ptr + p)
        if e >= 0:
            acc = _fp4_rows_dot(w2_ptr, w2_sc, e * D + o, o_ok, hw_ptr + p * (I // 2), h_ptr + p * I, I // 2, BLOCK_O,
                                BLOCK_B, BF16)
            tl.store(part_ptr + p * D + o, _round(acc, BF16), mask=o_ok)
    else:
        acc = _shared_rows_dot(s2_ptr, s2_sc, o, o_ok, h_ptr + p * I, SI, BLOCK_O, BLOCK_B, BF16, S_FMT, SR, SC)
        tl.store(part_ptr + p * D + o, _round(acc, BF16), mask=o_ok)


@triton.jit
def _sum_slots_kernel(part_ptr, isel_ptr, out_ptr, NK, D, K: tl.constexpr, BLOCK: tl.constexpr,
                      OUT_BF16: tl.constexpr, PDL: tl.constexpr = False):
    """Token t's output: its K slots' products in slot order (a slot of another rank's
    expert, id -1, none: its row was never written), then the shared expert's, in fp32
    (``_down_kernel``'s order, so both forms sum alike)."""
    _chain(PDL)
    t = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    o_ok = o < D
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):
        mine = tl.load(isel_ptr + t * K + j) >= 0
        total += tl.load(part_ptr + (t * K + j) * D + o, mask=tl.where(mine, o_ok, False), other=0.0)
    total += tl.load(part_ptr + (NK + t) * D + o, mask=o_ok, other=0.0)
    _store(out_ptr + t * D + o, total, o_ok, OUT_BF16)


def up_tile(D: int, elem_bytes: int) -> tuple[bool, int, int]:
    """(early, BLOCK_I, BLOCK_D) of the up kernel for inputs of D channels: with ``UP_EARLY``
    whole rows, ``UP_EARLY_BLOCK_I`` of them or fewer, as many as keep the two weights' tile
    within ``UP_EARLY_TILE_BYTES``; where one row does not fit, or without ``UP_EARLY``, the
    channel loop's tile."""
    width = triton.next_power_of_2(D)
    rows = UP_EARLY_BLOCK_I if UP_EARLY else 0
    while rows and 2 * rows * width * elem_bytes > UP_EARLY_TILE_BYTES:
        rows //= 2
    return (True, rows, width) if rows else (False, UP_BLOCK_I, UP_BLOCK_D)


def down_slots(h: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, chosen: torch.Tensor,
               out: torch.Tensor, shared_inter: int | None = None) -> torch.Tensor:
    """``_down_slots_kernel`` of N tokens into ``out`` [N, D] (fp32 or bf16): the rows of h
    [N * K + N, I] (the pairs' SwiGLU outputs, then each token's shared expert's), the routed
    experts' w2 [E, D, I] picked by ``chosen`` [N, K] (-1: another rank's expert, none), the
    shared expert's s2 [D, SI] (``shared_inter`` SI, default I)."""
    (N, K), D, I = chosen.shape, out.shape[1], h.shape[1]
    SI = I if shared_inter is None else shared_inter
    bf16, out_bf16 = h.dtype == torch.bfloat16, out.dtype == torch.bfloat16
    assert h.shape == (N * K + N, I) and w2.shape[1:] == (D, I) and s2.shape == (D, SI)
    assert out.shape == (N, D) and 0 < SI <= I
    block_i = triton.next_power_of_2(I) if DOWN_EARLY else SLOTS_BLOCK_I
    _down_slots_kernel[(N, triton.cdiv(D, SLOTS_BLOCK_O))](
        h.view(torch.int16) if bf16 else h, w2, s2, chosen, out.view(torch.int16) if out_bf16 else out, N * K, D, I, SI,
        K=K, S_P2=triton.next_power_of_2(K + 1), BLOCK_O=SLOTS_BLOCK_O, BLOCK_I=block_i, BF16=bf16, OUT_BF16=out_bf16,
        EARLY=DOWN_EARLY, num_warps=SLOTS_WARPS, **unfused(), **chained(h))
    return out


def fp4_rows(x, w1, w3, w2, s1, s3, s2, weights, chosen, h, out, limit: float, up: dict, down: dict) -> torch.Tensor:
    """The experts of N tokens by pair on FP4 routed experts (:func:`stored`'s forms): the row
    kernels' up (SwiGLU into h [N * K + N, I]), each pair's down product to its own row, and
    ``_sum_slots_kernel``'s sum in slot order into ``out`` [N, D]."""
    (N, K), D, I = chosen.shape, x.shape[1], h.shape[1]
    SI, nk, bf16 = s1.shape[0], N * K, x.dtype == torch.bfloat16
    assert D % 32 == 0 and I % 32 == 0, f"FP4 rows of {D} and {I} inputs: whole 32-input scale blocks"
    assert SI % 16 == 0 and up.get("SC", 16) % 16 == 0, "the shared expert's rows in whole 16-input chunks of one scale"
    words = (lambda t: t.view(torch.int32)) if bf16 else (lambda t: t)  # bf16 rows read as pairs
    h_arg = h.view(torch.int16) if bf16 else h
    _up_rows_kernel[(nk + N, triton.cdiv(I, ROWS_UP_I))](
        x.view(torch.int16) if bf16 else x, words(x), w1, w3, s1, s3, weights, chosen, h_arg, nk, D, I, SI, limit,
        K=K, BLOCK_I=ROWS_UP_I, BLOCK_B=ROWS_UP_B, BF16=bf16, CLAMP=limit > 0, num_warps=ROWS_UP_WARPS,
        **chained(x), **up)
    part = torch.empty(nk + N, D, dtype=torch.float32, device=x.device)
    _down_rows_kernel[(nk + N, triton.cdiv(D, ROWS_DOWN_O))](
        h_arg, words(h), w2, s2, chosen, part, nk, D, I, SI, BLOCK_O=ROWS_DOWN_O, BLOCK_B=ROWS_DOWN_B,
        BF16=bf16, num_warps=ROWS_DOWN_WARPS, **chained(x), **down)
    out_bf16 = out.dtype == torch.bfloat16
    _sum_slots_kernel[(N, triton.cdiv(D, SUM_BLOCK))](part, chosen, out.view(torch.int16) if out_bf16 else out, nk, D,
                                                      K=K, BLOCK=SUM_BLOCK, OUT_BF16=out_bf16, num_warps=4,
                                                      **chained(part))
    return out


def stored(routed: tuple, scales: tuple | None, shared: tuple, dtype: torch.dtype, D: int, I: int):
    """The experts' weights as the kernels read them, and the launches' further arguments:
    (routed w1, w3, w2; shared s1, s3, s2; the up kernels' arguments; the down kernels').
    Routed: floats of ``dtype``, or with ``scales`` FP4 bytes (w1 / w3 int8 [E, I, D / 2], w2
    [E, D, I / 2]) and their e8m0 scales (one per 1 x 32). Shared: floats of ``dtype``, or
    (with FP4 routed experts) ``Packed`` of one format and power-of-two scale block, as
    ``Linear.gemv_weight`` gives them — a packed model's shared expert is FP8 in the checkpoint,
    read as stored here as its GEMV reads it, so no float copy of it is kept. The shared
    expert's intermediate width SI may be narrower than the routed experts' I (a rank's share
    of its channels): s1 / s3 [SI, D], s2 [D, SI]."""
    if scales is None:
        assert all(isinstance(t, torch.Tensor) and t.dtype == dtype for t in (*routed, *shared)), \
            "plain routed experts, a plain shared expert: floats of the tokens' dtype"
        return (*(t.contiguous() for t in (*routed, *shared)), {}, {})
    w1, w3, w2 = routed
    E, cols = w1.shape[0], (-(-D // 32), -(-I // 32))
    assert D % 2 == 0 and I % 2 == 0 and all(t.dtype == torch.int8 for t in routed)
    assert w1.shape == w3.shape == (E, I, D // 2) and w2.shape == (E, D, I // 2)
    assert scales[0].shape == scales[1].shape == (E, I, cols[0]) and scales[2].shape == (E, D, cols[1])
    up = dict(FMT="fp4", **dict(zip(("w1_sc", "w3_sc"), (_bytes(t) for t in scales[:2]))))
    down = dict(FMT="fp4", w2_sc=_bytes(scales[2]))
    if isinstance(shared[0], Packed):
        fmt, block = shared[0].fmt, shared[0].scale_block()
        assert all(isinstance(s, Packed) and s.decodable() and s.fmt == fmt and s.scale_block() == block
                   for s in shared), "the shared expert's weights decoded alike"
        SI = shared[0].shape[0]  # moe_decode holds it to at most I
        assert shared[0].shape == shared[1].shape == (SI, D) and shared[2].shape == (D, SI)
        kind = dict(S_FMT=fmt, SR=block[0], SC=block[1])
        up.update(kind, s1_sc=_bytes(shared[0].scale), s3_sc=_bytes(shared[1].scale))
        down.update(kind, s2_sc=_bytes(shared[2].scale))
        shared = tuple(s.data for s in shared)
    else:
        assert all(t.dtype == dtype for t in shared)
    return (*(_bytes(t) for t in routed), *(_bytes(t) if t.element_size() == 1 else t.contiguous() for t in shared),
            up, down)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A packed tensor's bytes, unsigned (FP4 codes read as nibbles, scales as exponents)."""
    return t.contiguous().view(torch.uint8)


def route(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, incoming: dict, *, top_k: int, scoring: str,
          temp: float, norm: bool, scale: float, x_norm=None, first: int = 0, held: int | None = None):
    """The gate's two launches for tokens x [N, D] (``incoming``: a ``Collapsed`` input's
    launch arguments, x then its stand-in): -> (the rows the experts read — x, or x normalised
    with ``x_norm`` —, the route weights [N, top_k] fp32, the chosen experts [N, top_k] as
    places in the stack of ``held`` experts from ``first`` on, -1 for another rank's)."""
    (N, D), E = x.shape, gate_w.shape[0]
    held = E if held is None else held
    gate_w, bias = gate_w.contiguous(), bias.contiguous()  # the bias read in its own dtype
    bf16 = x.dtype == torch.bfloat16
    weights = torch.empty(N, top_k, dtype=torch.float32, device=x.device)
    chosen = torch.empty(N, top_k, dtype=torch.int64, device=x.device)
    block_e = triton.next_power_of_2(E)
    rows = min(block_e, GATE_ROWS)
    block_d = max(16, min(GATE_BLOCK_D, 8192 // rows))
    chunk = triton.cdiv(triton.cdiv(D, min(GATE_SPLITS, triton.cdiv(D, block_d))), block_d) * block_d
    splits = triton.cdiv(D, chunk)
    part = torch.empty(N, splits, E, dtype=torch.float32, device=x.device)
    if x_norm is not None:
        nw, eps = x_norm[0].contiguous(), float(x_norm[1])
        assert nw.shape == (D,) and nw.dtype == x.dtype
        xn = torch.empty(N, D, dtype=x.dtype, device=x.device)
        normed = dict(NORM=True, BLOCK_X=triton.next_power_of_2(D), BF16=bf16, **unfused())
    else:
        nw, eps, xn, normed = x, 0.0, x, {}
    _gate_logits_kernel[(N, splits, triton.cdiv(E, rows))](
        x, gate_w, part, E, D, chunk, splits, nw, eps, xn.view(torch.int16) if bf16 else xn,  # unread without NORM
        BLOCK_E=rows, BLOCK_D=block_d, EARLY=GATE_EARLY and chunk == block_d, num_warps=4, **normed, **incoming,
        **chained(x))
    _gate_kernel[(N,)](part, bias, weights, chosen, E, splits, float(temp), float(scale),
                       K=top_k, K_P2=triton.next_power_of_2(top_k), BLOCK_E=block_e,
                       SPLITS_P2=triton.next_power_of_2(splits), SCORE=SCORING[scoring],
                       NORM=bool(norm and top_k > 1), num_warps=GATE_TOPK_WARPS, FIRST=first, EL=held,
                       **chained(xn))
    return xn, weights, chosen


def moe_decode(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
               w2: torch.Tensor, s1, s3, s2, *, top_k: int, scoring: str, temp: float, norm: bool, scale: float,
               limit: float, out_dtype: torch.dtype = torch.float32, grouped: bool | None = None, x_norm=None,
               scales: tuple[torch.Tensor, ...] | None = None, first: int = 0):
    """The MoE of tokens x [N, D] (fp32 or bf16): gate weight [E, D] and bias [E] (any float dtype),
    stacked routed experts w1 / w3 [E, I, D] and w2 [E, D, I], the shared expert's s1 / s3
    [I, D] and s2 [D, I], all in x's dtype. -> [N, D] (routed sum + shared) in fp32, or in
    bf16 rounded from it (``out_dtype``: ``MoE``'s cast back, done by the kernel).
    ``scales`` (w1's, w3's, w2's): the routed experts are FP4 as the checkpoint stores them,
    their bytes and scales stacked (``MoE.stack_experts``), and the shared expert's weights
    may be ``Packed`` (its FP8): see :func:`stored`. Each kernel decodes its tile in registers
    to the dequantised values and computes on them as on the plain tile (the same shape, the
    same sums): under Triton's interpreter the plain kernels' bits on the dequantised weights.
    ``grouped``: the experts' kernels by expert (each chosen expert's weights read once for
    all its tokens) rather than by (token, slot) pair; by default from ``GROUPED_TOKENS``
    tokens on. Both forms round and sum alike; their dot products reduce in other orders.
    ``x_norm`` = (weight [D], eps): x is an mHC site's input before its RMSNorm, which the
    gate-logits launch applies (``rms_norm``'s roundings) and writes for the expert kernels.
    ``x`` may be a ``model.kernels.Collapsed`` (with ``x_norm``): the gate-logits launch makes
    the rows it reads, and writes them normalised for the expert kernels as above.
    ``first``: one rank's part of an expert-parallel MoE — the stacks hold experts [first, first
    + their count) of the gate's E, the shared expert SI <= I of its intermediate channels (s1 /
    s3 [SI, D], s2 [D, SI]); the gate routes over every expert, a slot routed to another rank's
    adds nothing, and the output is this rank's part of the sum (``out_dtype`` fp32, for the
    caller to add over the ranks)."""
    N, D = x.shape
    E, EL, I = gate_w.shape[0], w1.shape[0], w1.shape[1]
    SI = s1.shape[0]
    assert x.dtype in (torch.float32, torch.bfloat16) and gate_w.shape == (E, D) and 0 <= first and first + EL <= E
    assert 0 < SI <= I, f"a shared expert of {SI} channels beside routed ones of {I}"
    w1, w3, w2, s1, s3, s2, up, down = stored((w1, w3, w2), scales, (s1, s3, s2), x.dtype, D, I)
    assert scales is not None or (w2.shape == (EL, D, I) and s1.shape == (SI, D) and s2.shape == (D, SI))
    incoming = {}
    if isinstance(x, Collapsed):
        assert x_norm is not None, "a site's input is made by a gate launch that normalises it"
        x, incoming = x.launch_args()
    else:
        x = x.contiguous()
    x, weights, chosen = route(x, gate_w, bias, incoming, top_k=top_k, scoring=scoring, temp=temp, norm=norm,
                               scale=scale, x_norm=x_norm, first=first, held=EL)
    bf16 = x.dtype == torch.bfloat16
    nk = N * top_k
    h = torch.empty(nk + N, I, dtype=x.dtype, device=x.device)
    h_arg = h.view(torch.int16) if bf16 else h
    assert out_dtype in (torch.float32, torch.bfloat16)
    out = torch.empty(N, D, dtype=out_dtype, device=x.device)
    out_bf16 = out_dtype == torch.bfloat16
    out_arg = out.view(torch.int16) if out_bf16 else out
    if grouped is None:
        grouped = N >= GROUPED_TOKENS
    if not grouped and scales is not None:  # FP4 routed experts by pair: the row kernels
        return fp4_rows(x, w1, w3, w2, s1, s3, s2, weights, chosen, h, out, float(limit), up, down)
    if not grouped:
        early, block_i, block_d = up_tile(D, x.element_size())
        _up_kernel[(nk + N, triton.cdiv(I, block_i))](
            x, w1, w3, s1, s3, weights, chosen, h_arg, nk, D, I, SI, float(limit),
            K=top_k, BLOCK_I=block_i, BLOCK_D=block_d, BF16=bf16, CLAMP=limit > 0, EARLY=early,
            num_warps=UP_WARPS, **chained(x))
        if DOWN_SLOTS:
            return down_slots(h, w2, s2, chosen, out, SI)
        _down_kernel[(N, triton.cdiv(D, DOWN_BLOCK_O))](
            h_arg, w2, s2, chosen, out_arg, nk, D, I, SI,
            K=top_k, BLOCK_O=DOWN_BLOCK_O, BLOCK_I=DOWN_BLOCK_I, BF16=bf16, OUT_BF16=out_bf16, num_warps=DOWN_WARPS,
            **chained(x))
        return out
    rows = dict(K=top_k, K_P2=triton.next_power_of_2(top_k), BLOCK_N=max(16, triton.next_power_of_2(N)), BF16=bf16,
                DOT="tf32" if bf16 else "ieee")
    _up_grouped_kernel[(EL + 1, triton.cdiv(I, G_UP_BLOCK_I))](
        x, w1, w3, s1, s3, weights, chosen, h_arg, N, nk, D, I, SI, float(limit), **rows,
        BLOCK_I=G_UP_BLOCK_I, BLOCK_D=G_UP_BLOCK_D, CLAMP=limit > 0, num_warps=G_UP_WARPS, **chained(x), **up)
    part = torch.empty(nk + N, D, dtype=torch.float32, device=x.device)
    _down_grouped_kernel[(EL + 1, triton.cdiv(D, G_DOWN_BLOCK_O))](
        h_arg, w2, s2, weights, chosen, part, N, nk, D, I, SI, **rows,
        BLOCK_O=G_DOWN_BLOCK_O, BLOCK_I=G_DOWN_BLOCK_I, num_warps=G_DOWN_WARPS, **chained(x), **down)
    _sum_slots_kernel[(N, triton.cdiv(D, SUM_BLOCK))](part, chosen, out_arg, nk, D, K=top_k, BLOCK=SUM_BLOCK,
                                                      OUT_BF16=out_bf16, num_warps=4, **chained(part))
    return out
