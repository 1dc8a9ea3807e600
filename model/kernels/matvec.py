"""Triton GEMV for a decode step's linear layers: a few rows against a weight, the weight
streamed once by many programs, where cuBLAS runs one small GEMM a layer that reads its
2-8 MB at a fraction of the copy rate (`small`: ~5 µs a call, ~5 calls a layer, ~1 TB/s).

Owns ``gemv(x, *weights, groups=1, norm=None, rope_in=None, rope_out=None, keep=False)``:
``F.linear(x, w)`` for each weight (one launch for all of them, when they share ``x``: the
query's and the K=V latent's projections of a layer), or with ``groups`` > 1 the grouped
projection of ``model.linear.grouped_linear``: group g of the output reads only group g of
``x``'s channels. Products in fp32, summed in another order than cuBLAS's (so the outputs
agree to rounding), rounded to ``x``'s dtype as the GEMM rounds (bf16: nearest even, on the
bits). The options fold the launch beside it in: ``norm`` the RMSNorm of x (the query's
``q_norm``; an mHC site's norm, with ``keep`` writing the normalised x for its other
readers), ``rope_in`` the RoPE of x's heads (the attention output's de-rotation before
``wo_a``), ``rope_out`` the RoPE of the output's heads (the query's), each rounded as its own
kernel rounds. All launches
run without FMA contraction (``unfused``), as the RoPE kernel does, so the rotations are bit
for bit ``rope_ref``'s.

How it reads (2026-12-03, 0b5cbd1): each program holds one tile of the weight — ``BLOCK_O`` whole
rows, ``TILE_BYTES`` at most — and asks for all of it in one load, *before* its dependent
launch's wait (``fused._chain``): no kernel of a decode step writes a weight, so the tile
may stream in while the kernel before runs, and every program has its whole tile in flight
at once. Then it waits, reads the rows of ``x`` and reduces, one row after another over the
tile it holds (the weight is read once whatever the batch). Inputs wider than
``BLOCK_D_MAX`` channels read the rest in chunks after the wait. The form of 2026-12-01
(9275c3a) looped over 256-channel chunks, one chunk in flight per program, and lost to cuBLAS in
a step.

Packed weights (2026-12-04; ``model.kernels.Packed``, a checkpoint's FP8 e4m3 bytes with a
ue8m0 scale per block, or FP4 e2m1 pairs with a ue8m0 scale per 1 x 32), ``FMT`` picks the decode:

- FP8 (``BLOCKS``, since 2026-12-05): the tile is held as its bytes and one scale byte per
  32-input block (``_fp8_blocks``; the tile sized by its bytes, one a weight), asked for
  before the wait and decoded after it; each block's products are summed, then times its
  scale (a power of two: exact), then the blocks summed (``_fp8_dot``). On an H200
  (2026-12-05, V4.1-Flash's FP8 shapes, one row, 20 copies cycled in a graph) 2.0-3.2x faster
  than the dequantised tile below (``wq_b`` 65.0 -> 20.7 µs, ``wo_b`` 44.7 -> 17.4); a packed
  `small` decode step 3.82 -> 3.35 ms at 4K (``bench_knobs``, ``FP8_BLOCKS``). Its sums run in
  another order than the plain kernel's: the same values to rounding.
- FP4 (and FP8 with ``FP8_BLOCKS`` off): the tile decoded in registers after the load
  (``_packed_tile``) to the fp32 values ``Linear.dense_weight`` holds, the plain tile's shape
  for x's dtype with loads as wide a thread (``VEC``, :func:`vector`), so that Triton lays it
  out in the plain tile's registers and sums it in the same order (read off the sm_90 builds
  by ``tests/test_packed_gemv.py``; bit for bit under the interpreter, yet not in fp32 on an
  H200: the tests check it to rounding).

Does not own: when it runs (``model.kernels.gemv_runs``), or which layers use it
(``model.model``). Imported only when Triton is importable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.kernels.fused import _chain, _e2m1, _rms_normed, _round, _store, _turned, _ue8m0, chained, unfused
from model.kernels.packed import Packed
from model.kernels.collapsed import Collapsed
from model.kernels.streams import _collapsed

# bytes of weight a program holds, its warps, the fewest programs a weight is cut into
# (while its rows allow), the widest input read whole. Swept by kernel_sweep.py --only gemv-sweep
TILE_BYTES, GEMV_WARPS, MIN_PROGRAMS, BLOCK_D_MAX = 16384, 4, 128, 4096
# (2026-12-03, 59331ce, a step at 128K, bench_knobs: 8 KB tiles +3.0%; the window entry made by programs of the
# query's GEMV launch rather than a launch of its own +1.8% / +1.5%: neither kept)
# (2026-12-03, ced59ff, a step at 128K, bench_knobs, two rounds, its control variant 0.977 of "all off"): the
# launch's ``maxnreg`` capping a program's registers at 168 / 128 (so that all 512 programs of an 8 MB
# weight hold their tiles at once: uncapped, the de-rotating ``wo_a`` GEMV takes 218 registers and
# 264 of its programs fit, the query's 168 and 396) 0.995 / 0.973; the layer's weights asked into the
# L2 beside the step (``cp.async.bulk.prefetch.L2`` on a stream of their own, while the chains of
# small kernels run) 0.975, then 1.025 against a control of 1.020 in four rounds — the GEMVs'
# share of the step fell 0.650 -> 0.557 ms, the prefetch kernels took it back. Neither kept.
# (2026-12-04, 505a62b: the same asks made by riders, extra programs of the attention's or its merge's launch,
# 0.999-1.42x of a step: not kept; the figures: docs/gpu-fast-path.md, "Tried and not kept")

# FP8 weights decoded by 32-input blocks, each block's sum times its scale (``_fp8_dot``), rather than
# dequantised whole into the plain tile: a knob for the step's own A/B (``bench_knobs``); off is the
# plain tile's order of sums, the bits of the plain kernel on the dequantised weight
FP8_BLOCKS = True

# (2026-12-04, dc98548: a timing probe that left x's de-rotation out read 0.979 of a step; the merge now
# de-rotates instead, ``fused.MERGE_TURNS_BACK``; the probe's code is gone, its figures in docs/gpu-fast-path.md)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, w2_ptr, out2_ptr, N, O, O2, D, DG, OG, P1,
                 nw_ptr, eps, cos_ptr, sin_ptr, S, HD, OFF, HALF, xn_ptr,
                 BLOCK_O: tl.constexpr, BLOCK_D: tl.constexpr, TWO: tl.constexpr, BF16: tl.constexpr,
                 NORM: tl.constexpr = False, ROPE_IN: tl.constexpr = False, ROPE_OUT: tl.constexpr = False,
                 KEEP: tl.constexpr = False, cs_ptr=None, cpre_ptr=None, cy_ptr=None, cpost_ptr=None, ccomb_ptr=None,
                 COLLAPSE_IN: tl.constexpr = False, C_EXPAND: tl.constexpr = False, C_HC: tl.constexpr = 1,
                 PDL: tl.constexpr = False, s_ptr=None, s2_ptr=None, FMT: tl.constexpr = "plain",
                 SR: tl.constexpr = 1, SC: tl.constexpr = 1, VEC: tl.constexpr = 1, BLOCKS: tl.constexpr = False):
    """Program p: output rows [o0, o0 + BLOCK_O) of the first weight (p < P1) or of the
    second, for every row of x. Group g = rows // OG reads x's channels [g * DG, (g + 1) * DG);
    two weights come only without groups (DG == D), so both weights' tiles have one shape.
    NORM: each row of x RMS-normalised by ``nw`` first (as ``norm._rms_norm_kernel``), and
    with KEEP the normalised rows written to ``xn`` by program 0 (for x's later readers);
    ROPE_IN / ROPE_OUT: x's / the output's heads of HD channels rotated (as
    ``rotary._rope_kernel``: channels from OFF on, in adjacent pairs, by row n's cos / sin at
    n % S). Each of these needs the whole input in one tile (BLOCK_D >= DG).
    COLLAPSE_IN (with NORM; ``model.kernels.Collapsed``): x is not in memory but an mHC site's
    input, made by each program from the site's streams ``cs`` (expanded by ``cy`` / ``cpost``
    / ``ccomb`` with C_EXPAND) collapsed by ``cpre`` (``streams._collapsed``).
    BLOCKS (FP8, scale blocks a whole number of 32 inputs wide): the tile held as its bytes and
    one scale a 32-input block (``_fp8_blocks``), decoded after the wait, each block's products
    summed before its scale multiplies them (``_fp8_dot``)."""
    p = tl.program_id(0)
    if TWO and p >= P1:
        w_at, out_at, o0, rows = w2_ptr, out2_ptr, (p - P1) * BLOCK_O, O2
    else:
        w_at, out_at, o0, rows = w_ptr, out_ptr, p * BLOCK_O, O
    if TWO:  # two weights come only without groups: x whole for both (outside the branch above,
        x_at = x_ptr  # so its loads keep x's alignment and go 16 bytes at a time)
    else:
        x_at = x_ptr + (o0 // OG) * DG  # a block never spans two groups
    o = o0 + tl.arange(0, BLOCK_O)
    o_ok = o < rows
    d = tl.arange(0, BLOCK_D)
    d_ok = d < DG
    w_rows = w_at + o[:, None].to(tl.int64) * DG
    if FMT == "plain":
        w = tl.load(w_rows + d[None, :], mask=o_ok[:, None] & d_ok[None, :], other=0.0,
                    eviction_policy="evict_first").to(tl.float32)  # before the wait: weights are never written
    else:
        if TWO and p >= P1:
            s_at = s2_ptr
        else:
            s_at = s_ptr
        if BLOCKS:
            q, qs = _fp8_blocks(w_at, s_at, o, o_ok, 0, DG, BLOCK_D, SR, SC)
        else:
            w = _packed_tile(w_at, s_at, o, o_ok, 0, DG, BLOCK_D, FMT, SR, SC, VEC)
    _chain(PDL)
    n = 0
    while n < N:
        if COLLAPSE_IN:
            xs = _collapsed(cs_ptr, cy_ptr, cpost_ptr, ccomb_ptr, cpre_ptr, n, d, d_ok, D, C_HC, C_EXPAND, BF16)
        else:
            xs = tl.load(x_at + n * D + d, mask=d_ok, other=0.0).to(tl.float32)
        if NORM:
            xs = _rms_normed(xs, tl.load(nw_ptr + d, mask=d_ok, other=0.0).to(tl.float32), D, eps, BF16)
            if KEEP:
                if p == 0:
                    _store(xn_ptr + n * D + d, xs, d_ok, BF16)
        if ROPE_IN:
            hc = d % HD
            rot = d_ok & (hc >= OFF)
            partner = tl.load(x_at + n * D + (d ^ 1), mask=rot, other=0.0).to(tl.float32)
            cs = tl.load(cos_ptr + (n % S) * HALF + (hc - OFF) // 2, mask=rot, other=0.0)
            sn = tl.load(sin_ptr + (n % S) * HALF + (hc - OFF) // 2, mask=rot, other=0.0)
            xs = _round(tl.where(rot, _turned(xs, partner, (hc - OFF) % 2 == 0, cs, sn), xs), BF16)
        if BLOCKS:
            acc = _fp8_dot(q, qs, xs, BLOCK_D)
        else:
            acc = tl.sum(w * xs[None, :], 1)
        d0 = BLOCK_D
        while d0 < DG:  # inputs wider than BLOCK_D_MAX: the rest in chunks
            dd = d0 + d
            xs = tl.load(x_at + n * D + dd, mask=dd < DG, other=0.0).to(tl.float32)
            if BLOCKS:
                qd, qsd = _fp8_blocks(w_at, s_at, o, o_ok, d0, DG, BLOCK_D, SR, SC)
                acc += _fp8_dot(qd, qsd, xs, BLOCK_D)
            else:
                if FMT == "plain":
                    wd = tl.load(w_rows + dd[None, :], mask=o_ok[:, None] & (dd < DG)[None, :], other=0.0)
                else:
                    wd = _packed_tile(w_at, s_at, o, o_ok, d0, DG, BLOCK_D, FMT, SR, SC, VEC)
                acc += tl.sum(wd.to(tl.float32) * xs[None, :], 1)
            d0 += BLOCK_D
        if ROPE_OUT:  # the output's pairs lie in one program: BLOCK_O is even
            e, od = tl.split(tl.reshape(_round(acc, BF16), [BLOCK_O // 2, 2]))
            pc = (o0 + 2 * tl.arange(0, BLOCK_O // 2)) % HD  # each pair's even channel in its head
            rot = pc >= OFF
            cs = tl.load(cos_ptr + (n % S) * HALF + (pc - OFF) // 2, mask=rot, other=0.0)
            sn = tl.load(sin_ptr + (n % S) * HALF + (pc - OFF) // 2, mask=rot, other=0.0)
            acc = tl.reshape(tl.join(tl.where(rot, _turned(e, od, True, cs, sn), e),
                                     tl.where(rot, _turned(od, e, False, cs, sn), od)), [BLOCK_O])
        _store(out_at + n * rows + o, acc, o_ok, BF16)
        n += 1


@triton.jit
def _packed_tile(w_at, s_at, o, o_ok, d0, DG, BLOCK_D: tl.constexpr, FMT: tl.constexpr, SR: tl.constexpr,
                 SC: tl.constexpr, VEC: tl.constexpr):
    """Rows ``o`` x input channels [d0, d0 + BLOCK_D) of a packed weight as fp32 (0 outside):
    FMT "fp8", e4m3 bytes [O, DG] times one ue8m0 byte per SR x SC block (scales [ceil(O / SR),
    ceil(DG / SC)]); "fp4", e2m1 pairs [O, DG / 2] (the even channel in the low nibble) times one
    ue8m0 byte per 1 x 32 (scales [O, ceil(DG / 32)]). The values are exact in fp32. Each load
    is vectorised VEC channels a thread (the plain weight's own width), so that the tile lies
    in the plain tile's registers and the row's sum runs in the plain kernel's order."""
    rows = o[:, None].to(tl.int64)
    if FMT == "fp8":
        dd = d0 + tl.max_contiguous(tl.arange(0, BLOCK_D), VEC)
        ok = o_ok[:, None] & (dd < DG)[None, :]
        q = tl.load(w_at + rows * DG + dd[None, :], mask=ok, other=0, eviction_policy="evict_first")
        sb = tl.load(s_at + (rows // SR) * tl.cdiv(DG, SC) + (dd // SC)[None, :], mask=ok, other=0,
                     eviction_policy="evict_first")
        return q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * _ue8m0(sb.to(tl.int32))
    else:
        if VEC == 1:  # one channel a thread: each reads its own byte
            dd = d0 + tl.arange(0, BLOCK_D)
            ok = o_ok[:, None] & (dd < DG)[None, :]
            code = tl.load(w_at + rows * (DG // 2) + (dd // 2)[None, :], mask=ok, other=0,
                           eviction_policy="evict_first").to(tl.int32)
            sb = tl.load(s_at + rows * tl.cdiv(DG, 32) + (dd // 32)[None, :], mask=ok, other=0,
                         eviction_policy="evict_first")
            return _e2m1((code >> ((dd & 1) * 4)[None, :]) & 0xF) * _ue8m0(sb.to(tl.int32))
        else:
            jj = d0 // 2 + tl.max_contiguous(tl.arange(0, BLOCK_D // 2), VEC // 2)
            ok = o_ok[:, None] & (jj < DG // 2)[None, :]
            code = tl.load(w_at + rows * (DG // 2) + jj[None, :], mask=ok, other=0,
                           eviction_policy="evict_first").to(tl.int32)
            sb = _ue8m0(tl.load(s_at + rows * tl.cdiv(DG, 32) + (jj // 16)[None, :], mask=ok, other=0,
                                eviction_policy="evict_first").to(tl.int32))
            return tl.reshape(tl.join(_e2m1(code & 0xF) * sb, _e2m1(code >> 4) * sb), [rows.shape[0], BLOCK_D])


@triton.jit
def _fp8_blocks(w_at, s_at, o, o_ok, d0, DG, BLOCK_D: tl.constexpr, SR: tl.constexpr, SC: tl.constexpr):
    """Rows ``o`` x inputs [d0, d0 + BLOCK_D) of an FP8 weight as stored, by 32-input blocks:
    the e4m3 bytes [BLOCK_O, BLOCK_D / 32, 32] and each block's ue8m0 byte [BLOCK_O, BLOCK_D /
    32] (an SR x SC scale block, SC a multiple of 32, covers whole 32-input blocks); 0 outside."""
    rows = o[:, None].to(tl.int64)
    b = d0 // 32 + tl.arange(0, BLOCK_D // 32)
    cols = b[:, None] * 32 + tl.arange(0, 32)[None, :]
    q = tl.load(w_at + rows[:, :, None] * DG + cols[None, :, :], mask=o_ok[:, None, None] & (cols < DG)[None, :, :],
                other=0, eviction_policy="evict_first")
    s = tl.load(s_at + (rows // SR) * tl.cdiv(DG, SC) + (b * 32 // SC)[None, :], mask=o_ok[:, None] & (b * 32 < DG)[None, :],
                other=0, eviction_policy="evict_first")
    return q, s


@triton.jit
def _fp8_dot(q, s, xs, BLOCK_D: tl.constexpr):
    """Each row's sum of weight x ``xs`` [BLOCK_D] over :func:`_fp8_blocks`' tile: a 32-input
    block's e4m3 values times x summed, then times the block's scale (a power of two: exact),
    then the blocks summed: one scale multiply a block where the dequantised tile took one an
    input and a scale load an input (the module's note has the figures); the sums run in
    another order than the plain kernel's."""
    xg = tl.reshape(xs, [BLOCK_D // 32, 32])
    v = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return tl.sum(tl.sum(v * xg[None, :, :], 2) * _ue8m0(s.to(tl.int32)), 1)


def tile(rows: int, width: int, elem_bytes: int, most: int, least: int = 1, whole: bool = False) -> tuple[int, int]:
    """(BLOCK_O, BLOCK_D) of a weight of ``rows`` x ``width``: the input whole up to
    BLOCK_D_MAX channels (past that only if ``whole``, else in chunks, which divide it where a
    power of two from 256 does); the most rows (a power of two from ``least``, at most
    ``most``) whose tile fits TILE_BYTES while the weight still makes MIN_PROGRAMS programs."""
    block_d = triton.next_power_of_2(width) if whole else min(triton.next_power_of_2(width), BLOCK_D_MAX)
    if not whole and width > BLOCK_D_MAX and width & -width >= 256:
        # chunks that divide the input: V4.1-Flash's head (5,120 wide) in 5 of 1,024, not 4,096 and a
        # quarter-full 4,096 (2026-12-07, one H100, bench_knobs, a `v41-flash --layers 8` packed step at
        # 32K, best of three alternated rounds: 2.584 -> 2.566 ms, control 1.000; the head 433 -> 414 us)
        block_d = min(BLOCK_D_MAX, width & -width)
    b = least
    while (b * 2 <= most and b * 2 * block_d * elem_bytes <= TILE_BYTES
           and triton.cdiv(rows, b * 2) >= MIN_PROGRAMS):
        b *= 2
    return b, block_d


def gemv(x: torch.Tensor, *weights, groups: int = 1, norm=None, rope_in=None,
         rope_out=None, keep: bool = False) -> tuple[torch.Tensor, ...]:
    """``x`` [..., D] (fp32 or bf16) against one or two weights [O, D] of its dtype, or two
    ``model.kernels.Packed`` of one format and scale block -> one
    output [..., O] each (then, with ``keep`` and ``norm``, x normalised). With ``groups`` g
    (one weight [g * r, D / g]): output group j is weight rows [j * r, (j + 1) * r) against
    x's channels [j * D / g, (j + 1) * D / g).
    ``norm`` = (weight [D], eps): x RMS-normalised first (``rms_norm``; without groups);
    ``rope_in`` / ``rope_out`` = (cos, sin [S, r], head_dim): x's / the output's heads rotated
    (``rope`` on x [B, S, heads, head_dim], S the second dim of x; one weight with these).
    ``x`` may be a ``model.kernels.Collapsed`` (with ``norm``): each program makes the rows it
    reads. A packed weight's tile is the plain weight's (x's dtype sets both), its loads as wide
    a thread: the same registers, the same order of sums."""
    assert 1 <= len(weights) <= 2 and (groups == 1 or len(weights) == 1)
    assert x.dtype in (torch.float32, torch.bfloat16)
    assert len(weights) == 1 or not (rope_in or rope_out)
    assert not norm or groups == 1, "a norm over a group's channels is not the row's"
    assert not keep or norm, "keep: the normalised x"
    assert not (norm and rope_in), "x normalised and rotated: not one pass"
    lead, D = x.shape[:-1], x.shape[-1]
    collapsed = isinstance(x, Collapsed)
    assert not collapsed or norm, "a site's input is made by a GEMV that normalises it"
    if collapsed:
        rows, incoming = x.launch_args()
    else:
        rows, incoming = x.reshape(-1, D).contiguous(), {}
    N = rows.shape[0]
    shapes, ws, packed = _operands(weights, x.dtype)
    O, DG = shapes[0]
    assert D == DG * groups and O % groups == 0 and all(s[1] == D for s in shapes[1:]), (x.shape, O, DG, groups)
    OG = O // groups
    outs = [torch.empty(N, s[0], dtype=x.dtype, device=x.device) for s in shapes]
    # one tile shape for both weights; a power of two dividing the group's rows; the output's
    # RoPE pairs in one program
    most = min(OG & -OG, *(s[0] for s in shapes))
    blocks = FP8_BLOCKS and packed.get("FMT") == "fp8" and packed["SC"] % 32 == 0  # the tile as bytes: one a weight
    block_o, block_d = tile(sum(s[0] for s in shapes) // len(shapes), DG, 1 if blocks else rows.element_size(), most,
                            least=2 if rope_out else 1, whole=bool(norm or rope_in))
    if blocks:
        block_d = max(block_d, 32)
    p1 = triton.cdiv(O, block_o)
    p2 = triton.cdiv(shapes[1][0], block_o) if len(ws) == 2 else 0
    bf16 = x.dtype == torch.bfloat16
    view = (lambda t: t.view(torch.int16)) if bf16 else (lambda t: t)
    w2, out2 = (ws[1], outs[1]) if len(ws) == 2 else (ws[0], outs[0])
    nw, eps = (norm[0].contiguous(), float(norm[1])) if norm else (rows, 0.0)
    cos, sin, hd = rope_in or rope_out or (rows, rows, 1)
    S, half = cos.shape if (rope_in or rope_out) else (1, 0)
    if rope_in or rope_out:
        assert cos.dtype == sin.dtype == torch.float32 and sin.shape == cos.shape and 2 * half <= hd
        assert len(lead) >= 2 and lead[-1] == S, (x.shape, cos.shape)
        assert (DG if rope_in else O) % hd == 0 and hd % 2 == 0
        cos, sin = cos.contiguous(), sin.contiguous()
    assert norm is None or (nw.shape == (D,) and nw.dtype == x.dtype)
    if keep:
        outs.append(torch.empty_like(rows))
    if packed:
        packed["VEC"] = vector(block_o, block_d, DG, rows.element_size())
        packed["BLOCKS"] = blocks
    _gemv_kernel[(p1 + p2,)](rows, ws[0], view(outs[0]), w2, view(out2), N, O, shapes[-1][0], D, DG, OG,
                             p1, nw, eps, cos, sin, S, hd, hd - 2 * half, half, view(outs[-1]),
                             BLOCK_O=block_o, BLOCK_D=block_d, TWO=len(ws) == 2, BF16=bf16, NORM=norm is not None,
                             ROPE_IN=rope_in is not None, ROPE_OUT=rope_out is not None, KEEP=keep,
                             num_warps=GEMV_WARPS, **incoming, **unfused(), **chained(rows), **packed)
    return tuple(o.view(*lead, o.shape[-1]) for o in outs)


def _operands(weights, dtype: torch.dtype) -> tuple[list, list, dict]:
    """(the weights' shapes [O, D], the tensors the kernel reads as its weights, the packed
    launch's further arguments: none for float weights; for ``Packed`` ones their scale
    bytes, format and scale block)."""
    if not isinstance(weights[0], Packed):
        assert all(w.dtype == dtype and w.dim() == 2 for w in weights)
        ws = [w.contiguous() for w in weights]
        return [tuple(w.shape) for w in ws], ws, {}
    assert all(isinstance(w, Packed) and w.decodable() for w in weights)
    fmt, (sr, sc) = weights[0].fmt, weights[0].scale_block()
    assert all(w.fmt == fmt and w.scale_block() == (sr, sc) for w in weights), "one launch decodes its weights alike"
    data = [w.data.contiguous().view(torch.uint8) for w in weights]
    scales = [w.scale.contiguous().view(torch.uint8) for w in weights]
    return [w.shape for w in weights], data, dict(s_ptr=scales[0], s2_ptr=scales[-1], FMT=fmt, SR=sr, SC=sc)


def vector(block_o: int, block_d: int, width: int, elem_bytes: int) -> int:
    """Channels a thread loads at once from a plain weight's tile (what Triton's coalescing
    gives a [block_o, block_d] load of ``elem_bytes`` elements on rows of ``width``): 16 bytes
    where the rows are 16-element aligned, fewer where the tile has fewer elements than that a
    thread, else 1. A packed tile is loaded as wide, so its registers are the plain tile's."""
    if width % 16:
        return 1
    return min(16 // elem_bytes, max(block_o * block_d // (32 * GEMV_WARPS), 1))
