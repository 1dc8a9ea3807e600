"""Triton RoPE: the rotation of a tensor's trailing channel pairs in one launch.

Owns ``rope`` (what ``model.kernels.reference.rope_ref`` computes: the trailing 2·r channels
of each row rotated in adjacent pairs by per-position cos / sin, the rest copied) — one
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
