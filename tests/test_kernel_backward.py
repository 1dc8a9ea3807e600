"""The closed-form backward passes of ``model.kernels.backward`` against autograd through the
twins: RoPE, RMSNorm, the mHC collapse and expand, as training calls them
(``model.kernels.rope`` / ``rms_norm`` / ``hc_collapse`` / ``hc_expand`` with a gradient
wanted). Forward values are the twin's (on the CPU) or the kernel's (CUDA, or
``TRITON_INTERPRET=1``); gradients agree with autograd's up to float rounding.
"""
from __future__ import annotations

import pytest
import torch

from model import kernels
from model.kernels import hc_collapse_ref, hc_expand_ref, rms_norm_ref, rope_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]


def _compare(fast, twin, inputs: list[torch.Tensor], wanted: list[int], dtype: torch.dtype, exact_forward: bool):
    """Forward and the gradients of ``wanted`` inputs of ``fast`` (model.kernels, the
    Function path) against ``twin`` under autograd, for a random output gradient."""
    a, b = _leaves(*inputs), _leaves(*inputs)
    for i, t in enumerate(b):
        t.requires_grad_(i in wanted)
    for i, t in enumerate(a):
        t.requires_grad_(i in wanted)
    ya, yb = fast(*a), twin(*b)
    assert type(ya.grad_fn).__name__ in {f"{n}Backward" for n in ("Rope", "RMSNorm", "HcCollapse", "HcExpand")}
    tol = dict(rtol=0, atol=0) if exact_forward else dict(rtol=1e-5, atol=1e-5)
    if dtype == torch.bfloat16 and not exact_forward:
        tol = dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(ya, yb, **tol)
    g = torch.randn(ya.shape, generator=torch.Generator().manual_seed(7)).to(ya.device, ya.dtype)
    ya.backward(g)
    yb.backward(g)
    grad_tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for i in wanted:
        assert a[i].grad is not None and b[i].grad is not None, i
        torch.testing.assert_close(a[i].grad, b[i].grad, **grad_tol, msg=f"input {i}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_backward_is_the_inverse_rotation(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 24, generator=g).to(DEVICE, dtype)
    freqs = torch.arange(5).float()[:, None] * torch.rand(4, generator=g)[None, :]
    cos, sin = freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)
    _compare(kernels.rope, rope_ref, [x, cos, sin], [0], dtype, exact_forward=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [True, False], ids=["weight", "no-weight"])
def test_rms_norm_backward(dtype, weighted):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 7, 64, generator=g) * 3).to(DEVICE, dtype)
    if weighted:
        w = (torch.rand(64, generator=g) + 0.5).to(DEVICE, dtype)
        _compare(lambda x, w: kernels.rms_norm(x, w, 1e-6), lambda x, w: rms_norm_ref(x, w, 1e-6), [x, w], [0, 1],
                 dtype, exact_forward=not kernels.enabled(x))
    else:
        _compare(lambda x: kernels.rms_norm(x, None, 1e-6), lambda x: rms_norm_ref(x, None, 1e-6), [x], [0],
                 dtype, exact_forward=not kernels.enabled(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_collapse_backward(dtype):
    g = torch.Generator().manual_seed(2)
    streams = torch.randn(2, 6, 4, 32, generator=g).to(DEVICE, dtype)
    pre = torch.rand(2, 6, 4, generator=g).to(DEVICE)
    _compare(kernels.hc_collapse, hc_collapse_ref, [streams, pre], [0, 1], dtype, exact_forward=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_expand_backward(dtype):
    g = torch.Generator().manual_seed(3)
    y = torch.randn(2, 6, 32, generator=g).to(DEVICE, dtype)
    residual = torch.randn(2, 6, 4, 32, generator=g).to(DEVICE, dtype)
    post = (2 * torch.rand(2, 6, 4, generator=g)).to(DEVICE)
    comb = torch.rand(2, 6, 4, 4, generator=g).softmax(-1).to(DEVICE)
    _compare(kernels.hc_expand, hc_expand_ref, [y, residual, post, comb], [0, 1, 2, 3], dtype, exact_forward=True)


def test_only_wanted_gradients_are_made():
    """A frozen input gets no gradient; the others still do (needs_input_grad)."""
    y, residual = torch.randn(1, 3, 16, requires_grad=True), torch.randn(1, 3, 4, 16)
    post, comb = torch.rand(1, 3, 4, requires_grad=True), torch.rand(1, 3, 4, 4)
    kernels.hc_expand(y, residual, post, comb).sum().backward()
    assert y.grad is not None and post.grad is not None and residual.grad is None and comb.grad is None
