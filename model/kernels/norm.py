"""Triton RMSNorm: one launch per call where torch runs seven or eight (cast, square, mean,
add, rsqrt, product, cast back, weight product), about five calls per layer and decode step.

Owns ``rms_norm`` (what ``model.kernels.reference.rms_norm_ref`` computes). Not bit-exact:
the row's sum of squares is reduced in another order than torch's and ``rsqrt`` may differ
in the last place, so the normalised values agree to a few fp32 ulps; the casts and the
weight product are rounded as torch rounds them (bf16: nearest even, on the bits).

Does not own: choosing kernel or twin (``model.kernels``). Imported only when Triton is importable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.kernels.fused import _chain, _rms_normed, _store, chained


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, eps, BLOCK_D: tl.constexpr, BF16: tl.constexpr,
                     WEIGHT: tl.constexpr = True, PDL: tl.constexpr = False):
    _chain(PDL)
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_D)
    live = c < D
    h = tl.load(x_ptr + row * D + c, mask=live, other=0.0).to(tl.float32)
    if WEIGHT:
        w = tl.load(w_ptr + c, mask=live, other=0.0).to(tl.float32)
    else:  # a weight of ones: the products are exact
        w = tl.full([BLOCK_D], 1.0, tl.float32)
    _store(out_ptr + row * D + c, _rms_normed(h, w, D, eps, BF16), live, BF16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., D] in fp32 or bf16; weight [D] of the same dtype, or None (no weight).
    ``out_dtype`` fp32 for a bf16 x without weight: the norm of ``x.float()``, read from x."""
    D = x.shape[-1]
    assert weight is None or (weight.shape == (D,) and x.dtype == weight.dtype)
    assert x.dtype in (torch.float32, torch.bfloat16)
    assert out_dtype in (None, x.dtype) or (out_dtype == torch.float32 and weight is None)
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    bf16 = out.dtype == torch.bfloat16
    block = triton.next_power_of_2(D)
    _rms_norm_kernel[(x.numel() // D,)](x, x if weight is None else weight.contiguous(),
                                        out.view(torch.int16) if bf16 else out, D, float(eps), BLOCK_D=block,
                                        BF16=bf16, WEIGHT=weight is not None, num_warps=4 if block <= 1024 else 8,
                                        **chained(x))
    return out
