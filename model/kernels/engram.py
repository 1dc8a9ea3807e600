"""Triton Engram gate: the Engram value gated into the residual streams, one launch where
torch runs about 25 small kernels (casts, the two RMS factors, the weighted dot, the signed
square root, the sigmoid, the mask, the sum and the cast back) in each Engram layer.

Owns ``engram_gate`` (what ``model.kernels.reference.engram_gate_ref`` computes). Not
bit-exact: the sums over a stream's channels run in another order than torch's, so the gate
agrees to a few fp32 ulps; the product and the cast back are rounded as torch rounds them
(bf16: nearest even, on the bits).

Does not own: the hashed rows and their projection (``model.model.Engram``), or choosing
kernel or twin (``model.kernels``). Imported only when Triton is importable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.kernels.fused import _store, unfused


@triton.jit
def _engram_gate_kernel(s_ptr, key_ptr, value_ptr, qw_ptr, kw_ptr, live_ptr, out_ptr, D, s_key, s_value, eps,
                        HC: tl.constexpr, BLOCK_D: tl.constexpr, LIVE: tl.constexpr, BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # one token's stream k
    k = tl.program_id(1)
    c = tl.arange(0, BLOCK_D)
    m = c < D
    h = tl.load(s_ptr + (row * HC + k) * D + c, mask=m, other=0.0).to(tl.float32)
    key = tl.load(key_ptr + row * s_key + k * D + c, mask=m, other=0.0).to(tl.float32)
    w = tl.load(qw_ptr + k * D + c, mask=m, other=0.0).to(tl.float32) * tl.load(kw_ptr + k * D + c, mask=m,
                                                                              other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(h * h, 0) / D + eps) * tl.math.rsqrt(tl.sum(key * key, 0) / D + eps)
    dot = tl.sum(h * w * key, 0) * rstd * (1.0 / tl.sqrt(D.to(tl.float32)))
    root = tl.sqrt(tl.maximum(tl.abs(dot), 1e-6))
    root = tl.where(dot.to(tl.int32, bitcast=True) < 0, -root, root)  # copysign: the sign bit, -0.0 too
    gate = 1.0 / (1.0 + tl.exp(-root))
    if LIVE:
        gate = tl.where(tl.load(live_ptr + row) != 0, gate, 0.0)
    out = h + gate * tl.load(value_ptr + row * s_value + c, mask=m, other=0.0).to(tl.float32)
    _store(out_ptr + (row * HC + k) * D + c, out, m, BF16)


def engram_gate(streams: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_weight: torch.Tensor,
                k_weight: torch.Tensor, live: torch.Tensor | None, eps: float) -> torch.Tensor:
    """streams [..., hc, D] (fp32 / bf16), key [..., hc * D] and value [..., D] (rows may be
    strided views of one projection), weights [hc, D], live [...] bool or None -> streams' shape
    and dtype."""
    hc, D = streams.shape[-2:]
    lead = streams.shape[:-2]
    assert key.shape == lead + (hc * D,) and value.shape == lead + (D,) and q_weight.shape == k_weight.shape == (hc, D)
    assert streams.dtype in (torch.float32, torch.bfloat16) and key.stride(-1) == value.stride(-1) == 1
    assert live is None or (live.shape == lead and live.dtype == torch.bool)
    streams = streams.contiguous()
    key, value = key.reshape(-1, hc * D), value.reshape(-1, D)
    out = torch.empty_like(streams)
    R = key.shape[0]
    if R == 0:
        return out
    bf16 = streams.dtype == torch.bfloat16
    block = triton.next_power_of_2(D)
    _engram_gate_kernel[(R, hc)](streams, key, value, q_weight.contiguous(), k_weight.contiguous(),
                                 streams if live is None else live.contiguous(),
                                 out.view(torch.int16) if bf16 else out, D, key.stride(0), value.stride(0), float(eps),
                                 HC=hc, BLOCK_D=block, LIVE=live is not None, BF16=bf16,
                                 num_warps=4 if block <= 1024 else 8, **unfused())
    return out
