"""Triton mHC stream kernels: collapse the residual streams into a site's input, and expand
the site's output back into them, one launch each.

Owns ``hc_collapse`` and ``hc_expand`` (what ``model.kernels.reference.hc_collapse_ref`` /
``hc_expand_ref`` compute — the model's own code — twice per layer and decode step each,
where torch runs about four and ten small kernels: fp32 casts, products, an einsum's
layout copies and matmul, sums, the cast back). Bit-exact with the twins: the same fp32
products and sums in the same order, each rounded on its own (``enable_fp_fusion=False``),
and the cast back rounded to nearest even (on the bits for bf16).

Does not own: the mixes ``pre`` / ``post`` / ``comb`` (``model.kernels.hc_split``), or
choosing kernel or twin (``model.kernels``). Imported only when Triton is importable.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from model.kernels.fused import _bf16_bits


@triton.jit
def _store(ptr, y, mask, BF16: tl.constexpr):
    if BF16:
        tl.store(ptr, _bf16_bits(y), mask=mask)
    else:
        tl.store(ptr, y.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _collapse_kernel(s_ptr, pre_ptr, out_ptr, D, HC: tl.constexpr, BLOCK_D: tl.constexpr, BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # one token
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    live = c < D
    acc = tl.load(pre_ptr + row * HC) * tl.load(s_ptr + row * HC * D + c, mask=live, other=0.0).to(tl.float32)
    for k in tl.static_range(1, HC):
        acc = acc + tl.load(pre_ptr + row * HC + k) * tl.load(s_ptr + (row * HC + k) * D + c, mask=live,
                                                               other=0.0).to(tl.float32)
    _store(out_ptr + row * D + c, acc, live, BF16)


@triton.jit
def _expand_kernel(y_ptr, r_ptr, post_ptr, comb_ptr, out_ptr, D, HC: tl.constexpr, BLOCK_D: tl.constexpr,
                   BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    live = c < D
    y = tl.load(y_ptr + row * D + c, mask=live, other=0.0).to(tl.float32)
    for k in tl.static_range(HC):
        acc = tl.load(post_ptr + row * HC + k) * y
        for j in tl.static_range(HC):  # comb[j, k] weighs stream j into stream k
            r = tl.load(r_ptr + (row * HC + j) * D + c, mask=live, other=0.0).to(tl.float32)
            acc = acc + tl.load(comb_ptr + (row * HC + j) * HC + k) * r
        _store(out_ptr + (row * HC + k) * D + c, acc, live, BF16)


def _launch(kernel, rows: int, D: int, *args, bf16: bool):
    block = min(1024, triton.next_power_of_2(D))
    options = {} if os.environ.get("TRITON_INTERPRET") == "1" else {"enable_fp_fusion": False}
    kernel[(rows, triton.cdiv(D, block))](*args, BLOCK_D=block, BF16=bf16, **options)


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """streams [..., hc, D] (fp32 / bf16), pre [..., hc] fp32 -> [..., D] in streams' dtype."""
    hc, D = streams.shape[-2:]
    assert pre.shape == streams.shape[:-1] and pre.dtype == torch.float32
    streams, pre = streams.contiguous(), pre.contiguous()
    out = torch.empty(streams.shape[:-2] + (D,), dtype=streams.dtype, device=streams.device)
    bf16 = streams.dtype == torch.bfloat16
    if out.numel():
        _launch(_collapse_kernel, out.numel() // D, D, streams, pre, out.view(torch.int16) if bf16 else out, D, hc,
                bf16=bf16)
    return out


def hc_expand(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """y [..., D], residual [..., hc, D] (fp32 / bf16), post [..., hc], comb [..., hc, hc] fp32
    -> [..., hc, D] in residual's dtype."""
    hc, D = residual.shape[-2:]
    assert y.shape == residual.shape[:-2] + (D,) and post.shape == residual.shape[:-1]
    assert comb.shape == residual.shape[:-1] + (hc,) and post.dtype == comb.dtype == torch.float32
    y, residual, post, comb = y.contiguous(), residual.contiguous(), post.contiguous(), comb.contiguous()
    out = torch.empty_like(residual)
    bf16 = residual.dtype == torch.bfloat16
    if out.numel():
        _launch(_expand_kernel, y.numel() // D, D, y, residual, post, comb, out.view(torch.int16) if bf16 else out,
                D, hc, bf16=bf16)
    return out
