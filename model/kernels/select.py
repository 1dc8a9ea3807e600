"""Top-k of a decode step's index scores in one launch: a radix select, not a sort.

Owns ``topk_rows(scores, k, rows=None, width=None)``: for each row of ``scores`` [R, n]
(fp32, -inf = not a candidate) the positions of its ``k`` largest scores (or ``rows``' entries
at them), ties to the lower position as the model's ``stable_topk`` breaks them,
-inf never chosen; written in ascending order, then -1 up to ``width``. Its twin is
``model.kernels.reference.topk_rows_ref`` (torch's stable sort), equal to it element for
element (``tests/test_select_kernel.py``).

One program a row walks the row five times. Each score becomes an int32 key in the same
order (the float's bits, negatives' magnitude bits flipped, -0.0 as +0.0); four passes build
the k-th largest key 8 bits at a time from 256-bin histograms of the keys that share the bits
found so far; the fifth writes, in position order, every score above that key and the first
of those equal to it until k are taken (a running count over the row's blocks). Where torch
sorted a whole row in ~8 launches (radix histogram, scan, four one-sweep passes, fills; ~45 us
at 128K records on the H200), this is one launch, and its output in position order is what
the candidate pool wants as it is. Off by default: ``model.kernels.topk_rows`` runs it only on
rows of at most ``reference.TOPK_KERNEL_MAX`` scores, which is 0 until it beats the sort and
its tests pass on a GPU.

Does not own: what the scores are (``model.kernels.fused.indexer_scores``), the candidate
pool's blocks or the choice of kernel or twin (``model.kernels``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.kernels.fused import _chain, chained

TOPK_BLOCK = 2048  # scores a program reads per step of a pass
TOPK_WARPS = 8
TOPK_BITS = 8  # digit bits a pass (H200, session 24, a graph of 20 calls: 4 bits 21.4 / 77.4 / 659 us at
# 4K / 16K / 128K scores, 8 bits 20.2 / 71.9 / 582; torch's sort 25.9 / 53.9 / 54.4)


@triton.jit
def _order_keys(x):
    """fp32 -> int32 keys whose signed order is the floats' (-0.0 is +0.0, on the bits: a
    compiler may fold a float select of zeros; no NaNs come)."""
    b = x.to(tl.int32, bitcast=True)
    b = tl.where((b & 0x7FFFFFFF) == 0, 0, b)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit(do_not_specialize=["n", "k", "width", "s_s", "s_r", "s_o"])
def _topk_kernel(s_ptr, rows_ptr, out_ptr, n, k, width, s_s, s_r, s_o,
                 HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr, PDL: tl.constexpr = False):
    _chain(PDL)
    r = tl.program_id(0).to(tl.int64)
    row = s_ptr + r * s_s
    bins = tl.arange(0, 1 << BITS)
    # the k-th largest key, built from the top digit down, in unsigned bits (key ^ sign bit)
    prefix = tl.zeros([], dtype=tl.int32)
    want = tl.zeros([], dtype=tl.int32) + k  # how many of the keys sharing prefix's bits are still to take
    for p in tl.static_range(32 // BITS):
        shift = 32 - BITS * (p + 1)
        hist = tl.zeros([1 << BITS], dtype=tl.int32)
        start = 0
        while start < n:
            i = start + tl.arange(0, BLOCK)
            start += BLOCK
            u = _order_keys(tl.load(row + i, mask=i < n, other=0.0)) ^ -2147483648
            live = i < n
            if p > 0:  # arithmetic shifts of both sides: equal exactly when the bits above are
                live = live & ((u >> (shift + BITS)) == (prefix >> (shift + BITS)))
            digit = tl.where(live, (u >> shift) & ((1 << BITS) - 1), 0)
            hist += tl.histogram(digit, 1 << BITS) - tl.where(bins == 0, BLOCK - tl.sum(live.to(tl.int32), 0), 0)
        at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # keys with this digit or a larger one
        d = tl.sum((at_least >= want).to(tl.int32), 0) - 1  # at_least falls with the digit
        want -= tl.sum(tl.where(bins > d, hist, 0), 0)
        prefix = prefix | (d << shift)

    kth = prefix ^ -2147483648
    taken = tl.zeros([], dtype=tl.int32)
    ties = tl.zeros([], dtype=tl.int32)
    start = 0
    while start < n:
        i = start + tl.arange(0, BLOCK)
        start += BLOCK
        x = tl.load(row + i, mask=i < n, other=float("-inf"))
        key = _order_keys(x)
        live = (i < n) & (x != float("-inf"))
        tie = live & (key == kth)
        take = live & ((key > kth) | (tie & (ties + tl.cumsum(tie.to(tl.int32), 0) <= want)))
        at = taken + tl.cumsum(take.to(tl.int32), 0) - 1
        if HAS_ROWS:
            val = tl.load(rows_ptr + r * s_r + i, mask=take, other=-1)
        else:
            val = i.to(tl.int64)
        tl.store(out_ptr + r * s_o + at, val, mask=take)
        taken += tl.sum(take.to(tl.int32), 0)
        ties += tl.sum(tie.to(tl.int32), 0)
    start = 0
    while start < width:
        j = start + tl.arange(0, BLOCK)
        start += BLOCK
        tl.store(out_ptr + r * s_o + j, tl.full([BLOCK], -1, tl.int64), mask=(j >= taken) & (j < width))


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
    _topk_kernel[(R,)](scores, scores if rows is None else rows, out, n, k, width, scores.stride(0),
                       0 if rows is None else rows.stride(0), out.stride(0), HAS_ROWS=rows is not None,
                       BLOCK=TOPK_BLOCK, BITS=TOPK_BITS, num_warps=TOPK_WARPS, **chained(scores))
    return out
