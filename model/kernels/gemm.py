"""Prefill GEMMs on weights held as the checkpoint stores them, dequantised in registers.

``packed_matmul(x, w)``: ``x`` [M, K] (bf16) times a :class:`Packed` weight [N, K] (FP8 e4m3
with ue8m0 blocks, or FP4 e2m1 pairs with 1 x 32 ue8m0 scales) -> [M, N] in x's dtype.
``grouped_fp4(x, ends, w, s, ...)``: rows sorted by expert, expert e's at [ends[e-1], ends[e]),
each times its expert's FP4 weight of a stack [E, N, K / 2]; with a second stack and the rows'
route weights (``paired``), the experts' up projection whole: ``weight * swiglu(x w1^T, x w3^T)``
with the SwiGLU's clamps, one launch for both products.

W8A16: each program decodes its weight tile to the activations' dtype (exact: an e4m3 or e2m1
value times a power of two is a bf16 value) and feeds the tensor cores with it; the sums are
fp32 and the output is rounded once. FP4 weights against bf16 rows go through Triton's
microscaling dot (``tl.dot_scaled``: e2m1 with a ue8m0 scale per 1 x 32 is its MXFP4), whose
widening on sm_90 ran 1.34-1.36x our own decode at V4.1-Flash's expert shapes (below). The
twins (``model.linear.Linear.dense_weight`` then ``F.linear``; ``model.moe.GroupedLinear.dense``
then ``torch._grouped_mm``) dequantise the same values first, so the two agree to the
summation order. Why not W8A8: V4.1's FP8 blocks are 32 x 32, and an activation quantised per
1 x 32 would need its partial sums rescaled every 32 inputs (as much work on the CUDA cores as
the tensor cores' own), and would round the activations this project's CPU reference keeps in
bf16. The official V4 kernels do quantise them to FP8 for the FP4 experts (ARCHITECTURE.md 2.8);
written in Triton, three such forms ran slower than this W4A16 on sm_90
(docs/fp4-experts-on-fp8-tensor-cores.md).

A grouped GEMM's programs each take one block of one expert's rows (the ``tiles`` map, made on
the device by :func:`expert_tiles`, so nothing is read on the host): at most cdiv(P, BLOCK_M) + E
blocks for P rows of E experts, the unused ones exit at once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.kernels.fused import _bf16_dot, _store
from model.kernels.moe import _fp4_tile, _swiglu, _weight_at
from model.kernels.packed import Packed

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), the best of a sweep on an H100 (2026-12-05, the
# V4.1-Flash shapes; docs/benchmarks.md): 4 warps, where 8 ran at a third of the rate. At 8192
# rows the dense tiles reached 0.3-0.45x the rate of cuBLAS bf16 on floats already there, and
# from 64 rows on, summed over the shapes, decoding the weight once (``model.kernels.dequant``)
# then cuBLAS took less time: so from DEQUANT_ROWS rows ``kernels.packed_matmul`` does that.
# FEW_ROWS_TILE for at most FEW_ROWS rows (a batch's decode step past the GEMV's rows: narrow
# programs, so that a layer's weight is read by many of them). The grouped up projection
# (paired) ran 132 TFLOP/s at 128-wide K against 115 at 64 (8192 tokens, H100). With the
# microscaling dot (2026-12-06, H100, bf16 matmul 809 TFLOP/s, 384 experts, top 6, 8192 tokens;
# 12 tiles swept): the up projection 192 TFLOP/s at 64 x 128 x 64 (119 at K 128), the down 203
# (198 at 128 x 256 x 64, 8 warps); our decode at its best tiles 141 and 151 the same day
DENSE_TILE = (128, 128, 64, 4, 3)
GROUPED_TILE = PAIRED_TILE = (64, 128, 64, 4, 3)  # alone; w1 with w3
FEW_ROWS, FEW_ROWS_TILE = 16, (16, 32, 128, 4, 3)
DEQUANT_ROWS = 64


@triton.jit
def _weight_tile(w_at, s_at, n, n_ok, k0, K, FMT: tl.constexpr, SR: tl.constexpr, SC: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """Rows ``n`` x inputs [k0, k0 + BLOCK_K) of a packed weight as fp32 (0 outside)."""
    if FMT == "fp4":
        return _fp4_tile(w_at, s_at, n[:, None], n_ok[:, None], k0, K, BLOCK_K)
    kk = k0 + tl.arange(0, BLOCK_K)
    return _weight_at(w_at, s_at, n[:, None], kk[None, :], n_ok[:, None] & (kk < K)[None, :], K, FMT, SR, SC)


@triton.jit
def _fp4_bytes(w_at, s_at, n, n_ok, k0, K, BLOCK_K: tl.constexpr):
    """Rows ``n`` x inputs [k0, k0 + BLOCK_K) of an FP4 weight as stored: its bytes [len(n),
    BLOCK_K / 2] and 1 x 32 scale bytes [len(n), BLOCK_K / 32] (0 and 2^0 past K or N)."""
    j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    b = tl.load(w_at + n[:, None] * (K // 2) + j[None, :], mask=n_ok[:, None] & (j < K // 2)[None, :], other=0)
    c = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    s = tl.load(s_at + n[:, None] * (K // 32) + c[None, :], mask=n_ok[:, None] & (c < K // 32)[None, :], other=127)
    return b, s


@triton.jit
def _fp4_dot(x, b, s, acc):
    """``acc + x @ W^T`` for bf16 ``x`` and an FP4 tile as its bytes and 1 x 32 scale bytes
    (:func:`_fp4_bytes`): Triton's microscaling dot (e2m1 with ue8m0 per 32, the even input in
    the low nibble, as the checkpoint packs them), which on sm_90 widens the weight to bf16 in
    registers for the bf16 tensor cores — the same exact values and fp32 sums as decoding it
    here, 1.3x the rate (below). Scales are finite (byte 255 is never packed), so no NaN checks."""
    return tl.dot_scaled(x, None, "bf16", tl.trans(b), s, "e2m1", acc, fast_math=True)


@triton.jit
def _fp4_sums(x_at, row_ok, w_at, s_at, v_at, vs_at, n, n_ok, K, PAIRED: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The FP4 channel loop of ``_gemm_kernel`` on bf16 rows: x @ W^T (and x @ V^T, PAIRED) as
    [BLOCK_M, BLOCK_N] fp32."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_at + kk[None, :], mask=row_ok[:, None] & (kk < K)[None, :], other=0.0)
        bw, sw = _fp4_bytes(w_at, s_at, n, n_ok, k0, K, BLOCK_K)
        acc = _fp4_dot(x, bw, sw, acc)
        if PAIRED:
            bv, sv = _fp4_bytes(v_at, vs_at, n, n_ok, k0, K, BLOCK_K)
            acc3 = _fp4_dot(x, bv, sv, acc3)
    return acc, acc3


@triton.jit
def _dot(a, b, acc):
    """``acc + a @ b`` in fp32: bf16 operands on the tensor cores (fp32 ones, the CPU's, in IEEE fp32)."""
    if a.dtype == tl.bfloat16:
        return _bf16_dot(a, b, acc)
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, w_sc, v_ptr, v_sc, route_ptr, out_ptr, tiles_ptr, ends_ptr, src_ptr, M, N, K,
                 limit, W_STRIDE, S_STRIDE, X_STRIDE, GROUP_N, FMT: tl.constexpr, SR: tl.constexpr,
                 SC: tl.constexpr, GROUPED: tl.constexpr, PAIRED: tl.constexpr, CLAMP: tl.constexpr,
                 BF16: tl.constexpr, GATHER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """out[rows, n] = x[rows] @ W[n]^T for one block of rows x BLOCK_N outputs; grouped: the
    block's expert's weight (stack stride W_STRIDE elements, S_STRIDE scales); paired: the
    route weight times the SwiGLU of the products with W and V; GATHER: row r's inputs are x's
    row src[r]. x's rows are X_STRIDE apart, and outputs [g * GROUP_N, (g + 1) * GROUP_N) read
    its inputs [g * K, (g + 1) * K) (a grouped projection; one group: GROUP_N = N)."""
    t = tl.program_id(0)
    if GROUPED:
        g = tl.load(tiles_ptr + 2 * t)
        r0 = tl.load(tiles_ptr + 2 * t + 1)
        r_end = tl.load(ends_ptr + tl.maximum(g, 0))
    else:
        g = t * 0  # one weight: a tensor, as the grouped form's
        r0 = t * BLOCK_M
        r_end = M
    if g >= 0:
        rows = r0 + tl.arange(0, BLOCK_M)
        row_ok = rows < r_end
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        w_at, s_at = w_ptr + g.to(tl.int64) * W_STRIDE, w_sc + g.to(tl.int64) * S_STRIDE
        v_at, vs_at = v_ptr + g.to(tl.int64) * W_STRIDE, v_sc + g.to(tl.int64) * S_STRIDE
        src = rows
        if GATHER:
            src = tl.load(src_ptr + rows, mask=row_ok, other=0)
        x_at = x_ptr + src[:, None].to(tl.int64) * X_STRIDE + (tl.program_id(1) * BLOCK_N) // GROUP_N * K
        if FMT == "fp4" and BF16:
            acc, acc3 = _fp4_sums(x_at, row_ok, w_at, s_at, v_at, vs_at, n, n_ok, K, PAIRED, BLOCK_M, BLOCK_N, BLOCK_K)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_at + kk[None, :], mask=row_ok[:, None] & (kk < K)[None, :], other=0.0)
                w = _weight_tile(w_at, s_at, n, n_ok, k0, K, FMT, SR, SC, BLOCK_K).to(x.dtype)
                acc = _dot(x, tl.trans(w), acc)
                if PAIRED:
                    v = _weight_tile(v_at, vs_at, n, n_ok, k0, K, FMT, SR, SC, BLOCK_K).to(x.dtype)
                    acc3 = _dot(x, tl.trans(v), acc3)
        if PAIRED:
            route = tl.load(route_ptr + rows, mask=row_ok, other=0.0)
            acc = route[:, None] * _swiglu(acc, acc3, limit, BF16, CLAMP)
        _store(out_ptr + rows[:, None].to(tl.int64) * N + n[None, :], acc, row_ok[:, None] & n_ok[None, :], BF16)


def _launch(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, fmt: str, block: tuple[int, int], n_out: int,
            tile: tuple[int, int, int, int, int], *, grid_m: int, tiles=None, ends=None, v=None, vs=None,
            route=None, limit: float = 0.0, groups: int = 1, src=None) -> torch.Tensor:
    block_m, block_n, block_k, warps, stages = tile
    M, K = (x.shape[0] if src is None else src.shape[0]), x.shape[1] // groups
    if groups > 1:  # a program's outputs in one group: the largest power of two of the tile's width dividing it
        block_n = min(block_n, (n_out // groups) & -(n_out // groups))
        assert block_n >= 16, f"a group of {n_out // groups} outputs"
    out = torch.empty(M, n_out, dtype=x.dtype, device=x.device)
    bf16 = x.dtype == torch.bfloat16
    grouped, paired = tiles is not None, v is not None
    dummy = out  # never read where its flag is off
    _gemm_kernel[(grid_m, triton.cdiv(n_out, block_n))](
        x, w.view(torch.uint8), s.view(torch.uint8), (v if paired else w).view(torch.uint8),
        (vs if paired else s).view(torch.uint8), route if paired else dummy, out.view(torch.int16) if bf16 else out,
        tiles if grouped else dummy, ends if grouped else dummy, dummy if src is None else src, M, n_out, K,
        float(limit), w[0].numel() if grouped else 0, s[0].numel() if grouped else 0, x.stride(0), n_out // groups,
        FMT=fmt, SR=block[0], SC=block[1], GROUPED=grouped, PAIRED=paired, CLAMP=limit > 0, BF16=bf16,
        GATHER=src is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages)
    return out


def packed_matmul(x: torch.Tensor, w: Packed, tile: tuple[int, int, int, int, int] | None = None,
                  groups: int = 1) -> torch.Tensor:
    """``F.linear(x, w.dense(x.dtype))`` for x [M, K], the weight decoded in registers; with
    ``groups`` g, x [M, g * K] against w [g * O, K]: output group i of input group i (the
    attention's ``wo_a``, ``model.linear.grouped_linear``)."""
    tile = tile or (FEW_ROWS_TILE if x.shape[0] <= FEW_ROWS else DENSE_TILE)
    x = x if x.stride(-1) == 1 else x.contiguous()
    return _launch(x, w.data, w.scale, w.fmt, w.scale_block(), w.shape[0], tile,
                   grid_m=triton.cdiv(x.shape[0], tile[0]), groups=groups)


def expert_tiles(ends: torch.Tensor, rows: int, block_m: int) -> torch.Tensor:
    """int32 [cdiv(rows, block_m) + E, 2]: for each program its expert (-1: none) and first row,
    every expert's rows cut into blocks of ``block_m``, experts in order; on the device."""
    ends = ends.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    blocks = (ends - starts + block_m - 1) // block_m
    last = blocks.cumsum(0)
    t = torch.arange(triton.cdiv(rows, block_m) + ends.shape[0], device=ends.device)
    e = torch.searchsorted(last, t, right=True)
    inside = e < ends.shape[0]
    e_ = e.clamp(max=ends.shape[0] - 1)
    first_row = starts[e_] + (t - (last[e_] - blocks[e_])) * block_m
    return torch.stack([torch.where(inside, e, -1), first_row], 1).to(torch.int32).contiguous()


def grouped_fp4(x: torch.Tensor, ends: torch.Tensor, w: torch.Tensor, s: torch.Tensor, *,
                paired: tuple[torch.Tensor, torch.Tensor] | None = None, route: torch.Tensor | None = None,
                limit: float = 0.0, rows: torch.Tensor | None = None,
                tile: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """Rows x [P, K] sorted by expert (expert e's at [ends[e-1], ends[e]), rows past ends[-1]
    left unwritten) times the FP4 stack ``w`` [E, N, K / 2] with scales ``s`` [E, N, K / 32]
    -> [P, N] in x's dtype; ``paired`` (w3, its scales) with ``route`` [P] fp32: ``route *
    swiglu(x w^T, x w3^T, limit)`` instead. With ``rows`` [P] (int), the rows are ``x[rows]``
    of an unsorted x [T, K], read where they lie rather than gathered first."""
    tile = tile or (GROUPED_TILE if paired is None else PAIRED_TILE)
    n_rows = x.shape[0] if rows is None else rows.shape[0]
    tiles = expert_tiles(ends, n_rows, tile[0])
    v, vs = paired if paired is not None else (None, None)
    return _launch(x.contiguous(), w, s, "fp4", (1, 32), w.shape[1], tile, grid_m=tiles.shape[0], tiles=tiles,
                   ends=ends.to(torch.int32), v=v, vs=vs, route=None if route is None else route.float().contiguous(),
                   limit=limit, src=None if rows is None else rows.to(torch.int32).contiguous())
