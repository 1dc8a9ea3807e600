"""The grouped MoE's routing kernels (``model.kernels.routing``) against their torch twins
(``model.moe.GroupedExperts``' own code): on CUDA, else under ``TRITON_INTERPRET=1``, else
skipped; and the grouped MoE with them against the reference loop, where they run."""
from __future__ import annotations

import pytest
import torch

from model import kernels
from model.args import ModelArgs
from model.kernels import triton_available
from model.moe import MoE, swiglu

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(not triton_available(),
                                  reason="needs Triton with CUDA, or TRITON_INTERPRET=1 for its CPU interpreter")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("limit", [0.0, 7.0])
def test_routed_swiglu(dtype, limit) -> None:
    from model.kernels.routing import routed_swiglu

    g = torch.Generator().manual_seed(1)
    gate, up = ((torch.randn(37, 300, generator=g) * 4).to(DEVICE, dtype) for _ in range(2))
    route = torch.rand(37, generator=g).to(DEVICE)
    want = (route[:, None] * swiglu(gate, up, limit)).to(dtype)
    got = routed_swiglu(gate, up, route, limit)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-5)
    if limit:  # the clamps bite: the same values as the twin's clamped inputs give
        assert (gate.float() > limit).any() and (up.float().abs() > limit).any()


@needs_kernel
@pytest.mark.parametrize("held", [None, 40])
def test_slot_sum(held) -> None:
    """Each token's k rows summed in slot order; rows from the last group's end on (another
    rank's, never written: NaN here) read as zeros."""
    from model.kernels.routing import slot_sum

    g = torch.Generator().manual_seed(2)
    T, k, D = 13, 4, 300
    order = torch.randperm(T * k, generator=g).to(DEVICE)
    out = torch.randn(T * k, D, generator=g).to(DEVICE, torch.bfloat16)
    ends = torch.tensor([10, 25, T * k if held is None else held], dtype=torch.int32, device=DEVICE)
    if held is not None:
        out[held:] = float("nan")
    unsorted = torch.empty_like(out).index_copy_(0, order, out)
    mine = torch.empty(T * k, dtype=torch.bool, device=DEVICE).index_copy_(0, order, torch.arange(T * k, device=DEVICE) < int(ends[-1]))
    want = torch.where(mine[:, None], unsorted, 0).view(T, k, D).float().sum(1)
    got = slot_sum(out, order, k, ends)
    assert got.dtype == torch.float32 and not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@needs_kernel
def test_grouped_moe_with_the_routing_kernels_matches_the_loop(monkeypatch) -> None:
    """A MoE of ``tiny`` on stacked experts: the grouped path (the routing kernels on) against
    the reference loop, to the rounding of the SiLU's exponential and the sums' order; and
    below ``ROUTING_ROWS`` the kernels step aside."""
    torch.manual_seed(0)
    args = ModelArgs.preset("tiny")
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # torch's grouped GEMM on CUDA: bf16
    moe = MoE(args)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.05)
    moe = moe.to(DEVICE, dtype)
    moe.stack_experts()
    x = torch.randn(50, args.hidden_size, device=DEVICE).to(dtype)
    monkeypatch.setattr(kernels, "ROUTING_ROWS", 0)  # 50 tokens x top-2: fewer rows than a prefill's
    calls = []
    real = kernels.slot_sum
    monkeypatch.setattr(kernels, "slot_sum", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        assert moe.runs_grouped(x)
        grouped = moe(x)
        monkeypatch.setenv("DSAGENT_GROUPED_MOE", "0")
        loop = moe(x)
    assert calls and "MoE routing kernel" not in kernels._FAILED  # the kernels ran, not their twins
    monkeypatch.setattr(kernels, "ROUTING_ROWS", 101)
    assert kernels._routing_runs(torch.empty(101, 1, device=DEVICE)) and not kernels._routing_runs(
        torch.empty(100, 1, device=DEVICE))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(grouped.float(), loop.float(), rtol=tol, atol=tol * loop.float().abs().max().item())
