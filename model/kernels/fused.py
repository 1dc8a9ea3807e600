"""Triton decode kernels on packed cache bytes, each beside a short launcher that checks layout.

Owns ``hc_split`` (the mHC mixes: two sigmoids and a Sinkhorn-normalised hc x hc matrix
per token, all iterations in registers: one launch where torch runs ~120 small ones), and
``sparse_attention`` (one decode step of the shared K=V latent attention over FP8
window rows + selected FP4 records + the per-head sink) and ``indexer_scores`` (the
weighted-ReLU index scores against FP4 index keys). The semantics are those of the twins
in ``model.kernels.reference``; ``tests/test_kernels.py`` compares the two.

How the numbers stay within ~2^-20 of fp32:
- FP8 e4m3, FP4 e2m1 and the ue8m0 / e4m3 scale bytes are decoded in registers with
  integer bit manipulation (no float8 types, so the CPU interpreter runs it too).
- Every dot runs on bf16 tensor cores, each product exact and summed in fp32: a dequantised
  key is exact in bf16 (e4m3 x 2^k has 4 significant bits, e2m1 x e4m3 at most 6), and so
  is a bf16 query or the model's FP4 index query; an fp32 operand (the softmax
  probabilities, an fp32 query) goes in as three bf16 parts, every bit of its 24
  (``_bf16_parts``): its rounding is 2^-24 relative.
- Attention runs its [16 heads, D] x [D, 16 keys] and [16, 16] x [16, D] dots whole, 2D, on
  4 warps: 10.5 us a call with its merge at ``small``'s decode shapes, where the form of
  2026-12-01, 8d9f0f3 (tf32 dots batched over 32-channel chunks, 255 registers with spills),
  took 21.0 (2026-12-02, b4d612c, a CUDA graph of 20 calls on the H200, as ``kernel_sweep.py``
  times).

Sparse attention runs flash-decoding style: grid (B, head groups of 16, splits), the splits
so that one decode row (B=1) fills the GPU rather than one SM — down to one block of 16
keys a program (``kernel_sweep.py``: 26 us a call where 4 blocks a program took 55). Each
program walks its share of the row's blocks (the window's, then the records', one list), in one pass with
an online softmax whose running max starts at the head's sink logit (finite, so never
-inf - -inf); a second small kernel merges the splits over 128-channel blocks, adds the
sink to the denominator once and writes the query's dtype.

Does not own: the choice of kernel or twin (``model.kernels``), top-k (``model.kernels.select``
or torch), or
anything about caches. Imported only when Triton is importable.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

BLOCK_H = 16  # heads per program: tl.dot needs M >= 16 (fewer heads are masked rows)
BLOCK_N = 16  # window entries / records per inner step (32 and 64: slower or out of registers)
ATTN_WARPS = 8  # with the keys decoded blockwise (2026-12-03, 88b7232, H200, `small`, 128K, bench_knobs, two
# alternated rounds): a step 3.307 ms with 4 warps, 3.258 with 8 (the whole-row decode: 3.369 with 4,
# 3.461 with 8); the kernel alone (+ merge, kernel_sweep) 7.78 -> 7.31 us. ptxas for sm_90: 8 warps, no spills
# (2026-12-03, 59331ce: keys decoded as even / odd channel halves straight to bf16, 3.455 -> 3.626 ms, not kept)
INDEX_BLOCK_N = 64  # index keys per program
INDEX_WARPS = 4  # 5.9 us a call against 7.7 with 8 (scripts/kernel_sweep.py --only indexer, small, 16K keys)
MERGE_BLOCK_D = 128  # output channels per merge program (a head's 512 in one program took ~5.6 us)
MIN_BLOCKS_PER_SPLIT = 1  # a split per block of keys where the GPU has room: latency, not work, bounds a step
# (2026-12-03, 59331ce: 2 blocks a split made a step at 128K 9.6% slower, 3.397 -> 3.722 ms, bench_knobs)
# the attention's output de-rotated by the merge launch (``sparse_attention``'s ``turn_back``) rather
# than by the ``wo_a`` GEMV reading it (``ROPE_IN``: 218 registers, where 128 let all its programs hold
# their tiles at once). The probe that left the GEMV's rotation out (the output then wrong): 0.979 of
# a step (H200, `small`, 128K, bench_knobs, best of three rounds, control 0.997)
MERGE_TURNS_BACK = True
# (2026-12-04, dc98548: a timing probe that left the merge launch out read 0.961 of a step; the probes
# that left the attention's own stages out, 2026-12-03, 59331ce: docs/gpu-fast-path.md; their code is gone)
# the keys decoded a block of channels at a time (``_key_rows``; head dims from 64): each row's scale
# bytes read and decoded once a block (32 a record, 16 a window row) and broadcast over its channels,
# a record's codes read as int32 words of eight nibbles, the window's e4m3 bytes converted by the
# hardware, where the whole-row form reads and decodes one scale byte and one code byte per channel.
# sm_90 SASS (4 warps, static count): 3,672 -> 2,160 instructions; 2026-12-03 (88b7232) on the H200 (`small`, 128K,
# bench_knobs, two alternated rounds): a step 3.369 -> 3.307 ms; the kernel alone 9.82 -> 7.78 us.
# Stages then (a timing probe since removed): leaving the keys' bytes and decode out no
# longer shortens the kernel (7.67 -> 7.62 us); the query's dot does (-1.5 us), the partials' store -0.8
ATTN_BLOCKWISE = True
# (2026-12-03, 88b7232: the query and the sink read before the dependent launch's wait — the query is made two
# launches or more before the attention — 3.213 -> 3.197 ms a step at 128K, -0.5%: not kept)
# one split a row (a prefill's queries, each a row, ``kernels.sparse_prefill``): the attention
# kernel ends with the merge's arithmetic (its weight exp(m - top) is 1) and stores the output, no
# merge launch and no fp32 partials (the merge was 7% of a prefill's device time: H100, `small`,
# 8K CED in chunks of 2048, 2026-12-05, d76ebc4); the same bits as the merge (tests/test_prefill_attention.py)
FINAL_ONE_SPLIT = True
# (2026-12-06: the key blocks' loop as a for loop software-pipelined over 2 stages made a prefill's
# attention of 2,048 queries 1,788 us against 1,430 with the while loop; one H100, `small`, kernel_sweep
# --only attention-prefill: not kept)
SPLIT_WAVES = 3  # programs per SM the splits aim for; matters from batch ~8 (kernel_sweep --only splits,
# small, batch 16, 8 warps: 77.6 us a call with 1, 60.6 with 2, 59.1 with 3, 61.0 with 4; batch 4: 22.0-22.5 us for all)


# ----------------------------------------------------------------------------- byte decoding

@triton.jit
def _e4m3(b):
    """int32 bytes of float8_e4m3fn -> fp32 (0x7F / 0xFF NaN codes are never packed)."""
    exp = (b >> 3) & 0xF
    man = b & 0x7
    normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)  # subnormal: man * 2^-9
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit
def _e2m1(c):
    """int32 4-bit codes (sign in bit 3) -> fp32 on {0, .5, 1, 1.5, 2, 3, 4, 6}: the
    magnitude's three bits set as an fp32's exponent and first mantissa bit, the sign as its
    sign, times 2^126 (codes 0 and 1 are subnormals there: exact, the multiply keeps them)."""
    bits = ((c & 0x7) << 22) | ((c & 0x8) << 28)
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37


@triton.jit
def _ue8m0(b):
    """int32 exponent bytes -> 2^(b - 127) (byte 0 is never packed: scales are >= 2^-126)."""
    return (b << 23).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_bits(y):
    """fp32 -> the int16 bits of the nearest-even bf16 (torch's cast; the CPU interpreter's
    own cast truncates), to store through an int16 view of a bf16 tensor."""
    bits = y.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)


@triton.jit
def _round(y, BF16: tl.constexpr):
    """fp32 ``y`` as the value a tensor of the output's dtype holds: with ``BF16`` rounded to
    the nearest-even bf16 (on the bits), else as it is."""
    if BF16:
        return (_bf16_bits(y).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return y


@triton.jit
def _rms_normed(h, w, D, eps, BF16: tl.constexpr):
    """fp32 row ``h`` [D] (masked lanes 0) RMS-normalised and times the weight ``w`` (fp32
    values), rounded as ``rms_norm_ref`` rounds in the output's dtype: the normalised row
    cast first, then the product (bf16: nearest even, on the bits)."""
    return _rms_apply(h, _rms_factor(h, D, eps), w, BF16)


@triton.jit
def _rms_factor(h, D, eps):
    """The RMSNorm's factor of fp32 row ``h`` [D] (masked lanes 0): 1 / sqrt(mean(h²) + eps)."""
    return tl.math.rsqrt(tl.sum(h * h, axis=0) / D + eps)


@triton.jit
def _rms_apply(h, factor, w, BF16: tl.constexpr):
    """Channels ``h`` of a row normalised by the row's ``factor`` (:func:`_rms_factor`) and times
    their weights ``w``, rounded as :func:`_rms_normed` rounds: any slice of a row so made
    holds the bits of the whole row's."""
    return _round(w * _round(h * factor, BF16), BF16)


@triton.jit
def _turned(x, partner, first, cs, sn):
    """One channel of an adjacent RoPE pair as ``rope_ref`` turns it, given its partner
    (``first``: x is the pair's even channel): (e·cos − o·sin, e·sin + o·cos), each product
    and sum rounded on its own (launch with ``unfused()``)."""
    return tl.where(first, x * cs - partner * sn, partner * sn + x * cs)


@triton.jit
def _store(ptr, y, mask, BF16: tl.constexpr):
    """fp32 ``y`` stored in the destination's dtype: with ``BF16``, as bf16 bits (nearest even)
    through an int16 view; else cast to the pointer's element type."""
    if BF16:
        tl.store(ptr, _bf16_bits(y), mask=mask)
    else:
        tl.store(ptr, y.to(ptr.dtype.element_ty), mask=mask)


def unfused() -> dict:
    """Launch options that keep the compiler from fusing a product and a sum into one FMA, so
    a kernel rounds each as torch does; none under the interpreter, which has no such option."""
    return {} if os.environ.get("TRITON_INTERPRET") == "1" else {"enable_fp_fusion": False}


def chained(t: torch.Tensor) -> dict:
    """Launch options of a kernel on ``t``'s device as a programmatic dependent launch:
    ``{"PDL": True, "launch_pdl": True}`` where one runs (a CUDA device of compute
    capability 9 or later, a Triton that has it, ``DSAGENT_PDL`` not ``0``), else ``{}``.
    With them the GPU may schedule the kernel's programs while the kernel before it is still
    running; each waits at its start (:func:`_chain`) until that kernel has finished and its
    writes are visible, so what it computes is unchanged and only the launch's latency is
    hidden. Every kernel launched so must call :func:`_chain` before it touches memory that
    another kernel writes or reads: a kernel that finishes only after its predecessor keeps
    the order transitive down the chain."""
    if not t.is_cuda or os.environ.get("DSAGENT_PDL", "1") == "0" or not _pdl_supported(t.device.index or 0):
        return {}
    return {"PDL": True, "launch_pdl": True}


@functools.cache
def _pdl_supported(device: int) -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return (torch.cuda.get_device_capability(device)[0] >= 9 and "launch_pdl" in CUDAOptions.__dataclass_fields__
            and hasattr(tl.extra.cuda, "gdc_wait"))


@triton.jit
def _chain(PDL: tl.constexpr):
    """With ``PDL`` (a programmatic dependent launch, :func:`chained`): wait until the kernel
    before this one has finished and its writes are visible, then let the kernel after it
    be scheduled (its programs then wait here in turn). Without: nothing."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _fp4_rows(row_ptr, cols, mask, D: tl.constexpr, BLOCK: tl.constexpr):
    """Rows of packed e2m1 pairs (even channel in the low nibble) + per-BLOCK e4m3 scale bytes:
    the main records (the index keys' own decoding is the indexer's)."""
    byte = tl.load(row_ptr + cols // 2, mask=mask, other=0).to(tl.int32)
    code = (byte >> ((cols & 1) * 4)) & 0xF
    sb = tl.load(row_ptr + D // 2 + cols // BLOCK, mask=mask, other=0).to(tl.int32)
    return _e2m1(code) * _e4m3(sb)


# ----------------------------------------------------------------------------- bf16 tensor-core dots

@triton.jit
def _bf16_parts(x, PARTS: tl.constexpr):
    """fp32 ``x`` as bf16 parts that sum back to it: hi, mid, lo (``PARTS`` = 3: every bit of
    the 24; the last part's rounding is 2^-24 relative), or (x, -, -) as one bf16 part where x
    is bf16 already. Each remainder is exact in fp32, whichever way the cast rounds."""
    hi = x.to(tl.bfloat16)
    if PARTS == 1:
        return hi, hi, hi
    rest = x - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    return hi, mid, (rest - mid.to(tl.float32)).to(tl.bfloat16)


# Triton's interpreter multiplies a bf16 tensor's raw bits (it keeps them as uint16): there
# the bf16 dots run on the values in fp32, the same exact products
_BF16_BITS_DOT = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _bf16_dot(a, b, acc):
    """``acc + a @ b`` on bf16 operands, accumulated in fp32."""
    if _BF16_BITS_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _parts_dot(a_hi, a_mid, a_lo, b, acc, PARTS: tl.constexpr):
    """``acc + a @ b`` for ``a`` in its bf16 parts (:func:`_bf16_parts`), ``b`` exact in bf16:
    each product exact, summed in fp32 — the smallest part first."""
    if PARTS == 3:
        acc = _bf16_dot(a_lo, b, acc)
        acc = _bf16_dot(a_mid, b, acc)
    return _bf16_dot(a_hi, b, acc)


# ----------------------------------------------------------------------------- sparse attention

@triton.jit
def _key_block(win_ptr, valid_ptr, rec_ptr, idx_ptr, cur, span, blk, nW, W, N, K, b64, s_wb, s_wn, s_vb, s_rb, s_rn,
               s_ib, D: tl.constexpr, BLOCK_N: tl.constexpr, FROM_POS: tl.constexpr,
               BLOCKWISE: tl.constexpr = False):
    """Block ``blk`` of a row's keys (= values) as fp32 [BLOCK_N, D] and which are valid:
    window blocks first (``nW`` of them: FP8 slots of the ring), then the selected FP4
    records. Every value is exact in bf16 (e4m3 x 2^k: 4 significant bits; e2m1 x e4m3: at
    most 6)."""
    cols = tl.arange(0, D)
    if blk < nW:
        n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        if FROM_POS:
            at = tl.load(valid_ptr + n, mask=n < W, other=-1)
            valid = (at >= 0) & (at <= cur) & (at > cur - span)
        else:
            valid = tl.load(valid_ptr + b64 * s_vb + n, mask=n < W, other=0) != 0
        row = win_ptr + b64 * s_wb + n.to(tl.int64)[:, None] * s_wn
        if BLOCKWISE:
            kv = _key_rows(row, valid[:, None], True, D, BLOCK_N)
        else:
            data = tl.load(row + cols[None, :], mask=valid[:, None], other=0).to(tl.int32)
            sb = tl.load(row + D + cols[None, :] // 32, mask=valid[:, None], other=0).to(tl.int32)
            kv = _e4m3(data) * _ue8m0(sb)
    else:
        k = (blk - nW) * BLOCK_N + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + b64 * s_ib + k, mask=k < K, other=-1).to(tl.int64)
        valid = (idx >= 0) & (idx < N)  # the bound only keeps a bad index from reading out of range
        row = rec_ptr + b64 * s_rb + tl.where(valid, idx, 0)[:, None] * s_rn
        if BLOCKWISE:
            kv = _key_rows(row, valid[:, None], False, D, BLOCK_N)
        else:
            kv = _fp4_rows(row, cols[None, :], valid[:, None], D, 16)
    return kv, valid


@triton.jit
def _key_rows(row, seen, FP8: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows of keys as fp32 [BLOCK_N, D], a block of channels at a time: a window row (FP8:
    D e4m3 bytes, a ue8m0 byte per 32 channels) or a record (D / 2 bytes of e2m1 pairs, the
    even channel in the low nibble, an e4m3 byte per 16 channels). Each scale byte is read
    and decoded once, then broadcast over its block; a record's codes are read as int32
    words of eight. The values are :func:`_key_block`'s."""
    if FP8:
        sb = _ue8m0(tl.load(row + D + tl.arange(0, D // 32)[None, :], mask=seen, other=0).to(tl.int32))
        data = tl.load(row + tl.arange(0, D)[None, :], mask=seen, other=0)
        kv = tl.reshape(data.to(tl.float8e4nv, bitcast=True).to(tl.float32), (BLOCK_N, D // 32, 32)) * sb[:, :, None]
        return tl.reshape(kv, (BLOCK_N, D))
    sb = _e4m3(tl.load(row + D // 2 + tl.arange(0, D // 16)[None, :], mask=seen, other=0).to(tl.int32))
    sb = tl.reshape(tl.broadcast_to(sb[:, :, None], (BLOCK_N, D // 16, 2)), (BLOCK_N, D // 8))  # a word's
    words = tl.load(row.to(tl.pointer_type(tl.int32)) + tl.arange(0, D // 8)[None, :], mask=seen, other=0)
    # nibble k of word w is channel 8w + k: joined so that k = 4i + 2j + l lies at [w, i, j, l]
    a0 = tl.join(_e2m1(words & 0xF), _e2m1((words >> 16) & 0xF))
    a1 = tl.join(_e2m1((words >> 4) & 0xF), _e2m1((words >> 20) & 0xF))
    a2 = tl.join(_e2m1((words >> 8) & 0xF), _e2m1((words >> 24) & 0xF))
    a3 = tl.join(_e2m1((words >> 12) & 0xF), _e2m1((words >> 28) & 0xF))
    kv = tl.join(tl.join(a0, a2), tl.join(a1, a3)) * sb[:, :, None, None, None]
    return tl.reshape(kv, (BLOCK_N, D))


@triton.jit
def _attend_block(win_ptr, valid_ptr, rec_ptr, idx_ptr, cur, span, blk, nW, W, N, K, b64, s_wb, s_wn, s_vb, s_rb, s_rn,
                  s_ib, q_hi, q_mid, q_lo, m, l, acc, scale, D: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_N: tl.constexpr, Q_PARTS: tl.constexpr, FROM_POS: tl.constexpr, BLOCKWISE: tl.constexpr):
    """The online softmax's running (max, sum, weighted values) after key block ``blk``."""
    kv, valid = _key_block(win_ptr, valid_ptr, rec_ptr, idx_ptr, cur, span, blk, nW, W, N, K, b64, s_wb, s_wn,
                           s_vb, s_rb, s_rn, s_ib, D, BLOCK_N, FROM_POS, BLOCKWISE)
    return _online_step(q_hi, q_mid, q_lo, kv.to(tl.bfloat16), valid, m, l, acc, scale, BLOCK_H, BLOCK_N, Q_PARTS)


@triton.jit
def _query_heads(row_ptr, s_qh, g, H, D: tl.constexpr, BLOCK_H: tl.constexpr, Q_PARTS: tl.constexpr):
    """Head group ``g`` of a query row: (heads, which exist, the query's bf16 parts)."""
    heads = g * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < H
    q = tl.load(row_ptr + heads[:, None] * s_qh + tl.arange(0, D)[None, :], mask=head_ok[:, None], other=0.0)
    q_hi, q_mid, q_lo = _bf16_parts(q.to(tl.float32), Q_PARTS)
    return heads, head_ok, q_hi, q_mid, q_lo


@triton.jit
def _online_step(q_hi, q_mid, q_lo, k, valid, m, l, acc, scale, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                 Q_PARTS: tl.constexpr):
    """The online softmax's (max, sum, weighted values) after keys ``k`` [BLOCK_N, D] (bf16,
    each exact), those not ``valid`` masked: the query in ``Q_PARTS`` bf16 parts, the
    probabilities in three (every bit of their fp32), each dot summed in fp32."""
    s = _parts_dot(q_hi, q_mid, q_lo, tl.trans(k), tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32), Q_PARTS)
    s = tl.where(valid[None, :], s * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    p_hi, p_mid, p_lo = _bf16_parts(p, 3)
    return m_new, l, _parts_dot(p_hi, p_mid, p_lo, k, acc * alpha[:, None], 3)


# decode-varying sizes: one compile
@triton.jit(do_not_specialize=["W", "N", "K", "SPLITS", "s_vb", "s_ib", "span", "nW", "NB"])
def _sparse_attention_kernel(
    q_ptr, win_ptr, valid_ptr, rec_ptr, idx_ptr, sink_ptr, m_ptr, l_ptr, acc_ptr, cur_ptr,
    H, W, N, K, SPLITS, scale, span, nW, NB,
    s_qb, s_qh, s_wb, s_wn, s_vb, s_rb, s_rn, s_ib,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, Q_PARTS: tl.constexpr,
    FROM_POS: tl.constexpr, BLOCKWISE: tl.constexpr = False, PDL: tl.constexpr = False,
    FINAL: tl.constexpr = False, BF16: tl.constexpr = False, out_ptr=None,
):
    """Partial softmax sums of one (row, head group, split) over blocks split, split +
    SPLITS, ... of the row's ``NB`` key blocks (window, then records). The window's valid
    slots come from ``valid_ptr`` (uint8 [B, W]), or with ``FROM_POS`` from the ring's
    positions (``valid_ptr``: int64 [W], shared by the rows) against the query's (``cur_ptr``,
    one element) and the window ``span``: -1 < slot position <= query, within the last span.
    Both dots run on bf16 tensor cores, summed in fp32: the query in ``Q_PARTS`` bf16 parts
    (1: a bf16 query; 3: every bit of an fp32 one), the probabilities in three, the keys exact."""
    _chain(PDL)
    b, g, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b64 = b.to(tl.int64)
    cols = tl.arange(0, D)
    heads, head_ok, q_hi, q_mid, q_lo = _query_heads(q_ptr + b64 * s_qb, s_qh, g, H, D, BLOCK_H, Q_PARTS)
    # the running max starts at the sink logit: finite, and the sink itself is added once, when merging
    m = tl.load(sink_ptr + heads, mask=head_ok, other=0.0).to(tl.float32)
    l = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    cur = 0
    if FROM_POS:
        cur = tl.load(cur_ptr)
    # a while loop, because a for loop over runtime bounds stops Triton 3.6's interpreter
    # under numpy >= 2.4 (its scalars are 1-element arrays)
    blk = split
    while blk < NB:
        m, l, acc = _attend_block(win_ptr, valid_ptr, rec_ptr, idx_ptr, cur, span, blk, nW, W, N, K, b64, s_wb,
                                  s_wn, s_vb, s_rb, s_rn, s_ib, q_hi, q_mid, q_lo, m, l, acc, scale, D, BLOCK_H,
                                  BLOCK_N, Q_PARTS, FROM_POS, BLOCKWISE)
        blk += SPLITS

    if FINAL:  # the one split: the merge's sums of one term (top = m, since m starts at the sink)
        sink = tl.load(sink_ptr + heads, mask=head_ok, other=0.0).to(tl.float32)
        top = tl.maximum(m, sink)
        w = tl.exp(m - top)
        out = (acc * w[:, None]) / (l * w + tl.exp(sink - top))[:, None]
        _store(out_ptr + (b64 * H + heads)[:, None] * D + cols[None, :], out, head_ok[:, None], BF16)
    else:
        part = (b64 * SPLITS + split) * H + heads  # partials are [B, SPLITS, H(, D)]
        tl.store(m_ptr + part, m, mask=head_ok)
        tl.store(l_ptr + part, l, mask=head_ok)
        tl.store(acc_ptr + part[:, None] * D + cols[None, :], acc, mask=head_ok[:, None])


@triton.jit(do_not_specialize=["SPLITS"])
def _merge_splits_kernel(m_ptr, l_ptr, acc_ptr, sink_ptr, out_ptr, H, SPLITS, cos_ptr, sin_ptr, OFF,
                         D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_P2: tl.constexpr, BF16: tl.constexpr,
                         TURN: tl.constexpr = False, PDL: tl.constexpr = False):
    """Channels [c * BLOCK_D, (c + 1) * BLOCK_D) of head h's output: the splits' partial sums
    weighted by their maxima, over the denominator with the sink; stored in the query's dtype
    (bf16 rounded to nearest even on the bits, as torch's cast). TURN: the output, so rounded,
    then turned by cos / sin [r] in adjacent pairs from channel OFF on (``rope_ref``'s
    products and sums, launched ``unfused``) and rounded again: the attention's output
    de-rotated before ``wo_a`` (what the GEMV's ``ROPE_IN`` does to its input)."""
    _chain(PDL)
    b, h, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    s = tl.arange(0, SPLITS_P2)
    part = (b.to(tl.int64) * SPLITS + s) * H + h
    m = tl.load(m_ptr + part, mask=s < SPLITS, other=float("-inf"))
    l = tl.load(l_ptr + part, mask=s < SPLITS, other=0.0)
    sink = tl.load(sink_ptr + h).to(tl.float32)
    top = tl.maximum(tl.max(m, 0), sink)
    w = tl.exp(m - top)
    denom = tl.sum(l * w, 0) + tl.exp(sink - top)
    cols = c * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.load(acc_ptr + part[:, None] * D + cols[None, :], mask=(s < SPLITS)[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / denom
    if TURN:  # a pair's two channels lie side by side in the block: BLOCK_D is even
        e, o = tl.split(tl.reshape(_round(out, BF16), [BLOCK_D // 2, 2]))
        pc = c * BLOCK_D + 2 * tl.arange(0, BLOCK_D // 2)  # each pair's even channel
        rot = pc >= OFF
        cs = tl.load(cos_ptr + (pc - OFF) // 2, mask=rot, other=0.0)
        sn = tl.load(sin_ptr + (pc - OFF) // 2, mask=rot, other=0.0)
        out = tl.reshape(tl.join(tl.where(rot, _turned(e, o, True, cs, sn), e),
                                 tl.where(rot, _turned(o, e, False, cs, sn), o)), [BLOCK_D])
    if BF16:
        tl.store(out_ptr + (b.to(tl.int64) * H + h) * D + cols, _bf16_bits(out))
    else:
        tl.store(out_ptr + (b.to(tl.int64) * H + h) * D + cols, out)


def _auto_splits(q: torch.Tensor, groups: int, blocks: int) -> int:
    """Enough programs to cover the SMs ``SPLIT_WAVES`` times, but never splits of fewer than
    ``MIN_BLOCKS_PER_SPLIT`` blocks."""
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
    want = -(-(SPLIT_WAVES * sms) // (q.shape[0] * groups))
    return max(1, min(want, blocks // MIN_BLOCKS_PER_SPLIT))


def sparse_attention(q, window, window_valid, records, record_idx, sink, scale: float,
                     splits: int | None = None, out_dtype: torch.dtype = torch.float32,
                     window_at: tuple | None = None, turn_back: tuple | None = None) -> torch.Tensor:
    """See ``model.kernels.sparse_attention``; ``window_at`` (ring positions [W] int64, the
    query's position [1], the window span) in place of ``window_valid`` (None then): the
    kernel tests each slot itself; ``turn_back`` (cos, sin [1, r]): the merge turns the output."""
    B, H, D = q.shape
    W, N, K = window.shape[1], records.shape[1], record_idx.shape[1]
    assert D >= 16 and D & (D - 1) == 0, f"head_dim {D} must be a power of two >= 16"
    assert window.dtype == records.dtype == torch.uint8 and window.shape[2] == D + D // 32
    assert records.shape[2] == D // 2 + D // 16 and sink.shape == (H,)
    # rows read through their strides (a prefill's overlapping windows, its records shared by
    # every query): only the bytes of a row must be contiguous
    q, window, records, record_idx = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, window, records, record_idx))
    if window_at is None:
        assert window_valid.shape == (B, W)
        valid, cur, span = window_valid.contiguous().view(torch.uint8), q, 0
    else:
        valid, cur, span = window_at
        assert valid.shape == (W,) and valid.dtype == torch.int64 and cur.numel() == 1
    if N == 0 or K == 0:  # nothing to select: skip the loop, hand the kernel real (unused) memory
        K, records, record_idx = 0, records.new_empty(B, 1, records.shape[2]), record_idx.new_empty(B, 1)  # never read
    groups = triton.cdiv(H, BLOCK_H)
    n_window = triton.cdiv(W, BLOCK_N)
    blocks = n_window + triton.cdiv(K, BLOCK_N)
    splits = splits or _auto_splits(q, groups, blocks)
    assert out_dtype in (torch.float32, torch.bfloat16)
    bf16 = out_dtype == torch.bfloat16
    out = torch.empty(B, H, D, dtype=out_dtype, device=q.device)
    final = FINAL_ONE_SPLIT and splits == 1 and turn_back is None
    if final:  # no partials: the kernel stores the output
        m = l = acc = out
    else:
        m = torch.empty(B, splits, H, dtype=torch.float32, device=q.device)
        l, acc = torch.empty_like(m), torch.empty(B, splits, H, D, dtype=torch.float32, device=q.device)
    sink = sink.contiguous()  # read in its own dtype
    _sparse_attention_kernel[(B, groups, splits)](
        q, window, valid, records, record_idx, sink, m, l, acc, cur,
        H, W, N, K, splits, float(scale), int(span), n_window, blocks,
        q.stride(0), q.stride(1), window.stride(0), window.stride(1), valid.stride(0),
        records.stride(0), records.stride(1), record_idx.stride(0),
        D=D, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, Q_PARTS=1 if q.dtype == torch.bfloat16 else 3,
        FROM_POS=window_at is not None, num_warps=ATTN_WARPS, **chained(q),
        BLOCKWISE=ATTN_BLOCKWISE and D >= 64,  # from 64 a record's 9 D / 16 bytes hold whole int32 words
        FINAL=final, BF16=bf16, out_ptr=out.view(torch.int16) if bf16 else out)
    if final:
        return out
    block_d = min(D, MERGE_BLOCK_D)
    cos, sin = turn_back or (m, m)  # unread without TURN
    if turn_back is not None:
        assert cos.shape == sin.shape and cos.shape[0] == 1 and 2 * cos.shape[1] <= D and cos.dtype == torch.float32
        cos, sin = cos.contiguous(), sin.contiguous()
    _merge_splits_kernel[(B, H, D // block_d)](m, l, acc, sink, out.view(torch.int16) if bf16 else out, H, splits,
                                               cos, sin, D - 2 * cos.shape[-1] if turn_back else 0,
                                               D=D, BLOCK_D=block_d, SPLITS_P2=triton.next_power_of_2(splits),
                                               BF16=bf16, TURN=turn_back is not None, **unfused(), **chained(q))
    return out


# ----------------------------------------------------------------------------- indexer

@triton.jit(do_not_specialize=["N", "NK", "n_visible", "s_ob", "s_rb"])
def _indexer_kernel(q_ptr, w_ptr, key_ptr, out_ptr, vis_ptr, rows_ptr, HI, N, NK, n_visible, head_scale,
                    s_qb, s_qh, s_wb, s_kb, s_kn, s_ob, s_rb, s_vb,
                    w_scale, DI: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_N: tl.constexpr,
                    VIS_PTR: tl.constexpr, VIS_RATIO: tl.constexpr, ROWS: tl.constexpr, Q_PARTS: tl.constexpr,
                    PDL: tl.constexpr = False):
    """Scores of one row's BLOCK_N keys (with ``ROWS``: of the keys at ``rows_ptr``'s next
    BLOCK_N entries, -1 none, out of the NK there are): the query's heads (bf16 parts,
    :func:`_bf16_parts`) against FP4 keys decoded to bf16, on tensor cores; ReLU, sum over
    the heads weighted by w · w_scale. The keys seen: ``n_visible``, or with VIS_PTR the count
    at ``vis_ptr`` (the row's, ``s_vb`` apart; 0: one for every row), or with VIS_RATIO too the
    position there + 1 over it."""
    _chain(PDL)
    b, blk = tl.program_id(0), tl.program_id(1)
    if VIS_PTR:  # a device tensor (a graphed decode step): the count, or with VIS_RATIO the position
        limit = tl.load(vis_ptr + b.to(tl.int64) * s_vb)
        if VIS_RATIO:
            limit = (limit + 1) // VIS_RATIO
    else:
        limit = n_visible
    b64 = b.to(tl.int64)
    heads = tl.arange(0, BLOCK_HI)
    head_ok = heads < HI
    # channel 2j is byte j's low nibble and 2j + 1 its high one: the dot takes the even
    # channels and the odd ones apart, the query read the same way
    pair = tl.arange(0, DI // 2)
    q_row = q_ptr + b64 * s_qb + heads[:, None] * s_qh + 2 * pair[None, :]
    e_hi, e_mid, e_lo = _bf16_parts(tl.load(q_row, mask=head_ok[:, None], other=0.0).to(tl.float32), Q_PARTS)
    o_hi, o_mid, o_lo = _bf16_parts(tl.load(q_row + 1, mask=head_ok[:, None], other=0.0).to(tl.float32), Q_PARTS)
    w = tl.load(w_ptr + b64 * s_wb + heads, mask=head_ok, other=0.0).to(tl.float32) * w_scale
    n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    live = n < N
    at = n.to(tl.int64)
    if ROWS:
        at = tl.load(rows_ptr + b64 * s_rb + n, mask=live, other=-1).to(tl.int64)
    visible = (at >= 0) & (at < limit) & (at < NK)  # the last bound only keeps a bad row from reading out of range
    seen = (live & visible)[:, None]  # unseen keys: not read
    row = key_ptr + b64 * s_kb + tl.where(visible, at, 0)[:, None] * s_kn
    byte = tl.reshape(tl.load(row + pair[None, :], mask=seen, other=0).to(tl.int32), (BLOCK_N, DI // 32, 16))
    sb = _ue8m0(tl.load(row + DI // 2 + tl.arange(0, DI // 32)[None, :], mask=seen, other=0).to(tl.int32))
    # e2m1 times a power of two: exact in bf16
    even = tl.reshape(_e2m1(byte & 0xF) * sb[:, :, None], (BLOCK_N, DI // 2)).to(tl.bfloat16)
    odd = tl.reshape(_e2m1(byte >> 4) * sb[:, :, None], (BLOCK_N, DI // 2)).to(tl.bfloat16)
    s = _parts_dot(e_hi, e_mid, e_lo, tl.trans(even), tl.zeros([BLOCK_HI, BLOCK_N], tl.float32), Q_PARTS)
    s = _parts_dot(o_hi, o_mid, o_lo, tl.trans(odd), s, Q_PARTS)  # (BLOCK_HI, BLOCK_N)
    score = tl.sum(tl.maximum(s, 0.0) * head_scale * w[:, None], 0)
    score = tl.where(visible, score, float("-inf"))
    tl.store(out_ptr + b64 * s_ob + n, score, mask=live)


def indexer_scores(q, weights, keys, n_visible, head_scale: float, rows: torch.Tensor | None = None,
                   weight_scale: float = 1.0) -> torch.Tensor:
    B, HI, DI = q.shape
    NK = keys.shape[1]
    assert DI >= 64 and DI & (DI - 1) == 0, f"index_head_dim {DI} must be a power of two >= 64"
    assert keys.dtype == torch.uint8 and keys.shape[2] == DI // 2 + DI // 32 and weights.shape == (B, HI)
    N = NK if rows is None else rows.shape[1]
    out = torch.empty(B, N, dtype=torch.float32, device=q.device)
    if N == 0:
        return out
    if NK == 0:  # nothing to read: every row is none
        return out.fill_(float("-inf"))
    # keys read through their strides (a prefill's queries share one buffer): a row's bytes contiguous
    q, weights, keys = q.contiguous(), weights.contiguous(), keys if keys.stride(-1) == 1 else keys.contiguous()
    if rows is not None:
        assert rows.shape[0] == B
        rows = rows.contiguous()
    n_visible, ratio = n_visible if isinstance(n_visible, tuple) else (n_visible, 0)
    on_device = isinstance(n_visible, torch.Tensor)
    if ratio and not on_device:  # a position on the host: its count here
        n_visible, ratio = (n_visible + 1) // ratio, 0
    per_row = on_device and n_visible.numel() > 1
    if per_row:
        assert n_visible.numel() == B
        n_visible = n_visible.reshape(B).contiguous()
    _indexer_kernel[(B, triton.cdiv(N, INDEX_BLOCK_N))](
        q, weights, keys, out, n_visible if on_device else out, out if rows is None else rows, HI, N, NK,
        0 if on_device else int(n_visible), float(head_scale), q.stride(0), q.stride(1), weights.stride(0),
        keys.stride(0), keys.stride(1), out.stride(0), 0 if rows is None else rows.stride(0), 1 if per_row else 0,
        float(weight_scale),
        DI=DI, BLOCK_HI=max(16, triton.next_power_of_2(HI)), BLOCK_N=INDEX_BLOCK_N, VIS_PTR=on_device,
        VIS_RATIO=ratio, ROWS=rows is not None, Q_PARTS=1 if q.dtype == torch.bfloat16 else 3,
        num_warps=INDEX_WARPS, **chained(q))
    return out


# ----------------------------------------------------------------------------- mHC mixes

HC_BLOCK_R = 16  # tokens per program
HC_WARPS = 1  # one site at batch 1: 4.7 us a call against 8.3 with 64 rows and 4 warps (kernel_sweep.py --only mhc)


@triton.jit
def _hc_split_tiles(pre, post, comb, scale_ptr, base_ptr, eps, HC: tl.constexpr, ITERS: tl.constexpr):
    """Raw mixes pre / post [R, HC] and comb [R, HC, HC] -> their values: the scale and base,
    the sigmoids, comb's softmax and its ``ITERS`` Sinkhorn normalisations (``hc_split_ref``)."""
    k = tl.arange(0, HC)
    s0, s1, s2 = tl.load(scale_ptr), tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)
    pre = pre * s0 + tl.load(base_ptr + k)[None, :]
    post = post * s1 + tl.load(base_ptr + HC + k)[None, :]
    pre = 1.0 / (1.0 + tl.exp(-pre)) + eps
    post = 2.0 / (1.0 + tl.exp(-post))
    comb = comb * s2 + tl.load(base_ptr + 2 * HC + k[:, None] * HC + k[None, :])[None, :, :]
    comb = tl.exp(comb - tl.max(comb, 2)[:, :, None])
    comb = comb / tl.sum(comb, 2)[:, :, None] + eps
    comb = comb / (tl.sum(comb, 1)[:, None, :] + eps)
    for _ in tl.static_range(ITERS - 1):
        comb = comb / (tl.sum(comb, 2)[:, :, None] + eps)
        comb = comb / (tl.sum(comb, 1)[:, None, :] + eps)
    return pre, post, comb


@triton.jit
def _hc_store_split(pre_ptr, post_ptr, comb_ptr, r64, live, pre, post, comb, HC: tl.constexpr):
    k = tl.arange(0, HC)
    out = r64[:, None] * HC + k[None, :]
    tl.store(pre_ptr + out, pre, mask=live[:, None])
    tl.store(post_ptr + out, post, mask=live[:, None])
    tl.store(comb_ptr + r64[:, None, None] * (HC * HC) + (k[:, None] * HC + k[None, :])[None, :, :], comb,
             mask=live[:, None, None])


@triton.jit(do_not_specialize=["R"])
def _hc_split_kernel(mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, R, s_mr, eps,
                     HC: tl.constexpr, ITERS: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr = False):
    _chain(PDL)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = r < R
    r64 = r.to(tl.int64)
    k = tl.arange(0, HC)
    row = mix_ptr + r64[:, None] * s_mr
    pre = tl.load(row + k[None, :], mask=live[:, None], other=0.0)
    post = tl.load(row + HC + k[None, :], mask=live[:, None], other=0.0)
    ij = 2 * HC + k[:, None] * HC + k[None, :]  # (HC, HC) offsets of comb[i, j]
    comb = tl.load(mix_ptr + r64[:, None, None] * s_mr + ij[None, :, :], mask=live[:, None, None], other=0.0)
    pre, post, comb = _hc_split_tiles(pre, post, comb, scale_ptr, base_ptr, eps, HC, ITERS)
    _hc_store_split(pre_ptr, post_ptr, comb_ptr, r64, live, pre, post, comb, HC)


def hc_split(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps: float):
    assert mixes.dtype == torch.float32 and mixes.shape[-1] == (2 + hc) * hc and hc & (hc - 1) == 0 and iters >= 1
    lead = mixes.shape[:-1]
    flat = mixes.reshape(-1, mixes.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    R = flat.shape[0]
    pre = torch.empty(*lead, hc, dtype=torch.float32, device=mixes.device)
    post, comb = torch.empty_like(pre), torch.empty(*lead, hc, hc, dtype=torch.float32, device=mixes.device)
    if R:
        _hc_split_kernel[(triton.cdiv(R, HC_BLOCK_R),)](
            flat, scale.float().contiguous(), base.float().contiguous(), pre, post, comb, R, flat.stride(0),
            float(eps), HC=hc, ITERS=iters, BLOCK_R=HC_BLOCK_R, num_warps=HC_WARPS, **chained(mixes))
    return pre, post, comb
