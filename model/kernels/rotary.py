"""Triton RoPE: the rotation of a tensor's trailing channel pairs in one launch.

Owns ``rope`` (what ``model.kernels.reference.rope_ref`` computes: the trailing 2·r channels
of each row rotated in adjacent pairs by per-position cos / sin, the rest copied; ``rope_``
the same written into its input, touching the rope channels alone) — one
kernel where torch runs about a dozen small ones per call (slices, fp32 casts, four
products, a sum and a difference, stack, cast back, concatenation), three or four calls per
layer and decode step. Bit-exact with the twin: the same fp32 products, sum and difference,
each rounded on its own (``enable_fp_fusion=False`` keeps the compiler from fusing a product
into an FMA), and the same round-to-nearest-even cast back (done on the bits for bf16).

Does not own: the cos / sin tables (``model.rope.apply_rope`` builds them from positions),
or choosing kernel or twin (``model.kernels``). Imported only when Triton is importable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.kernels.fused import _bf16_bits, _chain, _turned, chained, unfused


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, S, H, D, OFF, HALF, BLOCK_D: tl.constexpr, BF16: tl.constexpr,
                 PDL: tl.constexpr = False):
    _chain(PDL)
    row = tl.program_id(0)  # one (batch, position, head) row of D channels
    s = (row // H) % S
    c = tl.arange(0, BLOCK_D)
    live = c < D
    x = tl.load(x_ptr + row * D + c, mask=live, other=0.0).to(tl.float32)
    rot = live & (c >= OFF)
    partner = tl.load(x_ptr + row * D + (c ^ 1), mask=rot, other=0.0).to(tl.float32)  # OFF is even
    j = (c - OFF) // 2
    cs = tl.load(cos_ptr + s * HALF + j, mask=rot, other=0.0)
    sn = tl.load(sin_ptr + s * HALF + j, mask=rot, other=0.0)
    y = tl.where(rot, _turned(x, partner, ((c - OFF) % 2) == 0, cs, sn), x)
    if BF16:
        tl.store(out_ptr + row * D + c, _bf16_bits(y), mask=live)
    else:
        tl.store(out_ptr + row * D + c, y.to(out_ptr.dtype.element_ty), mask=live)


@triton.jit
def _rope_in_place_kernel(x_ptr, out_ptr, cos_ptr, sin_ptr, R, S, H, D, OFF, HALF, BLOCK_R: tl.constexpr,
                          BLOCK_J: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr = False):
    """``_rope_kernel``'s rotation written over the rope channels of BLOCK_R rows (``out`` is
    ``x``, or its int16 view for bf16): each thread loads a pair's even and odd channel before
    it stores either, so no thread overwrites what another has still to read."""
    _chain(PDL)
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    j = tl.arange(0, BLOCK_J)
    live = (row < R)[:, None] & (j < HALF)[None, :]
    s = ((row // H) % S)[:, None]
    at = row.to(tl.int64)[:, None] * D + OFF + 2 * j[None, :]  # the pairs' even channels
    e = tl.load(x_ptr + at, mask=live, other=0.0).to(tl.float32)
    o = tl.load(x_ptr + at + 1, mask=live, other=0.0).to(tl.float32)
    cs = tl.load(cos_ptr + s * HALF + j[None, :], mask=live, other=0.0)
    sn = tl.load(sin_ptr + s * HALF + j[None, :], mask=live, other=0.0)
    ye, yo = _turned(e, o, True, cs, sn), _turned(o, e, False, cs, sn)
    if BF16:
        tl.store(out_ptr + at, _bf16_bits(ye), mask=live)
        tl.store(out_ptr + at + 1, _bf16_bits(yo), mask=live)
    else:
        tl.store(out_ptr + at, ye.to(out_ptr.dtype.element_ty), mask=live)
        tl.store(out_ptr + at + 1, yo.to(out_ptr.dtype.element_ty), mask=live)


ROWS_IN_PLACE = 32  # rows a program of the in-place form turns


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`rope` written into ``x`` (contiguous): only its 2·r rope channels are read and
    written, where :func:`rope` copies every channel (a prefill's queries: 64 of 512). -> x."""
    S, half = cos.shape
    D = x.shape[-1]
    assert x.ndim in (3, 4) and x.shape[1] == S and 2 * half <= D and sin.shape == cos.shape and x.is_contiguous()
    assert cos.dtype == sin.dtype == torch.float32 and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    H = x.shape[2] if x.ndim == 4 else 1
    R = x.numel() // D
    if R:
        cos, sin = cos.contiguous(), sin.contiguous()
        bf16 = x.dtype == torch.bfloat16
        _rope_in_place_kernel[(triton.cdiv(R, ROWS_IN_PLACE),)](
            x, x.view(torch.int16) if bf16 else x, cos, sin, R, S, H, D, D - 2 * half, half, BLOCK_R=ROWS_IN_PLACE,
            BLOCK_J=triton.next_power_of_2(half), BF16=bf16, **unfused(), **chained(x))
    return x


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, D] or [B, S, H, D]; cos, sin fp32 [S, r] with 2·r <= D."""
    S, half = cos.shape
    D = x.shape[-1]
    assert x.ndim in (3, 4) and x.shape[1] == S and 2 * half <= D and sin.shape == cos.shape
    assert cos.dtype == sin.dtype == torch.float32 and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    H = x.shape[2] if x.ndim == 4 else 1
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    out = torch.empty_like(x)
    bf16 = x.dtype == torch.bfloat16
    _rope_kernel[(x.numel() // D,)](x, cos, sin, out.view(torch.int16) if bf16 else out, S, H, D, D - 2 * half, half,
                                    BLOCK_D=triton.next_power_of_2(D), BF16=bf16, **unfused(), **chained(x))
    return out
