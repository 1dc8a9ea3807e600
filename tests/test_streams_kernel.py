"""The mHC stream kernels (``model.kernels.streams``) against their twins ``hc_collapse_ref`` /
``hc_expand_ref``, which are ``model.model.hc_collapse`` / ``hc_expand``'s own code: the
same fp32 products and sums in the same order, so bit for bit. Kernel tests run on CUDA,
or under ``TRITON_INTERPRET=1``, else skip; the twin tests always run.
"""
from __future__ import annotations

import pytest
import torch

from model.kernels import hc_collapse, hc_collapse_ref, hc_expand, hc_expand_ref, triton_available

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(not triton_available(),
                                  reason="needs Triton with CUDA, or TRITON_INTERPRET=1 for its CPU interpreter")


def _inputs(lead, hc, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    streams = (torch.randn(*lead, hc, D, generator=g) * 3).to(dtype)
    y = (torch.randn(*lead, D, generator=g) * 3).to(dtype)
    pre, post = torch.rand(*lead, hc, generator=g), 2 * torch.rand(*lead, hc, generator=g)
    comb = torch.rand(*lead, hc, hc, generator=g).softmax(-1)
    return [t.to(DEVICE) for t in (streams, y, pre, post, comb)]


def test_twins_compute_the_mhc_maths() -> None:
    """Against the plain formulas (einsum, sum over streams): equal to fp32 rounding."""
    streams, y, pre, post, comb = _inputs((2, 3), 4, 40, torch.float32)
    torch.testing.assert_close(hc_collapse_ref(streams, pre), (pre.unsqueeze(-1) * streams).sum(-2))
    want = post.unsqueeze(-1) * y.unsqueeze(-2) + torch.einsum("bsjk,bsjd->bskd", comb, streams)
    torch.testing.assert_close(hc_expand_ref(y, streams, post, comb), want)


def test_twins_run_with_gradients() -> None:
    """Training takes the twins (the kernels have no backward): gradients reach every input."""
    streams, y, pre, post, comb = (t.cpu().requires_grad_() for t in _inputs((1, 2), 4, 8, torch.float32))
    (hc_collapse(streams, pre).sum() + hc_expand(y, streams, post, comb).square().sum()).backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (streams, y, pre, post, comb))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@needs_kernel
@pytest.mark.parametrize("lead,hc,D", [((1, 1), 4, 4096), ((2, 3), 4, 128), ((3, 1), 2, 100), ((1, 5), 4, 1500)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_match_the_twins_bit_for_bit(lead, hc, D, dtype) -> None:
    from model.kernels import streams as kernel

    streams, y, pre, post, comb = _inputs(lead, hc, D, dtype, seed=D)
    got, want = kernel.hc_collapse(streams, pre), hc_collapse_ref(streams, pre)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(_bits(got), _bits(want)), f"collapse: {(got != want).sum().item()} values differ"
    got, want = kernel.hc_expand(y, streams, post, comb), hc_expand_ref(y, streams, post, comb)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(_bits(got), _bits(want)), f"expand: {(got != want).sum().item()} values differ"


@needs_kernel
def test_the_dispatcher_runs_the_kernels_in_training_too(monkeypatch) -> None:
    """Without a gradient and with one (training's forward, under backward.HcExpand): the kernels."""
    from model.kernels import streams as kernel

    calls = []
    for name in ("hc_collapse", "hc_expand"):
        real = getattr(kernel, name)
        monkeypatch.setattr(kernel, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    streams, y, pre, post, comb = _inputs((1, 2), 4, 64, torch.float32)
    hc_collapse(streams, pre), hc_expand(y, streams, post, comb)
    assert calls == ["hc_collapse", "hc_expand"]
    hc_expand(y.requires_grad_(), streams, post, comb).sum().backward()
    assert calls == ["hc_collapse", "hc_expand", "hc_expand"] and y.grad is not None
