"""The grouped MoE's work around its GEMMs in a prefill, one pass each.

``routed_swiglu(gate, up, route, limit)``: ``route * swiglu(gate, up, limit)`` rounded to the
rows' dtype (``GroupedExperts`` on float stacks: the w1 and w3 products of the rows sorted by
expert, each row's route weight), where torch makes eight passes over [rows, inter] in fp32
(two casts, two clamps, the SiLU, two products, the cast back).

``slot_sum(out, order, k, ends)``: each token's k rows of ``out`` (the w2 products, rows
sorted by expert: pair t * k + j at position p where order[p] = t * k + j) summed in fp32 in
slot order; positions from the last group's end on (another rank's experts, never written)
count as zeros. torch puts
the rows back in pair order, casts them to fp32 and sums: three passes and two [rows, D]
copies.

Their twins are that torch code (``model.moe``); the products and sums are fp32, the SiLU's
exponential Triton's, so the two agree to a rounding, not bit for bit
(``tests/test_routing_kernel.py``). Does not own: the sort, the GEMMs, the gate
(``model.moe``), the choice of kernel or twin (``model.kernels``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.kernels.fused import _store
from model.kernels.moe import _swiglu

BLOCK_R, BLOCK_C = 16, 256  # a program's rows x channels


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, route_ptr, out_ptr, R, C, limit, CLAMP: tl.constexpr, BF16: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (r < R)[:, None] & (c < C)[None, :]
    at = r.to(tl.int64)[:, None] * C + c[None, :]
    g = tl.load(g_ptr + at, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + at, mask=ok, other=0.0).to(tl.float32)
    route = tl.load(route_ptr + r, mask=r < R, other=0.0).to(tl.float32)
    y = route[:, None] * _swiglu(g, u, limit, False, CLAMP)  # g, u already hold the rows' dtype's values
    _store(out_ptr + at, y, ok, BF16)


@triton.jit
def _slot_sum_kernel(out_ptr, inv_ptr, sum_ptr, held_ptr, T, D, K: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_C: tl.constexpr):
    held = tl.load(held_ptr)
    t = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_ok = t < T
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):
        p = tl.load(inv_ptr + t.to(tl.int64) * K + j, mask=t_ok, other=0)
        take = t_ok & (p < held)
        row = tl.load(out_ptr + p.to(tl.int64)[:, None] * D + c[None, :], mask=take[:, None] & (c < D)[None, :],
                      other=0.0)
        acc += row.to(tl.float32)
    tl.store(sum_ptr + t.to(tl.int64)[:, None] * D + c[None, :], acc, mask=t_ok[:, None] & (c < D)[None, :])


def routed_swiglu(gate: torch.Tensor, up: torch.Tensor, route: torch.Tensor, limit: float) -> torch.Tensor:
    """gate, up [R, C] (one dtype), route [R] -> [R, C] in gate's dtype."""
    assert gate.shape == up.shape and gate.dtype == up.dtype and route.shape == gate.shape[:1]
    gate, up, route = gate.contiguous(), up.contiguous(), route.contiguous()
    R, C = gate.shape
    out = torch.empty_like(gate)
    bf16 = gate.dtype == torch.bfloat16
    if R and C:
        _swiglu_kernel[(triton.cdiv(R, BLOCK_R), triton.cdiv(C, BLOCK_C))](
            gate, up, route, out.view(torch.int16) if bf16 else out, R, C, float(limit), CLAMP=limit > 0, BF16=bf16,
            BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=4)
    return out


def slot_sum(out: torch.Tensor, order: torch.Tensor, k: int, ends: torch.Tensor) -> torch.Tensor:
    """out [T * k, D] in sorted order, ``order`` [T * k], the groups' ``ends`` -> [T, D] fp32."""
    M, D = out.shape
    assert order.shape == (M,) and M % k == 0 and ends.numel() > 0
    inv = torch.empty_like(order)
    inv[order] = torch.arange(M, device=order.device, dtype=order.dtype)
    T = M // k
    total = torch.empty(T, D, dtype=torch.float32, device=out.device)
    if T and D:
        _slot_sum_kernel[(triton.cdiv(T, BLOCK_R), triton.cdiv(D, BLOCK_C))](
            out.contiguous(), inv, total, ends[-1:], T, D, K=k, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=4)
    return total
