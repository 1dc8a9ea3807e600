"""Triton kernels that pack KV rows into the cache's byte layouts, bit for bit as ``model.blockfp``.

Owns ``pack_window`` (FP8 e4m3 + one ue8m0 byte per 32 channels: 528 B at D=512),
``pack_main`` (FP4 e2m1 pairs + one e4m3 byte per 16: 288 B) and ``pack_index`` (FP4 e2m1
pairs + one ue8m0 byte per 32: 68 B at d=128), one program per row. Their twins are
``model.blockfp.pack_window`` / ``pack_main`` / ``pack_index``; ``tests/test_kernels.py``
requires equal bytes. The same kernels give ``fake_quant_fp8`` / ``fake_quant_fp4``: the
quantised values themselves, decoded in registers (twins: ``model.blockfp``'s of the same
names; every such value is exact in fp32 and bf16, so these are bit-exact too) — one launch
where torch runs ~18 for the window's FP8 and ~25 for the indexer query's FP4. A decode step's
rows made and packed in place in one launch each: ``window_entry`` (the window's), and a KV
source's compressor in ``compress_step`` (its history ring, pooled latent and record) and
``index_entry`` (its index key), whose twins are ``decode_step.compressor_step`` and the packs above.

How the bytes stay exact: every rounding is done on integer bits, never by float
arithmetic the compiler could contract — power-of-two scales are read off and built from
exponent bits (so dividing by one is an exact multiply), e4m3 is rounded to nearest-even
from the fp32 mantissa bits (normal and subnormal), and the two divisions by a non-power
of two (``pack_main``'s e4m3 scale) use ``div_rn``, IEEE's correctly rounded division, as
torch does. Does not own: which rows to pack or where they go (``model.cache``).
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from model.kernels.fused import _chain, _e2m1, _e4m3, _rms_normed, _round, _store, _turned, chained, unfused
from model.blockfp import FP4_MAX, FP8_MAX, INDEX_BLOCK, RECORD_BLOCK, WINDOW_BLOCK, pow2_blocks

# e2m1 thresholds as model.blockfp.e2m1_encode builds them: a tie at 0.25, 1.25, 2.5 or 5.0
# rounds down (to the even code), so the threshold is the next float above the midpoint
_MID = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
_T = [float(np.nextafter(m, np.float32(np.inf)) if i % 2 == 0 else m) for i, m in enumerate(_MID)]
_T0, _T1, _T2, _T3, _T4, _T5, _T6 = (tl.constexpr(t) for t in _T)


@triton.jit
def _pow2_ceil(t):
    """2**ceil(log2 t) of positive fp32 t, and its biased exponent (the ue8m0 byte)."""
    bits = t.to(tl.int32, bitcast=True)
    k = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (k << 23).to(tl.float32, bitcast=True), k


@triton.jit
def _e4m3_encode(y):
    """fp32 |y| <= 448 -> e4m3fn byte (int32), round to nearest even, sign kept (-0 -> 0x80)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    e = (a >> 23) - 127
    mant = a & 0x7FFFFF
    r = mant >> 20
    rem = mant & 0xFFFFF
    up = (rem > 0x80000) | ((rem == 0x80000) & ((r & 1) == 1))
    normal = ((e + 7) << 3) + r + up.to(tl.int32)
    s = tl.minimum(14 - e, 25)  # subnormal: round |y| * 2^9 to an integer; from 2^25 on it is 0
    full = mant | 0x800000
    q = full >> s
    rem2 = full & ((1 << s) - 1)
    half = 1 << (s - 1)
    sub = q + ((rem2 > half) | ((rem2 == half) & ((q & 1) == 1))).to(tl.int32)
    code = tl.where(e >= -6, normal, sub)
    return sign | tl.where(a == 0, 0, code)


@triton.jit
def _e2m1_encode(y):
    """Pre-clamped fp32 -> 4-bit code (sign in bit 3), as ``model.blockfp.e2m1_encode``."""
    a = tl.abs(y)
    code = ((a >= _T0).to(tl.int32) + (a >= _T1).to(tl.int32) + (a >= _T2).to(tl.int32) + (a >= _T3).to(tl.int32)
            + (a >= _T4).to(tl.int32) + (a >= _T5).to(tl.int32) + (a >= _T6).to(tl.int32))
    return code | (((y.to(tl.int32, bitcast=True) >> 28) & 0x8))


@triton.jit
def _signed(magnitude, negative):
    """``magnitude`` (fp32, >= 0) negated where ``negative``, on the sign bit: -0.0 stays -0.0
    (``-x`` may compile to ``0 - x``, which gives +0.0)."""
    bits = magnitude.to(tl.int32, bitcast=True) | (negative.to(tl.int32) << 31)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _fp8_blocks(x, FMAX: tl.constexpr):
    """Blocks [NB, BLOCK] of a row -> (scaled and clamped values, power-of-two scales, their
    exponent bytes): what the e4m3 codes and ue8m0 bytes are made from."""
    scale, k = _pow2_ceil(tl.maximum(tl.max(tl.abs(x), 1), 1e-4) * (1.0 / FMAX))
    inv = ((254 - k) << 23).to(tl.float32, bitcast=True)  # 1 / scale, exact
    return tl.minimum(tl.maximum(x * inv[:, None], -FMAX), FMAX), scale, k


@triton.jit
def _pack_window_kernel(x_ptr, out_ptr, s_x, s_o, D: tl.constexpr, BLOCK: tl.constexpr, FMAX: tl.constexpr,
                        VALUES: tl.constexpr = False, PDL: tl.constexpr = False):
    """One row to its bytes, or (VALUES) to the values those bytes decode to, in out's dtype."""
    _chain(PDL)
    row = tl.program_id(0).to(tl.int64)
    NB: tl.constexpr = D // BLOCK
    offs = tl.arange(0, NB)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    x = tl.load(x_ptr + row * s_x + offs).to(tl.float32)
    y, scale, k = _fp8_blocks(x, FMAX)
    if VALUES:
        code = _e4m3_encode(y)
        value = _signed(_e4m3(code & 0x7F) * scale[:, None], (code & 0x80) != 0)  # exact: power-of-two scale
        tl.store(out_ptr + row * s_o + offs, value.to(out_ptr.dtype.element_ty))
    else:
        tl.store(out_ptr + row * s_o + offs, _e4m3_encode(y).to(tl.uint8))
        tl.store(out_ptr + row * s_o + D + tl.arange(0, NB), k.to(tl.uint8))


@triton.jit
def _fp4_blocks(even, odd, E4M3_SCALES: tl.constexpr):
    """A row's even and odd channels as blocks [NB, BLOCK/2] (fp32) -> (their e2m1 codes, even
    and odd, sign in bit 3; each block's scale byte; the scale's value), as ``model.blockfp``'s
    ``pack_main`` (E4M3_SCALES: e4m3 scales of amax / 6) and ``pack_index`` (ue8m0: powers of
    two) make them."""
    amax = tl.maximum(tl.max(tl.abs(even), 1), tl.max(tl.abs(odd), 1))
    if E4M3_SCALES:
        sb = _e4m3_encode(tl.math.div_rn(tl.maximum(amax, 6.0 * 0.001953125), tl.full(amax.shape, 6.0, tl.float32)))
        scale = _e4m3(sb)  # the byte's value (fused's decoder)
        ye = tl.math.div_rn(even, scale[:, None])
        yo = tl.math.div_rn(odd, scale[:, None])
    else:
        scale, sb = _pow2_ceil(tl.maximum(amax, 6.0 * 1.1754943508222875e-38) * (1.0 / 6.0))
        inv = ((254 - sb) << 23).to(tl.float32, bitcast=True)
        ye, yo = even * inv[:, None], odd * inv[:, None]
    ce = _e2m1_encode(tl.minimum(tl.maximum(ye, -6.0), 6.0))
    co = _e2m1_encode(tl.minimum(tl.maximum(yo, -6.0), 6.0))
    return ce, co, sb, scale


@triton.jit
def _store_fp4(row_ptr, even, odd, D: tl.constexpr, BLOCK: tl.constexpr, E4M3_SCALES: tl.constexpr):
    """A row's even and odd channels [D/2] (fp32) packed at ``row_ptr``: D/2 bytes of e2m1
    pairs (the even channel in the low nibble), then a scale byte per BLOCK channels."""
    NB: tl.constexpr = D // BLOCK
    ce, co, sb, _ = _fp4_blocks(tl.reshape(even, [NB, BLOCK // 2]), tl.reshape(odd, [NB, BLOCK // 2]), E4M3_SCALES)
    pair = tl.arange(0, NB)[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
    tl.store(row_ptr + pair, (ce | (co << 4)).to(tl.uint8))
    tl.store(row_ptr + D // 2 + tl.arange(0, NB), sb.to(tl.uint8))


@triton.jit
def _pack_fp4_kernel(x_ptr, out_ptr, s_x, s_o, D: tl.constexpr, BLOCK: tl.constexpr, E4M3_SCALES: tl.constexpr,
                     VALUES: tl.constexpr = False, PDL: tl.constexpr = False):
    """One row to its bytes, or (VALUES) to the values those bytes decode to, in out's dtype."""
    _chain(PDL)
    row = tl.program_id(0).to(tl.int64)
    NB: tl.constexpr = D // BLOCK
    HALF: tl.constexpr = BLOCK // 2
    pair = tl.arange(0, NB)[:, None] * HALF + tl.arange(0, HALF)[None, :]  # output byte index
    even = tl.load(x_ptr + row * s_x + 2 * pair).to(tl.float32)
    odd = tl.load(x_ptr + row * s_x + 2 * pair + 1).to(tl.float32)
    if VALUES:  # e2m1 (2 significant bits) times an e4m3 or power-of-two scale: exact
        ce, co, _, scale = _fp4_blocks(even, odd, E4M3_SCALES)
        ve = _signed(_e2m1(ce & 0x7) * scale[:, None], (ce & 0x8) != 0)
        vo = _signed(_e2m1(co & 0x7) * scale[:, None], (co & 0x8) != 0)
        tl.store(out_ptr + row * s_o + 2 * pair, ve.to(out_ptr.dtype.element_ty))
        tl.store(out_ptr + row * s_o + 2 * pair + 1, vo.to(out_ptr.dtype.element_ty))
    else:
        _store_fp4(out_ptr + row * s_o, tl.reshape(even, [D // 2]), tl.reshape(odd, [D // 2]), D, BLOCK, E4M3_SCALES)


def _rows(x: torch.Tensor, block: int) -> torch.Tensor:
    D = x.shape[-1]
    assert pow2_blocks(D, block), f"dim {D} must be a power-of-two number of {block}-blocks"
    flat = x.reshape(-1, D)
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def _pack_fp8(x: torch.Tensor, block: int, values: bool = False) -> torch.Tensor:
    flat, D = _rows(x, block), x.shape[-1]
    if values:
        out = torch.empty(flat.shape, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(flat.shape[0], D + D // block, dtype=torch.uint8, device=x.device)
    if flat.shape[0]:
        _pack_window_kernel[(flat.shape[0],)](flat, out, flat.stride(0), out.stride(0), D=D, BLOCK=block,
                                              FMAX=FP8_MAX, VALUES=values, **chained(flat))
    return out.view(*x.shape[:-1], out.shape[-1])


def pack_window(x: torch.Tensor) -> torch.Tensor:
    return _pack_fp8(x, WINDOW_BLOCK)


def fake_quant_fp8(x: torch.Tensor, block: int = WINDOW_BLOCK) -> torch.Tensor:
    """What ``pack_window``'s bytes decode to, in x's dtype (``model.blockfp.fake_quant_fp8``)."""
    return _pack_fp8(x, block, values=True)


@triton.jit(do_not_specialize=["cap"])
def _pack_window_at_kernel(x_ptr, data_ptr, rpos_ptr, pos_ptr, cap, s_x, s_db, s_dn,
                           D: tl.constexpr, BLOCK: tl.constexpr, FMAX: tl.constexpr, PDL: tl.constexpr = False):
    """Row b of one decode step's window entries packed straight into its ring slot
    (position % cap); program 0 also records the slot's position."""
    _chain(PDL)
    b = tl.program_id(0).to(tl.int64)
    NB: tl.constexpr = D // BLOCK
    p = tl.load(pos_ptr)
    slot = p % cap
    offs = tl.arange(0, NB)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    y, _, k = _fp8_blocks(tl.load(x_ptr + b * s_x + offs).to(tl.float32), FMAX)
    row = data_ptr + b * s_db + slot * s_dn
    tl.store(row + offs, _e4m3_encode(y).to(tl.uint8))
    tl.store(row + D + tl.arange(0, NB), k.to(tl.uint8))
    if b == 0:
        tl.store(rpos_ptr + slot, p)


def pack_window_at(x: torch.Tensor, data: torch.Tensor, ring_pos: torch.Tensor, pos: torch.Tensor) -> None:
    """x [B, 1, D] packed into ring rows ``data`` [B, cap, D + D/32] at slot pos % cap, and
    ``ring_pos`` [cap] told (``pos``: [1] int64, on the device)."""
    B, S, D = x.shape
    assert S == 1 and pos.numel() == 1 and pos.dtype == ring_pos.dtype == torch.int64
    assert data.dtype == torch.uint8 and data.shape == (B, ring_pos.shape[0], D + D // WINDOW_BLOCK)
    assert data.stride(2) == 1 and ring_pos.is_contiguous()
    flat = _rows(x, WINDOW_BLOCK)
    _pack_window_at_kernel[(B,)](flat, data, ring_pos, pos, ring_pos.shape[0], flat.stride(0), data.stride(0),
                                 data.stride(1), D=D, BLOCK=WINDOW_BLOCK, FMAX=FP8_MAX, **chained(flat))


@triton.jit
def _rotated(h, cos_ptr, sin_ptr, first, D: tl.constexpr, HALF: tl.constexpr, BF16: tl.constexpr,
             AT_FIRST: tl.constexpr):
    """Row ``h`` [D] (fp32 values of the row's dtype) as ``rope`` turns its trailing HALF pairs,
    each channel rounded to the dtype: by the angles' cos / sin [HALF] at ``cos_ptr`` /
    ``sin_ptr``, or with AT_FIRST by those of position ``first`` under the frequencies at
    ``cos_ptr`` — first · inv_freq, its cos and sin in fp32, as ``RopeAngles`` makes them.
    -> (even, odd) channels [D/2]."""
    e, o = tl.split(tl.reshape(h, [D // 2, 2]))
    pc = 2 * tl.arange(0, D // 2)  # each pair's even channel
    rot = pc >= D - 2 * HALF
    j = (pc - (D - 2 * HALF)) // 2
    if AT_FIRST:
        angle = first.to(tl.float32) * tl.load(cos_ptr + j, mask=rot, other=0.0)
        cs, sn = tl.cos(angle), tl.sin(angle)
    else:
        cs = tl.load(cos_ptr + j, mask=rot, other=0.0)
        sn = tl.load(sin_ptr + j, mask=rot, other=0.0)
    e, o = tl.where(rot, _turned(e, o, True, cs, sn), e), tl.where(rot, _turned(o, e, False, cs, sn), o)
    return _round(e, BF16), _round(o, BF16)


@triton.jit(do_not_specialize=["cap"])
def _window_entry_kernel(x_ptr, nw_ptr, eps, cos_ptr, sin_ptr, data_ptr, rpos_ptr, pos_ptr, cap, s_x, s_db, s_dn,
                         D: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, FMAX: tl.constexpr,
                         BF16: tl.constexpr, PDL: tl.constexpr = False):
    """Row b of one decode step's K=V latent to its window entry in its ring slot, in
    registers: the RMSNorm (``norm._rms_norm_kernel``'s roundings), the RoPE of the trailing
    HALF pairs (``rotary._rope_kernel``'s), the FP8 values (``fake_quant_fp8``), their bytes
    (``_pack_window_at_kernel``); program 0 also records the slot's position."""
    _chain(PDL)
    b = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, D)
    h = _rms_normed(tl.load(x_ptr + b * s_x + c).to(tl.float32), tl.load(nw_ptr + c).to(tl.float32), D, eps, BF16)
    e, o = _rotated(h, cos_ptr, sin_ptr, 0, D, HALF, BF16, False)
    h = tl.reshape(tl.join(e, o), [D // BLOCK, BLOCK])
    y, scale, _ = _fp8_blocks(h, FMAX)  # the entry's FP8 values, as the step's KVFormat.window makes them
    code = _e4m3_encode(y)
    value = _signed(_e4m3(code & 0x7F) * scale[:, None], (code & 0x80) != 0)
    y, _, k = _fp8_blocks(value, FMAX)  # and their bytes, as the ring's write packs them
    p = tl.load(pos_ptr)
    slot = p % cap
    row = data_ptr + b * s_db + slot * s_dn
    offs = tl.arange(0, D // BLOCK)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    tl.store(row + offs, _e4m3_encode(y).to(tl.uint8))
    tl.store(row + D + tl.arange(0, D // BLOCK), k.to(tl.uint8))
    if b == 0:
        tl.store(rpos_ptr + slot, p)


# (2026-12-04, dc98548: a timing probe that left this launch out read 0.978 of a step; 505a62b: the entry
# made by the attention's own launch, not kept; the figures: docs/gpu-fast-path.md, "Tried and not kept")


def window_entry(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                 data: torch.Tensor, ring_pos: torch.Tensor, pos: torch.Tensor) -> None:
    """x [B, 1, D] (the K=V latent of one decode step, fp32 or bf16) normalised by
    ``norm_weight``, rotated by cos / sin [1, r], rounded to FP8 and packed into ring rows
    ``data`` [B, cap, D + D/32] at slot pos % cap; ``ring_pos`` [cap] told."""
    B, S, D = x.shape
    assert S == 1 and pos.numel() == 1 and pos.dtype == ring_pos.dtype == torch.int64
    assert data.dtype == torch.uint8 and data.shape == (B, ring_pos.shape[0], D + D // WINDOW_BLOCK)
    assert data.stride(2) == 1 and ring_pos.is_contiguous() and norm_weight.shape == (D,)
    assert x.dtype in (torch.float32, torch.bfloat16) and norm_weight.dtype == x.dtype
    assert cos.shape == sin.shape and cos.shape[0] == 1 and 2 * cos.shape[1] <= D and cos.dtype == torch.float32
    flat = _rows(x, WINDOW_BLOCK)
    _window_entry_kernel[(B,)](flat, norm_weight.contiguous(), float(eps), cos.contiguous(), sin.contiguous(), data,
                               ring_pos, pos, ring_pos.shape[0], flat.stride(0), data.stride(0), data.stride(1), D=D,
                               HALF=cos.shape[1], BLOCK=WINDOW_BLOCK, FMAX=FP8_MAX, BF16=x.dtype == torch.bfloat16,
                               num_warps=4, **unfused(), **chained(flat))


# a compressor's decode step in four launches (``model.kernels.compress_step``); off: torch's ~30,
# for ``gpu_bench.py --knobs pack.COMPRESS_STEP=False``
COMPRESS_STEP = True
# those launches (~15 µs at `small` on the H200, 2026-12-04, 3097e7e) on a side stream beside the query's
# projections and the window entry, which need the site's input as they do
# (``model.decode_step._compress_beside``). Timed on the H200 (`small`, a step at 128K, bench_knobs,
# best of two alternated rounds): 0.979 of inline (and 0.981 as "all on"), the control 0.991
COMPRESS_BESIDE = True


@triton.jit(do_not_specialize=["cap"])
def _compress_step_kernel(kv_ptr, gate_ptr, hkv_ptr, hgate_ptr, hpos_ptr, pos_ptr, cap, s_hb, s_hn, nw_ptr, eps,
                          inv_ptr, lat_ptr, rec_ptr, s_rb, s_rn, D: tl.constexpr, RATIO: tl.constexpr,
                          R_P2: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, EMIT: tl.constexpr,
                          BF16: tl.constexpr, PDL: tl.constexpr = False):
    """Row b of a compressor's decode step at position p. RATIO > 1: this step's projections
    kv / gate (fp32) kept in the history ring at slot p % cap (program 0 tells ``hpos``);
    with EMIT (the group [p - RATIO + 1, p] completes) the group's softmax-gated sum from
    the ring, as ``Compressor._pool`` (rounded to the dtype, then ``norm``). RATIO == 1: kv
    (the dtype's ``wkv(x)``) normalised. Then, with EMIT, that latent to ``lat`` (the index
    key's input) and its record — RoPE at the group's first position, FP4 as ``pack_main`` —
    into row (first // RATIO) of ``rec``."""
    _chain(PDL)
    b = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, D)
    p = tl.load(pos_ptr)
    first = p - (RATIO - 1)
    if RATIO > 1:
        slot = p % cap
        tl.store(hkv_ptr + b * s_hb + slot * s_hn + c, tl.load(kv_ptr + b * D + c))
        tl.store(hgate_ptr + b * s_hb + slot * s_hn + c, tl.load(gate_ptr + b * D + c))
        if b == 0:
            tl.store(hpos_ptr + slot, p)
    if EMIT:
        if RATIO > 1:
            tl.debug_barrier()  # the ring's row written above, read back below by other threads
            r = tl.arange(0, R_P2)
            rows = b * s_hb + ((first + r) % cap)[:, None] * s_hn + c[None, :]
            live = (r < RATIO)[:, None]
            g = tl.load(hgate_ptr + rows, mask=live, other=float("-inf"))
            e = tl.exp(g - tl.max(g, 0)[None, :])
            weight = e / tl.sum(e, 0)[None, :]
            h = _round(tl.sum(tl.load(hkv_ptr + rows, mask=live, other=0.0) * weight, 0), BF16)
        else:
            h = tl.load(kv_ptr + b * D + c).to(tl.float32)
        h = _rms_normed(h, tl.load(nw_ptr + c).to(tl.float32), D, eps, BF16)
        _store(lat_ptr + b * D + c, h, c < D, BF16)
        even, odd = _rotated(h, inv_ptr, inv_ptr, first, D, HALF, BF16, True)
        _store_fp4(rec_ptr + b * s_rb + (first // RATIO) * s_rn, even, odd, D, BLOCK, True)


@triton.jit
def _index_entry_kernel(k_ptr, nw_ptr, eps, inv_ptr, pos_ptr, idx_ptr, s_ib, s_in, D: tl.constexpr,
                        RATIO: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, BF16: tl.constexpr,
                        PDL: tl.constexpr = False):
    """Row b of the index key of the group completing at position p: ``wk``'s output k
    normalised (``k_norm``), turned at the group's first position, FP4 as ``pack_index``,
    into row (first // RATIO) of ``idx``."""
    _chain(PDL)
    b = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, D)
    first = tl.load(pos_ptr) - (RATIO - 1)
    h = _rms_normed(tl.load(k_ptr + b * D + c).to(tl.float32), tl.load(nw_ptr + c).to(tl.float32), D, eps, BF16)
    even, odd = _rotated(h, inv_ptr, inv_ptr, first, D, HALF, BF16, True)
    _store_fp4(idx_ptr + b * s_ib + (first // RATIO) * s_in, even, odd, D, BLOCK, False)


def compress_step(kv: torch.Tensor, gate: torch.Tensor | None, hist: tuple, pos: torch.Tensor,
                  norm_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor, records: torch.Tensor,
                  ratio: int, emit: bool) -> torch.Tensor | None:
    """One decode step of a compressor (``_compress_step_kernel``, one launch): ``kv`` / ``gate``
    [B, 1, D] this step's projections (fp32; ratio 1: ``wkv(x)`` in x's dtype, gate None),
    ``hist`` = (hist_kv, hist_gate, hist_pos) the source's ring, ``records`` its packed rows.
    -> the group's latent [B, 1, D] (normalised, before RoPE; x's dtype) when ``emit``, else None."""
    B, _, D = kv.shape
    assert kv.shape[1] == 1 and pos.numel() == 1 and pos.dtype == torch.int64 and kv.is_contiguous()
    assert records.dtype == torch.uint8 and records.shape[2] == D // 2 + D // RECORD_BLOCK and records.stride(2) == 1
    assert (gate is None) == (ratio == 1) and inv_freq.dtype == torch.float32
    hkv, hgate, hpos = hist if ratio > 1 else (kv, kv, pos)  # unread at ratio 1
    if ratio > 1:
        assert gate.is_contiguous() and kv.dtype == gate.dtype == hkv.dtype == torch.float32 and hkv.stride(2) == 1
        assert hkv.stride() == hgate.stride() and hpos.shape[0] == hkv.shape[1] >= ratio
    dtype = norm_weight.dtype
    bf16 = dtype == torch.bfloat16
    latent = torch.empty(B, 1, D, dtype=dtype, device=kv.device)
    _compress_step_kernel[(B,)](kv, kv if gate is None else gate, hkv, hgate, hpos, pos, hpos.shape[0], hkv.stride(0),
                                hkv.stride(1), norm_weight, float(eps), inv_freq, latent.view(torch.int16) if bf16
                                else latent, records, records.stride(0), records.stride(1), D=D, RATIO=ratio,
                                R_P2=triton.next_power_of_2(ratio), HALF=inv_freq.shape[0], BLOCK=RECORD_BLOCK,
                                EMIT=emit, BF16=bf16, num_warps=4, **unfused(), **chained(kv))
    return latent if emit else None


def index_entry(k: torch.Tensor, norm_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor, index: torch.Tensor,
                pos: torch.Tensor, ratio: int) -> None:
    """The index key of the group completing at ``pos`` (``_index_entry_kernel``, one launch):
    ``k`` [B, 1, d] = ``wk`` of the group's latent, into ``index``'s packed rows."""
    B, _, D = k.shape
    assert k.shape[1] == 1 and k.is_contiguous() and k.dtype == norm_weight.dtype and pos.dtype == torch.int64
    assert index.dtype == torch.uint8 and index.shape[2] == D // 2 + D // INDEX_BLOCK and index.stride(2) == 1
    _index_entry_kernel[(B,)](k, norm_weight, float(eps), inv_freq, pos, index, index.stride(0), index.stride(1),
                              D=D, RATIO=ratio, HALF=inv_freq.shape[0], BLOCK=INDEX_BLOCK,
                              BF16=k.dtype == torch.bfloat16, num_warps=4, **unfused(), **chained(k))


def _pack_fp4(x: torch.Tensor, block: int, e4m3_scales: bool, values: bool = False) -> torch.Tensor:
    assert FP4_MAX == 6.0
    flat, D = _rows(x, block), x.shape[-1]
    if values:
        out = torch.empty(flat.shape, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(flat.shape[0], D // 2 + D // block, dtype=torch.uint8, device=x.device)
    if flat.shape[0]:
        _pack_fp4_kernel[(flat.shape[0],)](flat, out, flat.stride(0), out.stride(0), D=D, BLOCK=block,
                                           E4M3_SCALES=e4m3_scales, VALUES=values, **chained(flat))
    return out.view(*x.shape[:-1], out.shape[-1])


def pack_main(x: torch.Tensor) -> torch.Tensor:
    return _pack_fp4(x, RECORD_BLOCK, True)


def pack_index(x: torch.Tensor) -> torch.Tensor:
    return _pack_fp4(x, INDEX_BLOCK, False)


def fake_quant_fp4(x: torch.Tensor, block: int, e4m3_scales: bool = False) -> torch.Tensor:
    """What the FP4 bytes of ``x`` decode to, in x's dtype (``model.blockfp.fake_quant_fp4``)."""
    return _pack_fp4(x, block, e4m3_scales, values=True)
