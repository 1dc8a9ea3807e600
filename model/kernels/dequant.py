"""A packed weight's floats in one pass over its bytes: what a prefill GEMM of many rows reads.

``dequantise(w, dtype)``: a :class:`Packed` weight [O, D] (FP8 e4m3 with one ue8m0 per SR x SC
block, or FP4 e2m1 pairs with one ue8m0 per 1 x 32) -> floats [O, D] of ``dtype``;
``dequantise_fp4_stack(w, s, in_features, dtype)`` the same for an FP4 expert stack [E, N, K / 2].
The values ``model.checkpoint`` dequantises, bit for bit (every value is exact in bf16: an e4m3
or e2m1 value times a power of two), for the scale bytes a packer writes (1 to 254).

Why a pass of its own: past a few dozen rows a GEMM's time grows with its rows and the
weight's decode does not, so decoding the weight once into a scratch tensor, then the
library's bf16 GEMM, beats decoding it in every program's registers (``model.kernels.gemm``):
on an H100 (2026-12-05), a V4.1-Flash FP8 [5120, 8192] weight times 8192 rows took 1.97 ms in
the registers' kernel at its best tile, 0.93 ms decoded here then cuBLAS, 0.86 ms as cuBLAS on
floats already there (this kernel: 91 us, 1.4 TB/s). The scratch is one weight's floats at a
time, freed as the GEMM returns. An expert stack's rows are too few an expert for that (about
128 of 8192 tokens x top-6 over 384 experts): there the registers' kernel stays ahead.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.kernels.fused import _e2m1, _store, _ue8m0
from model.kernels.packed import Packed

BLOCK_R, BLOCK_C = 32, 256  # a program's rows x output columns


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, R, C, S_COLS, FMT: tl.constexpr, SR: tl.constexpr, SC: tl.constexpr,
                    BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """out[r, c] for a tile of rows x columns: FP8 ``w`` [R, C] bytes, FP4 ``w`` [R, C / 2]
    pairs (even column in the low nibble, C even); ``s`` [*, S_COLS] one byte per SR x SC."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < R
    if FMT == "fp4":
        j = tl.program_id(1) * (BLOCK_C // 2) + tl.arange(0, BLOCK_C // 2)
        ok = r_ok[:, None] & (j < C // 2)[None, :]
        code = tl.load(w_ptr + r[:, None].to(tl.int64) * (C // 2) + j[None, :], mask=ok, other=0).to(tl.int32)
        s = _ue8m0(tl.load(s_ptr + r[:, None].to(tl.int64) * S_COLS + j[None, :] // 16, mask=ok, other=0).to(tl.int32))
        y = tl.interleave(_e2m1(code & 0xF) * s, _e2m1(code >> 4) * s)
    else:
        c0 = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        ok0 = r_ok[:, None] & (c0 < C)[None, :]
        q = tl.load(w_ptr + r[:, None].to(tl.int64) * C + c0[None, :], mask=ok0, other=0)
        sb = tl.load(s_ptr + (r[:, None] // SR).to(tl.int64) * S_COLS + c0[None, :] // SC, mask=ok0, other=0)
        y = q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * _ue8m0(sb.to(tl.int32))
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    _store(out_ptr + r[:, None].to(tl.int64) * C + c[None, :], y, r_ok[:, None] & (c < C)[None, :], BF16)


def _launch(w: torch.Tensor, s: torch.Tensor, fmt: str, block: tuple[int, int], rows: int, cols: int,
            dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(rows, cols, dtype=dtype, device=w.device)
    bf16 = dtype == torch.bfloat16
    _dequant_kernel[(triton.cdiv(rows, BLOCK_R), triton.cdiv(cols, BLOCK_C))](
        w.view(torch.uint8), s.view(torch.uint8), out.view(torch.int16) if bf16 else out, rows, cols, s.shape[-1],
        FMT=fmt, SR=block[0], SC=block[1], BF16=bf16, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=4)
    return out


def dequantise(w: Packed, dtype: torch.dtype) -> torch.Tensor:
    """The floats [O, D] of a decodable packed weight (FP4: D even)."""
    rows, cols = w.shape
    return _launch(w.data.contiguous(), w.scale.contiguous(), w.fmt, w.scale_block(), rows, cols, dtype)


def dequantise_fp4_stack(w: torch.Tensor, s: torch.Tensor, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """FP4 experts ``w`` [E, N, K / 2] with scales ``s`` [E, N, K / 32] -> floats [E, N, K]."""
    e, n = w.shape[:2]
    out = _launch(w.reshape(e * n, -1).contiguous(), s.reshape(e * n, -1).contiguous(), "fp4", (1, 32), e * n,
                  in_features, dtype)
    return out.view(e, n, in_features)
