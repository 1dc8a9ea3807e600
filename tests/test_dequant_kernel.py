"""A packed weight's floats in one pass (``model.kernels.dequant``) against ``model.checkpoint``'s
dequantisation: the same bits, FP8 of 32 x 32, 1 x 32 and 128 x 128 blocks and FP4 rows and
expert stacks, tails no tile divides; and a prefill of many rows on a packed weight (the floats
made once, then torch's GEMM) against the twin, bit for bit.

The kernel runs on CUDA when present, else under ``TRITON_INTERPRET=1``, else these skip (the
twins are the checkpoint's own functions, tested in ``tests/test_checkpoint.py``).
"""
from __future__ import annotations

import pytest
import torch

import model.kernels as kernels
from model.checkpoint import dequantize_tensor
from model.linear import Linear
from tests.test_moe_fp4 import packed_moe
from tests.test_packed_gemm import DEVICE, needs_triton, rows

DTYPES = [torch.bfloat16, torch.float32]


def packed(out_f: int, in_f: int, fmt: str, block: int, seed: int) -> Linear:
    layer = Linear(in_f, out_f, block=block)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # magnitudes across 2^-12 .. 2^6, so blocks' scales differ widely
        layer.weight.copy_(torch.randn(out_f, in_f, generator=g) * 2.0 ** torch.randint(-12, 6, (out_f, 1), generator=g))
    layer.pack(fmt)
    return layer.to(DEVICE)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("fmt,block,shape", [("fp8", 32, (70, 300)), ("fp8", 128, (200, 260)), ("fp4", 32, (45, 330)),
                                             ("fp4", 32, (33, 64))],
                         ids=["fp8-32", "fp8-128", "fp4-tails", "fp4-whole"])
def test_the_floats_are_the_checkpoints_bits(fmt, block, shape, dtype, monkeypatch):
    monkeypatch.setattr(kernels, "_FAILED", {})
    layer = packed(*shape, fmt, block, seed=shape[0])
    w = layer.gemv_weight()
    assert w.decodable()
    got = kernels.dequantised(w, dtype)
    want = dequantize_tensor(fmt, layer.weight, layer.scale, shape, block=block, dtype=dtype)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    assert not kernels._FAILED  # the kernel ran, not the twin


@needs_triton
def test_fp8_rows_of_one_by_32_scales_decode_by_row():
    """A scale a row per 32 inputs (the shapes say 1 x 32, not 32 x 32)."""
    from model.kernels.dequant import dequantise

    q = torch.randint(0, 256, (40, 96), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    q[(q & 0x7F) == 0x7F] = 0  # no NaN codes
    s = torch.randint(100, 140, (40, 3), generator=torch.Generator().manual_seed(4), dtype=torch.uint8)
    data, scale = q.view(torch.float8_e4m3fn).to(DEVICE), s.view(torch.float8_e8m0fnu).to(DEVICE)
    w = kernels.Packed(data, scale, "fp8", (1, 32), 96, None)
    want = dequantize_tensor("fp8", data, scale, (40, 96), block=32, dtype=torch.float32)
    assert torch.equal(dequantise(w, torch.float32), want)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_an_expert_stacks_floats_are_each_experts(dtype, monkeypatch):
    monkeypatch.setattr(kernels, "_FAILED", {})
    stack = packed_moe(torch.float32).grouped.w2
    n = stack.weight.shape[0]
    got = stack.dense(1, n, dtype)
    for e in range(1, n):
        want = dequantize_tensor("fp4", stack.weight[e], stack.scale[e], (stack.weight.shape[1], stack.in_features),
                                 dtype=dtype)
        assert torch.equal(got[e - 1], want), e
    assert not kernels._FAILED


@needs_triton
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_a_prefill_of_many_rows_is_the_twins_product(fmt, monkeypatch):
    """From ``gemm.DEQUANT_ROWS`` rows on, a packed linear layer runs the same GEMM on the same
    floats as its twin (``F.linear`` on ``dense_weight``): equal outputs, bit for bit; below it,
    the registers' kernel, equal to a few rounding steps."""
    from model.kernels import gemm

    monkeypatch.setattr(kernels, "_FAILED", {})
    monkeypatch.setattr(gemm, "DEQUANT_ROWS", 64)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    layer = packed(96, 128, fmt, 32, seed=8)
    x = rows(80, 128, seed=9, dtype=dtype)
    twin = torch.nn.functional.linear(x, layer.dense_weight(dtype))
    with torch.no_grad():
        assert torch.equal(layer(x), twin)
        few = layer(x[:40])
    assert ((few.float() - twin[:40].float()).norm() / twin[:40].float().norm()).item() < 1e-2
