"""Triton GEMV for a decode step's linear layers: a few rows against a weight, the weight
streamed once by many programs, where cuBLAS runs one small GEMM a layer that reads its
2-8 MB at a fraction of the copy rate (`small`: ~5 µs a call, ~5 calls a layer).

Owns ``gemv(x, *weights, groups=1)``: ``F.linear(x, w)`` for each weight (one launch for
all of them, when they share ``x``: the query's and the K=V latent's projections of a
layer), or with ``groups`` > 1 the grouped projection of ``Attention._grouped_wo_a``: group
g of the output reads only group g of ``x``'s channels. Products in fp32, summed in another
order than cuBLAS's (so the outputs agree to rounding), rounded to ``x``'s dtype as the GEMM
rounds (bf16: nearest even, on the bits).

Off by default (``DSAGENT_GEMV=1`` turns it on): on the H200, with the tiles below, a
`small` decode step at 4K took 6.39 ms with it and 6.17 ms without (``--paths``, one run).
``kernel_sweep.py --only gemv`` timed a layer's six calls at 31.8 µs against cuBLAS's 32.4,
and 25.2 µs with 512 channels and 8 warps; but it replayed 20 calls of one weight, which the
50 MB L2 then holds, so it flattered both sides against a step that streams every layer's
(it now gives each call its own copy of the weights).

Does not own: when it runs (``model.kernels.gemv_runs``), or which layers use it
(``model.model``). Imported only when Triton is importable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.kernels.fused import _chain, _store, chained

# channels per load and warps of a program; a program's output rows are the most (up to
# BLOCK_O_MAX) that still leave MIN_PROGRAMS programs a weight. Untuned guesses, swept by
# scripts/kernel_sweep.py --only gemv
GEMV_BLOCK_D, GEMV_WARPS = 256, 4
MIN_PROGRAMS, BLOCK_O_MAX = 256, 32


@triton.jit
def _rows_times_x(x_row, w_ptr, out_row, o0, O, DG, BLOCK_O: tl.constexpr, BLOCK_D: tl.constexpr,
                  BF16: tl.constexpr):
    """Outputs [o0, o0 + BLOCK_O) of one row: weight rows [O, DG] against ``x_row``'s DG channels."""
    o = o0 + tl.arange(0, BLOCK_O)
    o_ok = o < O
    acc = tl.zeros([BLOCK_O], dtype=tl.float32)
    for d0 in range(0, DG, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_ok = d < DG
        x = tl.load(x_row + d, mask=d_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + o[:, None].to(tl.int64) * DG + d[None, :], mask=o_ok[:, None] & d_ok[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], 1)
    _store(out_row + o, acc, o_ok, BF16)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, w2_ptr, out2_ptr, O, O2, D, DG, OG, P1,
                 BLOCK_O: tl.constexpr, BLOCK_O2: tl.constexpr, BLOCK_D: tl.constexpr, TWO: tl.constexpr,
                 BF16: tl.constexpr, PDL: tl.constexpr = False):
    """Program (p, n): a block of output rows of row n (the first weight's blocks, then the
    second's). Group g = rows // OG reads x's channels [g * DG, (g + 1) * DG). Each branch
    calls the helper: tensors named alike in both branches must have one shape in Triton,
    and the two weights' blocks need not."""
    _chain(PDL)
    p = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    if TWO and p >= P1:  # the second weight: no groups
        _rows_times_x(x_ptr + n * D, w2_ptr, out2_ptr + n * O2, (p - P1) * BLOCK_O2, O2, D, BLOCK_O2, BLOCK_D, BF16)
    else:  # a block never spans two groups
        _rows_times_x(x_ptr + n * D + ((p * BLOCK_O) // OG) * DG, w_ptr, out_ptr + n * O, p * BLOCK_O, O, DG,
                      BLOCK_O, BLOCK_D, BF16)


def _block_o(rows: int, most: int) -> int:
    """Output rows a program: the most (a power of two, at least 1) that leaves MIN_PROGRAMS
    programs, at most ``most``."""
    b = 1
    while b * 2 <= min(most, BLOCK_O_MAX) and rows // (b * 2) >= MIN_PROGRAMS:
        b *= 2
    return b


def gemv(x: torch.Tensor, *weights: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor, ...]:
    """``x`` [..., D] (fp32 or bf16) against one or two weights [O, D] of its dtype -> one
    output [..., O] each. With ``groups`` g (one weight [g * r, D / g]): output group j is
    weight rows [j * r, (j + 1) * r) against x's channels [j * D / g, (j + 1) * D / g)."""
    assert 1 <= len(weights) <= 2 and (groups == 1 or len(weights) == 1)
    assert x.dtype in (torch.float32, torch.bfloat16) and all(w.dtype == x.dtype and w.dim() == 2 for w in weights)
    lead, D = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, D).contiguous()
    N = rows.shape[0]
    w1 = weights[0].contiguous()
    O, DG = w1.shape
    assert D == DG * groups and O % groups == 0, (x.shape, w1.shape, groups)
    OG = O // groups
    b1 = _block_o(O, OG & -OG)  # a power of two dividing the group's rows: no block spans two groups
    bf16 = x.dtype == torch.bfloat16
    out1 = torch.empty(N, O, dtype=x.dtype, device=x.device)
    p1 = triton.cdiv(O, b1)
    if len(weights) == 2:
        w2 = weights[1].contiguous()
        assert w2.shape[1] == D
        O2 = w2.shape[0]
        b2 = _block_o(O2, BLOCK_O_MAX)
        out2 = torch.empty(N, O2, dtype=x.dtype, device=x.device)
        p2 = triton.cdiv(O2, b2)
    else:
        w2, out2, O2, b2, p2 = w1, out1, 0, 1, 0
    view = (lambda t: t.view(torch.int16)) if bf16 else (lambda t: t)
    _gemv_kernel[(p1 + p2, N)](rows, w1, view(out1), w2, view(out2), O, O2, D, DG, OG, p1,
                               BLOCK_O=b1, BLOCK_O2=b2, BLOCK_D=GEMV_BLOCK_D, TWO=len(weights) == 2, BF16=bf16,
                               num_warps=GEMV_WARPS, **chained(rows))
    outs = (out1, out2)[:len(weights)]
    return tuple(o.view(*lead, o.shape[-1]) for o in outs)
