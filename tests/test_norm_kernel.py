"""The RMSNorm kernel (``model.kernels.norm``) against its twin ``rms_norm_ref``, which is
``model.layer.RMSNorm``'s own code. The kernel sums the squares in another order, so
fp32 results agree to a few ulps and bf16 ones to one bf16 step on the rare value that
straddles a rounding boundary. Kernel tests run on CUDA, or under ``TRITON_INTERPRET=1``,
else skip; the twin test always runs.
"""
from __future__ import annotations

import pytest
import torch

from model.kernels import rms_norm, rms_norm_ref, triton_available
from model.layer import RMSNorm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(not triton_available(),
                                  reason="needs Triton with CUDA, or TRITON_INTERPRET=1 for its CPU interpreter")


def test_the_model_norm_is_the_twin(monkeypatch) -> None:
    """Off the kernel path the model's norm is its twin, bit for bit (on it, a few ulps:
    the kernel tests below)."""
    monkeypatch.setenv("DSAGENT_KERNELS", "0")
    norm = RMSNorm(48, 1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 48)
    y = norm(x)
    assert torch.equal(y, rms_norm_ref(x, norm.weight, 1e-6))
    torch.testing.assert_close((y / norm.weight).pow(2).mean(-1), torch.ones(2, 3), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 1, 2048), (3, 5, 512), (2, 64), (4, 576), (1, 2, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eps", [1e-6, 1e-20])
def test_kernel_matches_twin(shape, dtype, eps) -> None:
    from model.kernels import norm

    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(*shape, generator=g) * 4).to(dtype)
    x.view(-1, shape[-1])[0] = 0.0  # an all-zero row stays zero
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    x, w = x.to(DEVICE), w.to(DEVICE)
    got, want = norm.rms_norm(x, w, eps), rms_norm_ref(x, w, eps)
    assert got.dtype == dtype and got.shape == x.shape and torch.isfinite(got).all()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        step = torch.finfo(torch.bfloat16).eps * want.float().abs()  # one bf16 step at each value
        assert ((got.float() - want.float()).abs() <= step + 1e-30).all()
        assert (got != want).float().mean() < 0.02  # a straddling value now and then, not a bias


@needs_kernel
def test_the_dispatcher_runs_the_kernel_in_training_too(monkeypatch) -> None:
    """One launch without a gradient, and one in a training forward (backward.RMSNorm
    computes the gradient in torch)."""
    from model.kernels import norm

    calls = []
    real = norm.rms_norm
    monkeypatch.setattr(norm, "rms_norm", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(3, 32, device=DEVICE)
    w = torch.ones(32, device=DEVICE, requires_grad=True)
    with torch.no_grad():
        rms_norm(x, w, 1e-6)
    assert calls == [1]
    rms_norm(x, w, 1e-6).sum().backward()  # training: backward.RMSNorm around the kernel
    assert calls == [1, 1] and w.grad is not None


def test_a_weightless_norm_is_the_norm_with_unit_weights() -> None:
    """The mHC mixes normalise without a weight (``weight=None``): the same values as a
    weight of ones, on the twin path and, where it runs, the kernel's."""
    x = torch.randn(2, 3, 64, device=DEVICE) * 3
    ones = torch.ones(64, device=DEVICE)
    assert torch.equal(rms_norm_ref(x, None, 1e-20), rms_norm_ref(x, ones, 1e-20))
    if triton_available():
        from model.kernels import norm

        assert torch.equal(norm.rms_norm(x, None, 1e-20), norm.rms_norm(x, ones, 1e-20))
        assert torch.equal(rms_norm(x, None, 1e-20), norm.rms_norm(x, None, 1e-20))


def test_an_upcast_norm_is_the_norm_of_the_float_copy(monkeypatch) -> None:
    """``upcast=True`` (the mHC mixes' norm of the bf16 streams): the fp32 norm of
    ``x.float()``, bit for bit with the same path run on that copy — the kernel reading the
    bf16 rows itself where it runs, the twin elsewhere."""
    x = (torch.randn(2, 3, 4 * 64, device=DEVICE) * 3).bfloat16()
    got = rms_norm(x, None, 1e-20, upcast=True)
    assert got.dtype == torch.float32 and torch.equal(got, rms_norm(x.float(), None, 1e-20))
    monkeypatch.setenv("DSAGENT_KERNELS", "0")
    assert torch.equal(rms_norm(x, None, 1e-20, upcast=True), rms_norm_ref(x.float(), None, 1e-20))
