"""A prefill's sparse attention on the cache's bytes: keys decoded once a call, then a
program a query.

``sparse_prefill(q, window, window_pos, records, record_idx, sink, scale, out_dtype)``:
``model.kernels.sparse_prefill``'s kernel path (shapes there). Two launches:

1. ``_decode_rows_kernel`` turns the chunk's FP8 window entries ([span + S] rows) and the
   source's FP4 records ([N] rows) into bf16 rows — exact: e4m3 x 2^k and e2m1 x e4m3 hold
   at most 6 significant bits. Every key is decoded once, where the decode kernel of
   ``model.kernels.fused`` (a query a row) decoded each query's 640 keys in its own
   registers: 237 registers a thread, one program an SM, each a chain of 40 dependent key
   blocks of decode and dots (sm_90 build, 2026-12-06).
2. ``_prefill_kernel``, grid (queries, head groups): one query's heads against its window's
   bf16 rows (rows i + 1 .. i + span: the window of query i, position order) and its
   selected records' (a gather of whole 1 KB rows, which the L2 holds: a 32K context's
   ratio-2 records are 16 MB), an online softmax whose running max starts at the sink's
   logit, the sink added to the denominator at the end — the arithmetic of the decode
   kernel's one split, so the twin (``sparse_attention_ref``) is the same function.
   With 64 heads or more and a bf16 query (``wide_form``: V4.1-Flash) a program holds all
   64 heads of its query and the dots are turned round (the key block is the dot's M side,
   64 heads its N), so each key block is read once a query instead of four times: 1,377
   against 1,956 us for 2,048 queries of V4.1-Flash over a 32K context's records, and its
   8K prefill at full width 6% faster exact, 3% CED (one H100, 2026-12-07; the sweeps in
   docs/benchmarks.md).

Numbers: the query in ``Q_PARTS`` bf16 parts (1: a bf16 query; 3: every bit of an fp32 one),
the keys exact, each dot summed in fp32, the probabilities in three bf16 parts (every bit of
their fp32) before their dot with the values: the decode kernel's numbers. (Probabilities
rounded to one bf16 part, FlashAttention's choice, made the kernel 13% faster — 447 against
516 us for 2,048 queries of `small` over a 32K context's records, one H100, 2026-12-06 — and
its output ~2^-9 off: not kept.)

Does not own: which path runs (``model.kernels``), the window's bytes or the selection
(``model.block``), decode steps (``model.kernels.fused``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.kernels.fused import (_bf16_dot, _bf16_parts, _e2m1, _key_rows, _online_step, _parts_dot, _query_heads,
                                 _store, _ue8m0)

BLOCK_R = 16  # rows a decode program turns to bf16
BLOCK_H = 16  # heads per program (tl.dot needs M >= 16)
BLOCK_N = 32  # keys per step of a query's loop
WARPS = 4
STAGES = 2  # software pipelining of the key loops: the next blocks' indices and rows loaded during this one
# 64 heads or more and a bf16 query (V4.1-Flash's 64): a program takes WIDE_H heads, the keys on the
# dots' M side (S^T = K Q^T, O^T += V^T P^T), WIDE_WARPS warps, so a query's key blocks are read once,
# not once per 16 heads. An fp32 query's three parts of 64 heads need 242 KB of shared memory, more
# than an SM has; it keeps the narrow form.
WIDE_H, WIDE_WARPS = 64, 8


@triton.jit
def _decode_rows_kernel(src_ptr, out_ptr, R, s_r, FMT: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr):
    """Rows [BLOCK_R], ``s_r`` bytes apart, as bf16 rows of D (int16 bits, ``out_ptr``): FP8
    window entries (``FMT`` "window"), FP4 records ("record") or FP4 index keys ("index": D / 2
    bytes of e2m1 pairs, the even channel in the low nibble, a ue8m0 byte per 32 channels)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = r < R
    row = src_ptr + r.to(tl.int64)[:, None] * s_r
    if FMT == "index":
        byte = tl.reshape(tl.load(row + tl.arange(0, D // 2)[None, :], mask=ok[:, None], other=0).to(tl.int32),
                          (BLOCK_R, D // 32, 16))
        sb = _ue8m0(tl.load(row + D // 2 + tl.arange(0, D // 32)[None, :], mask=ok[:, None], other=0).to(tl.int32))
        kv = tl.reshape(tl.interleave(_e2m1(byte & 0xF) * sb[:, :, None], _e2m1(byte >> 4) * sb[:, :, None]),
                        (BLOCK_R, D))
    else:
        kv = _key_rows(row, ok[:, None], FMT == "window", D, BLOCK_R)
    _store(out_ptr + r.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :], kv, ok[:, None], True)


@triton.jit(do_not_specialize=["span", "N", "K"])
def _prefill_kernel(q_ptr, kw_ptr, wpos_ptr, kr_ptr, idx_ptr, sink_ptr, out_ptr, H, span, N, K, scale,
                    s_qs, s_qh, s_is, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                    Q_PARTS: tl.constexpr, BF16: tl.constexpr, STAGES: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Query i's heads [g * BLOCK_H, ...): its window's rows of ``kw`` (bf16 [span + S, D],
    positions ``wpos``, -1 none), then its selected rows of ``kr`` (bf16 [N, D]; ``idx`` [S, K],
    -1 none), and the sink; the output stored in the query's dtype (``BF16``: bf16 bits).
    ``TRANSPOSED`` (a bf16 query only): the keys on the dots' M side, ``_online_step_t``."""
    i = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, D)
    heads, head_ok, q_hi, q_mid, q_lo = _query_heads(q_ptr + i * s_qs, s_qh, tl.program_id(1), H, D, BLOCK_H, Q_PARTS)
    sink = tl.load(sink_ptr + heads, mask=head_ok, other=0.0).to(tl.float32)
    m, l = sink, tl.zeros([BLOCK_H], dtype=tl.float32)
    if TRANSPOSED:
        tl.static_assert(Q_PARTS == 1, "the keys-on-M form takes a bf16 query")
        acc = tl.zeros([D, BLOCK_H], dtype=tl.float32)
        q_hi = tl.trans(q_hi)
    else:
        acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    for blk in tl.range(0, tl.cdiv(span, BLOCK_N), num_stages=STAGES):
        n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        row = i + 1 + n
        valid = tl.load(wpos_ptr + row, mask=n < span, other=-1) >= 0
        k = tl.load(kw_ptr + row[:, None] * D + cols[None, :], mask=valid[:, None], other=0.0)
        if TRANSPOSED:
            m, l, acc = _online_step_t(q_hi, k, valid, m, l, acc, scale, BLOCK_H, BLOCK_N)
        else:
            m, l, acc = _online_step(q_hi, q_mid, q_lo, k, valid, m, l, acc, scale, BLOCK_H, BLOCK_N, Q_PARTS)
    for blk in tl.range(0, tl.cdiv(K, BLOCK_N), num_stages=STAGES):
        n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + i * s_is + n, mask=n < K, other=-1).to(tl.int64)
        valid = (idx >= 0) & (idx < N)  # the bound only keeps a bad index from reading out of range
        k = tl.load(kr_ptr + tl.where(valid, idx, 0)[:, None] * D + cols[None, :], mask=valid[:, None], other=0.0)
        if TRANSPOSED:
            m, l, acc = _online_step_t(q_hi, k, valid, m, l, acc, scale, BLOCK_H, BLOCK_N)
        else:
            m, l, acc = _online_step(q_hi, q_mid, q_lo, k, valid, m, l, acc, scale, BLOCK_H, BLOCK_N, Q_PARTS)
    if TRANSPOSED:
        acc = tl.trans(acc)
    top = tl.maximum(m, sink)  # = m, which started at the sink: the decode kernel's merge of one split
    w = tl.exp(m - top)
    out = (acc * w[:, None]) / (l * w + tl.exp(sink - top))[:, None]
    _store(out_ptr + (i * H + heads)[:, None] * D + cols[None, :], out, head_ok[:, None], BF16)


@triton.jit
def _online_step_t(qt, k, valid, m, l, acc_t, scale, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    """``fused._online_step`` of a bf16 query with the keys on the dots' M side: the query
    transposed [D, BLOCK_H], the scores S^T = K Q^T [BLOCK_N, BLOCK_H] and the weighted values
    O^T [D, BLOCK_H] += V^T P^T, the probabilities' three parts summed in the same order."""
    s = _bf16_dot(k, qt, tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32))
    s = tl.where(valid[:, None], s * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 0))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[None, :])
    l = l * alpha + tl.sum(p, 0)
    p_hi, p_mid, p_lo = _bf16_parts(p, 3)
    kt = tl.trans(k)
    acc_t = _bf16_dot(kt, p_lo, acc_t * alpha[None, :])
    acc_t = _bf16_dot(kt, p_mid, acc_t)
    return m_new, l, _bf16_dot(kt, p_hi, acc_t)


ROW_BYTES = {"window": lambda D: D + D // 32, "record": lambda D: D // 2 + D // 16, "index": lambda D: D // 2 + D // 32}


def decoded_rows(rows: torch.Tensor, D: int, fmt: str) -> torch.Tensor:
    """uint8 rows [R, bytes] of ``fmt`` ("window", "record", "index") -> bf16 [R, D]."""
    assert rows.dtype == torch.uint8 and rows.stride(-1) == 1 and rows.shape[1] == ROW_BYTES[fmt](D)
    R = rows.shape[0]
    out = torch.empty(R, D, dtype=torch.bfloat16, device=rows.device)
    if R:
        _decode_rows_kernel[(triton.cdiv(R, BLOCK_R),)](rows, out.view(torch.int16), R, rows.stride(0),
                                                        FMT=fmt, D=D, BLOCK_R=BLOCK_R, num_warps=4)
    return out


def sparse_prefill(q, window, window_pos, records, record_idx, sink, scale: float,
                   out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """See ``model.kernels.sparse_prefill``; ``records`` / ``record_idx`` both given or both None."""
    S, H, D = q.shape
    span = window.shape[0] - S
    assert D >= 64 and D & (D - 1) == 0, f"head_dim {D} must be a power of two >= 64"
    assert window_pos.shape == (span + S,) and sink.shape == (H,) and out_dtype in (torch.float32, torch.bfloat16)
    if records is None or record_idx is None or record_idx.shape[1] == 0 or records.shape[0] == 0:
        keys, record_idx = q.new_empty(1, D, dtype=torch.bfloat16), q.new_empty(S, 0, dtype=torch.long)
    else:
        keys = decoded_rows(records, D, "record")
    assert record_idx.shape[0] == S
    q, record_idx = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, record_idx))
    out = torch.empty(S, H, D, dtype=out_dtype, device=q.device)
    bf16 = out_dtype == torch.bfloat16
    wide = wide_form(H, q.dtype)
    block_h = WIDE_H if wide else BLOCK_H
    _prefill_kernel[(S, triton.cdiv(H, block_h))](
        q, decoded_rows(window, D, "window"), window_pos.contiguous(), keys, record_idx, sink.contiguous(),
        out.view(torch.int16) if bf16 else out, H, span, keys.shape[0], record_idx.shape[1], float(scale),
        q.stride(0), q.stride(1), record_idx.stride(0), D=D, BLOCK_H=block_h, BLOCK_N=BLOCK_N,
        Q_PARTS=1 if q.dtype == torch.bfloat16 else 3, BF16=bf16, STAGES=STAGES, TRANSPOSED=wide,
        num_warps=WIDE_WARPS if wide else WARPS)
    return out


def wide_form(heads: int, q_dtype: torch.dtype) -> bool:
    """Whether a prefill of ``heads`` heads and this query dtype takes the wide form (``WIDE_H``)."""
    return heads >= WIDE_H and q_dtype == torch.bfloat16


# ----------------------------------------------------------------------------- index scores

INDEX_ROWS = 64  # rows of a score program's dot: queries x heads (4 x 16 at `small`, 1 x 64 at V4.1-Flash)
INDEX_BLOCK_N = 64  # keys a step of a program's loop
# steps a program: its queries' tile read once for INDEX_LOOP x INDEX_BLOCK_N keys. One H100, 2026-12-07,
# `small`'s 8,192-query chunk against a 32K / 128K context's keys (kernel_sweep.py --only index-prefill,
# bf16 queries): 3,253 -> 1,599 / 14,744 -> 7,488 us against a program a block of keys (INDEX_LOOP 1),
# which left each program's tile loads and the launch of ~2M programs at 128K to dominate its 1 MFLOP
INDEX_LOOP = 8
INDEX_WARPS = 4
INDEX_STAGES = 2  # software pipelining of the loop: the next steps' keys loaded during this one


@triton.jit(do_not_specialize=["S", "N"])
def _index_kernel(q_ptr, w_ptr, key_ptr, pos_ptr, out_ptr, S, N, ratio, head_scale, w_scale, s_qs, s_qh, s_ws, s_os,
                  HI: tl.constexpr, DI: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_Q: tl.constexpr,
                  BLOCK_N: tl.constexpr, LOOP: tl.constexpr, Q_PARTS: tl.constexpr, STAGES: tl.constexpr):
    """Scores of BLOCK_Q queries against LOOP x BLOCK_N keys (bf16 [N, DI]), BLOCK_N a step:
    each query's heads' dots as one [BLOCK_Q x BLOCK_HI, DI] x [DI, BLOCK_N] product, ReLU,
    weighted by w · w_scale and summed over the heads; -inf where a query does not see the
    key ((position + 1) // ratio keys are visible). The queries' tile is read once; the steps
    past the last key any of them sees are stored as -inf without reading."""
    t = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    t_ok = t < S
    first = tl.program_id(1) * (LOOP * BLOCK_N)
    limit = (tl.load(pos_ptr + t, mask=t_ok, other=-1) + 1) // ratio
    seen = tl.minimum(tl.max(limit, 0), N) - first  # keys from ``first`` that some query sees
    steps = tl.minimum(tl.maximum(tl.cdiv(seen, BLOCK_N), 0), LOOP)
    if steps > 0:
        r = tl.arange(0, BLOCK_Q * BLOCK_HI)
        tq = (tl.program_id(0) * BLOCK_Q + r // BLOCK_HI).to(tl.int64)
        h = r % BLOCK_HI
        ok = (tq < S) & (h < HI)
        cols = tl.arange(0, DI)
        q = tl.load(q_ptr + tq[:, None] * s_qs + h[:, None] * s_qh + cols[None, :], mask=ok[:, None], other=0.0)
        q_hi, q_mid, q_lo = _bf16_parts(q.to(tl.float32), Q_PARTS)
        w = tl.load(w_ptr + tq * s_ws + h, mask=ok, other=0.0).to(tl.float32) * w_scale
        for b in tl.range(0, steps, num_stages=STAGES):
            n = first + b * BLOCK_N + tl.arange(0, BLOCK_N)
            k = tl.load(key_ptr + n.to(tl.int64)[:, None] * DI + cols[None, :], mask=(n < N)[:, None], other=0.0)
            s = _parts_dot(q_hi, q_mid, q_lo, tl.trans(k), tl.zeros([BLOCK_Q * BLOCK_HI, BLOCK_N], tl.float32),
                           Q_PARTS)
            heads = tl.reshape(tl.maximum(s, 0.0) * head_scale * w[:, None], (BLOCK_Q, BLOCK_HI, BLOCK_N))
            visible = (n[None, :] < limit[:, None]) & (n < N)[None, :]
            score = tl.where(visible, tl.sum(heads, 1), float("-inf"))
            tl.store(out_ptr + t.to(tl.int64)[:, None] * s_os + n[None, :], score,
                     mask=t_ok[:, None] & (n < N)[None, :])
    for b in range(steps, LOOP):  # no query sees these keys
        n = first + b * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + t.to(tl.int64)[:, None] * s_os + n[None, :],
                 tl.full([BLOCK_Q, BLOCK_N], float("-inf"), tl.float32), mask=t_ok[:, None] & (n < N)[None, :])


def index_scores(q, weights, keys, pos, ratio: int, head_scale: float, weight_scale: float = 1.0) -> torch.Tensor:
    """See ``model.kernels.prefill_index_scores``: q [S, HI, DI], weights [S, HI], keys uint8
    [N, DI / 2 + DI / 32], pos [S] -> [S, N] fp32."""
    S, HI, DI = q.shape
    N = keys.shape[0]
    assert DI >= 64 and DI & (DI - 1) == 0 and weights.shape == (S, HI) and pos.shape == (S,) and ratio >= 1
    out = torch.empty(S, N, dtype=torch.float32, device=q.device)
    if N == 0 or S == 0:
        return out
    block_hi = max(16, triton.next_power_of_2(HI))
    block_q = max(1, INDEX_ROWS // block_hi)
    q, weights = q.contiguous(), weights.contiguous()
    _index_kernel[(triton.cdiv(S, block_q), triton.cdiv(N, INDEX_LOOP * INDEX_BLOCK_N))](
        q, weights, decoded_rows(keys, DI, "index"), pos.contiguous(), out, S, N, int(ratio), float(head_scale),
        float(weight_scale), q.stride(0), q.stride(1), weights.stride(0), out.stride(0), HI=HI, DI=DI,
        BLOCK_HI=block_hi, BLOCK_Q=block_q, BLOCK_N=INDEX_BLOCK_N, LOOP=INDEX_LOOP,
        Q_PARTS=1 if q.dtype == torch.bfloat16 else 3, STAGES=INDEX_STAGES, num_warps=INDEX_WARPS)
    return out
