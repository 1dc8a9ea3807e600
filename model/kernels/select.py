"""Top-k of a decode step's index scores by a radix select over many programs, not a sort.

Owns ``topk_rows(scores, k, rows=None, width=None)``: for each row of ``scores`` [R, n]
(fp32, -inf = not a candidate) the positions of its ``k`` largest scores (or ``rows``' entries
at them), ties to the lower position as the model's ``stable_topk`` breaks them,
-inf never chosen; written in ascending order, then -1 up to ``width``. Its twin is
``model.kernels.reference.topk_rows_ref`` (torch's stable sort), equal to it element for
element (``tests/test_select_kernel.py``).

Each score becomes an int32 key in the same order (the float's bits, negatives' magnitude
bits flipped, -0.0 as +0.0). A row is cut into slices of 1K-4K scores (:func:`_slice`), one
program each, and four launches of :func:`_pass_kernel` build the k-th largest key 8 bits at
a time: every program adds the 256-bin histogram of its keys that share the bits found so far
into the row's (atomics), and the row's last program to finish (an acq_rel counter) reads it
and picks the next digit. The fourth pass's programs also keep their own histograms, from
which its last program works out, for every slice, how many of its keys lie above the k-th,
how many ties it may take (the first ones in position order, until k) and so where its
choice starts in the output. A fifth launch, :func:`_write_kernel`, writes each slice's
choice there: in ascending order, and the same on every run whatever order the programs ran
in. Six launches with the zeroing of the counters, each a few µs, where torch's sort of a row
took ~8: on the H200 (2026-12-03, 4789f0a, a graph of 20 calls at batch 1) 15.2 / 17.4 / 27.2 µs at
2K / 16K / 128K scores where the sort took 23.3 / 53.6 / 54.1, and at batch 16 69 µs at 128K
where it took 190. Three passes of 12, 12 and 8 bits took 50-58 µs at 2K (4,096-bin
histograms: 255 registers). Rows of any length; k up to n.

Does not own: what the scores are (``model.kernels.fused.indexer_scores``), the candidate
pool's blocks or the choice of kernel or twin (``model.kernels``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.kernels.fused import _chain, chained

# the candidate pool (its blocks' scores, their top-k and the pool's rows: ~50 µs of small launches at
# `small`, 128K, on the H200; 2026-12-04, 3097e7e) made on a side stream beside its source layer's own top-k and
# the layers after it, up to the first that reads it (``model.decode_step._select_step``)
POOL_BESIDE = True
SELECT_SLICE = 0  # scores a program reads, one slice of a row; 0: by the row's length (_slice)
SELECT_WARPS = 8
SELECT_QUERY = 16  # slices whose histograms the last program reads at a time
SIGN = tl.constexpr(-2147483648)  # the sign bit: key ^ SIGN orders as unsigned bits, the digits' order
# int32s a row takes of ``sync`` (zeroed each call): 4 histograms of 256, then 4 counters, then the state
COUNTERS, STATE, SYNC_ROW = tl.constexpr(4 * 256), tl.constexpr(4 * 256 + 4), tl.constexpr(4 * 256 + 8)
WORK_SLICE = tl.constexpr(259)  # int32s a slice takes of ``work``: its last digit's 256 bins, above, offset, take


@triton.jit
def _order_keys(x):
    """fp32 -> int32 keys whose signed order is the floats' (-0.0 is +0.0, on the bits: a
    compiler may fold a float select of zeros; no NaNs come)."""
    b = x.to(tl.int32, bitcast=True)
    b = tl.where((b & 0x7FFFFFFF) == 0, 0, b)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _slice_keys(s_ptr, r, prog, n, s_s, SLICE: tl.constexpr):
    """This program's positions, their keys, and which of them are candidates (not -inf)."""
    i = prog * SLICE + tl.arange(0, SLICE)
    x = tl.load(s_ptr + r * s_s + i, mask=i < n, other=float("-inf"))
    return i, _order_keys(x), (i < n) & (x != float("-inf"))


@triton.jit
def _slice_offsets(phist_ptr, above_ptr, off_ptr, take_ptr, P, d, ties_wanted, QB: tl.constexpr):
    """For each slice q of a row (its ``P`` histograms of the last digit at ``phist_ptr``, its
    counts of keys above the k-th one's top 24 bits at ``above_ptr``): ``take`` = how many of
    its keys equal to the k-th it keeps (the first ones, until ``ties_wanted`` over the slices
    before it), ``off`` = where its choice starts in the output (the choices before it)."""
    bins = tl.arange(0, 256)
    run_sel = tl.zeros([], dtype=tl.int32)
    run_tie = tl.zeros([], dtype=tl.int32)
    q0 = 0
    while q0 < P:
        q = q0 + tl.arange(0, QB)
        q0 += QB
        live = q < P
        ph = tl.load(phist_ptr + q[:, None] * 256 + bins[None, :], mask=live[:, None], other=0,
                     cache_modifier=".cg")
        above = tl.load(above_ptr + q, mask=live, other=0, cache_modifier=".cg")
        above += tl.sum(tl.where(bins[None, :] > d, ph, 0), 1)
        tie = tl.sum(tl.where(bins[None, :] == d, ph, 0), 1)
        before = run_tie + tl.cumsum(tie, 0) - tie
        take = tl.minimum(tl.maximum(ties_wanted - before, 0), tie)
        sel = above + take
        tl.store(off_ptr + q, run_sel + tl.cumsum(sel, 0) - sel, mask=live)
        tl.store(take_ptr + q, take, mask=live)
        run_sel += tl.sum(sel, 0)
        run_tie += tl.sum(tie, 0)


@triton.jit(do_not_specialize=["n", "k", "s_s", "P"])
def _pass_kernel(s_ptr, sync_ptr, work_ptr, n, k, s_s, P,
                 PASS: tl.constexpr, SLICE: tl.constexpr, QB: tl.constexpr, PDL: tl.constexpr = False):
    """One 8-bit digit of each row's k-th largest key (the module docstring). ``sync`` per row
    (zeroed): 4 histograms of 256, 4 counters, the state (prefix bits found, keys still to take
    among those sharing them, the row's choice in all); ``work`` per row: P histograms of the
    last digit, then P counts above, P offsets, P ties to take."""
    _chain(PDL)
    prog = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    bins = tl.arange(0, 256)
    shift: tl.constexpr = 24 - 8 * PASS
    sync = sync_ptr + r * SYNC_ROW
    state = sync + STATE
    i, key, live = _slice_keys(s_ptr, r, prog, n, s_s, SLICE)
    u = key ^ SIGN
    prefix = tl.zeros([], dtype=tl.int32)
    if PASS > 0:
        prefix = tl.load(state)
        # arithmetic shifts of both sides: equal exactly when the bits above this digit are
        match = live & ((u >> (shift + 8)) == (prefix >> (shift + 8)))
    else:
        match = live
    digit = tl.where(match, (u >> shift) & 255, 0)
    hist = tl.histogram(digit, 256) - tl.where(bins == 0, SLICE - tl.sum(match.to(tl.int32), 0), 0)
    tl.atomic_add(sync + PASS * 256 + bins, hist, mask=hist > 0, sem="relaxed")
    phist = work_ptr + r * P * WORK_SLICE
    if PASS == 3:  # this slice's own last digits, and its keys above the k-th whatever that digit is
        tl.store(phist + prog * 256 + bins, hist)
        above = live & ((key >> 8) > ((prefix ^ SIGN) >> 8))
        tl.store(phist + P * 256 + prog, tl.sum(above.to(tl.int32), 0))
    tl.debug_barrier()
    if tl.atomic_add(sync + COUNTERS + PASS, 1, sem="acq_rel") == P - 1:  # the row's last program here
        total = tl.atomic_add(sync + PASS * 256 + bins, 0, sem="relaxed")  # read where the atomics landed
        if PASS == 0:
            want = tl.minimum(tl.sum(total, 0), k)
            tl.store(state + 2, want)
        else:
            want = tl.load(state + 1, cache_modifier=".cg")
        at_least = tl.sum(total, 0) - tl.cumsum(total, 0) + total  # keys with this digit or a larger one
        d = tl.sum((at_least >= want).to(tl.int32), 0) - 1  # falls with the digit; 255 where want is 0
        want -= tl.sum(tl.where(bins > d, total, 0), 0)
        tl.store(state, prefix | (d << shift))
        tl.store(state + 1, want)
        if PASS == 3:
            _slice_offsets(phist, phist + P * 256, phist + P * 257, phist + P * 258, P, d, want, QB)


@triton.jit(do_not_specialize=["n", "width", "s_s", "s_r", "s_o", "P"])
def _write_kernel(s_ptr, rows_ptr, out_ptr, sync_ptr, work_ptr, n, width, s_s, s_r, s_o, P,
                  HAS_ROWS: tl.constexpr, SLICE: tl.constexpr, PDL: tl.constexpr = False):
    """Each slice's choice at its offset, in position order; the first slice fills -1 after
    the row's choice up to ``width``."""
    _chain(PDL)
    prog = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    state = sync_ptr + r * SYNC_ROW + STATE
    phist = work_ptr + r * P * WORK_SLICE
    i, key, live = _slice_keys(s_ptr, r, prog, n, s_s, SLICE)
    kth = tl.load(state) ^ SIGN
    tie = live & (key == kth)
    take = live & ((key > kth) | (tie & (tl.cumsum(tie.to(tl.int32), 0) <= tl.load(phist + P * 258 + prog))))
    at = tl.load(phist + P * 257 + prog) + tl.cumsum(take.to(tl.int32), 0) - 1
    if HAS_ROWS:
        val = tl.load(rows_ptr + r * s_r + i, mask=take, other=-1)
    else:
        val = i.to(tl.int64)
    tl.store(out_ptr + r * s_o + at, val, mask=take)
    if prog == 0:
        total = tl.load(state + 2)
        start = 0
        while start < width:
            j = start + tl.arange(0, SLICE)
            start += SLICE
            tl.store(out_ptr + r * s_o + j, tl.full([SLICE], -1, tl.int64), mask=(j >= total) & (j < width))


def _slice(n: int) -> int:
    """Scores a program takes of a row of ``n``: 1,024, or more (a power of two, at most 4,096)
    where a row would need more than 64 programs (H200, 2026-12-03, 4789f0a, a graph of 20 calls at
    batch 1: slices of 1,024 took 15.2 / 17.4 µs at 2K / 16K scores where 2,048 took 19.6 /
    20.6; at 128K 2,048 took 27.2, 1,024 and 4,096 more; at batch 16 4,096 did best at 64K+)."""
    return SELECT_SLICE or min(4096, max(1024, triton.next_power_of_2(triton.cdiv(n, 64))))


def topk_rows(scores: torch.Tensor, k: int, rows: torch.Tensor | None = None, width: int | None = None) -> torch.Tensor:
    """See the module docstring: int64 [R, width] (``width`` None: min(k, n))."""
    R, n = scores.shape
    k = min(k, n)
    width = k if width is None else width
    assert scores.dtype == torch.float32 and width >= k
    scores = scores.contiguous()
    if rows is not None:
        assert rows.shape == scores.shape and rows.dtype == torch.int64
        rows = rows.contiguous()
    out = torch.empty(R, width, dtype=torch.int64, device=scores.device)
    if R == 0 or width == 0:
        return out
    if n == 0:
        return out.fill_(-1)
    slice_ = _slice(n)
    P = triton.cdiv(n, slice_)
    sync = torch.zeros(R, SYNC_ROW.value, dtype=torch.int32, device=scores.device)
    work = torch.empty(R, P * WORK_SLICE.value, dtype=torch.int32, device=scores.device)
    pdl = chained(scores)
    for p in range(4):
        _pass_kernel[(P, R)](scores, sync, work, n, k, scores.stride(0), P, PASS=p, SLICE=slice_,
                             QB=SELECT_QUERY, num_warps=SELECT_WARPS, **pdl)
    _write_kernel[(P, R)](scores, scores if rows is None else rows, out, sync, work, n, width, scores.stride(0),
                          0 if rows is None else rows.stride(0), out.stride(0), P, HAS_ROWS=rows is not None,
                          SLICE=slice_, num_warps=SELECT_WARPS, **pdl)
    return out
