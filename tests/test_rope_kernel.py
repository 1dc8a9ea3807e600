"""The RoPE kernel (``model.kernels.rotary``) against its twin ``rope_ref``, which is the
model's own rotation (``model.rope.apply_rope`` calls it off the fast path).

Bit for bit: the kernel rounds each fp32 product, sum and difference on its own, as torch
does. Kernel tests run on CUDA, or under ``TRITON_INTERPRET=1`` on the CPU, else skip; the
twin tests always run.
"""
from __future__ import annotations

import pytest
import torch

from model.kernels import rope, rope_ref, triton_available
from model.rope import apply_rope, rope_inv_freq

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(not triton_available(),
                                  reason="needs Triton with CUDA, or TRITON_INTERPRET=1 for its CPU interpreter")


def _tables(S: int, half: int, start: int = 0, inverse: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    inv_freq = torch.rand(half, generator=g) * 0.9 + 1e-4
    freqs = torch.arange(start, start + S).float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    return inv_freq, cos, -sin if inverse else sin


def test_twin_rotates_the_trailing_pairs_and_keeps_the_rest() -> None:
    x = torch.randn(2, 3, 4, 16)
    _, cos, sin = _tables(3, 4)
    y = rope_ref(x, cos, sin)
    assert torch.equal(y[..., :8], x[..., :8])
    e, o = x[..., 8::2], x[..., 9::2]
    c, s = cos[:, None], sin[:, None]
    torch.testing.assert_close(y[..., 8::2], e * c - o * s, rtol=0, atol=0)
    torch.testing.assert_close(y[..., 9::2], e * s + o * c, rtol=0, atol=0)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)  # a rotation keeps lengths


def test_inverse_rope_undoes_rope() -> None:
    x = torch.randn(1, 5, 2, 64)
    pos = torch.arange(100, 105)
    inv = rope_inv_freq(16, 10000.0)
    back = apply_rope(apply_rope(x, pos, inv), pos, inv, inverse=True)
    torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("shape,half", [((1, 1, 16, 512), 32), ((2, 3, 576), 32), ((1, 1, 4, 128), 32),
                                        ((3, 7, 2, 64), 32), ((1, 2, 24), 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inverse", [False, True])
def test_kernel_equals_twin_bit_for_bit(shape, half, dtype, inverse) -> None:
    from model.kernels import rotary

    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    _, cos, sin = _tables(shape[1], half, start=4000, inverse=inverse)
    x, cos, sin = x.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE)
    got = rotary.rope(x, cos, sin)
    want = rope_ref(x, cos, sin)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert torch.equal(got, want), (got - want).abs().max()
    # the in-place form: the same values, written into x's own storage
    y = x.clone()
    assert rotary.rope_(y, cos, sin).data_ptr() == y.data_ptr()
    assert torch.equal(y, want), (y - want).abs().max()


@needs_kernel
def test_in_place_only_where_the_kernel_runs_without_a_gradient() -> None:
    """kernels.rope(..., in_place=True) rotates x itself outside autograd; with a gradient
    wanted (training) it leaves x as it was and returns a new tensor, the gradient the twin's."""
    x = torch.randn(2, 5, 4, 128, device=DEVICE).to(torch.bfloat16)
    _, cos, sin = _tables(5, 32)
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    want = rope_ref(x, cos, sin)
    y = x.clone()
    with torch.no_grad():
        got = rope(y, cos, sin, in_place=True)
    assert got.data_ptr() == y.data_ptr() and torch.equal(got, want)
    z = x.float().requires_grad_(True)
    before = z.detach().clone()
    out = rope(z, cos, sin, in_place=True)
    assert out.data_ptr() != z.data_ptr() and torch.equal(z.detach(), before)
    g = torch.randn(out.shape, device=DEVICE)
    out.backward(g)
    twin = before.clone().requires_grad_(True)
    rope_ref(twin, cos, sin).backward(g)
    torch.testing.assert_close(z.grad, twin.grad, rtol=1e-6, atol=1e-6)


@needs_kernel
def test_the_dispatcher_runs_the_kernel_in_training_too(monkeypatch) -> None:
    """Without a gradient, one launch; with one (training), the forward and the backward
    (the rotation by -sin) each launch it, and the gradient is the twin's."""
    from model.kernels import rotary

    calls = []
    real = rotary.rope
    monkeypatch.setattr(rotary, "rope", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(1, 2, 3, 64, device=DEVICE)
    _, cos, sin = _tables(2, 16)
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    with torch.no_grad():
        rope(x, cos, sin)
    assert calls == [1]
    x.requires_grad_(True)
    g = torch.randn(x.shape, device=DEVICE)
    rope(x, cos, sin).backward(g)  # training: backward.Rope
    assert calls == [1, 1, 1]
    twin_x = x.detach().clone().requires_grad_(True)
    rope_ref(twin_x, cos, sin).backward(g)
    torch.testing.assert_close(x.grad, twin_x.grad, rtol=1e-6, atol=1e-6)
