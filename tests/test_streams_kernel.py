"""The mHC stream kernels (``model.kernels.streams``) against their twins ``hc_collapse_ref`` /
``hc_expand_ref``, which are ``model.model.hc_collapse`` / ``hc_expand``'s own code: the
same fp32 products and sums in the same order, so bit for bit; and the one-site kernel
``hc_site`` against its parts' twins (the streams bit for bit, the mixes to fp32 rounding).
Kernel tests run on CUDA, or under ``TRITON_INTERPRET=1``, else skip; the twin tests always run.
"""
from __future__ import annotations

import pytest
import torch

from model.kernels import (hc_collapse, hc_collapse_ref, hc_expand, hc_expand_ref, hc_site, hc_site_parts, hc_split_ref,
                           rms_norm_ref, triton_available)

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


def _site_inputs(lead, hc, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed + 1)  # not _inputs' numbers again
    streams, y, pre, post, comb = _inputs(lead, hc, D, dtype, seed)
    M = (2 + hc) * hc
    fn = (torch.randn(M, hc * D, generator=g) / (hc * D) ** 0.5).to(DEVICE)
    scale, base = (1 + torch.rand(3, generator=g)).to(DEVICE), (0.5 * torch.randn(M, generator=g)).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype).to(DEVICE)
    return streams, pre, fn, scale, base, weight, (y, post, comb)


def _site_twins(streams, pre, fn, scale, base, weight, eps, iters, hc_eps, expand):
    """:func:`hc_site_parts` spelled out on the twins alone."""
    if expand is not None:
        streams = hc_expand_ref(expand[0], streams, expand[1], expand[2])
    mixes = torch.nn.functional.linear(rms_norm_ref(streams.flatten(-2).float(), None, eps), fn)
    split = hc_split_ref(mixes, scale, base, streams.shape[-2], iters, hc_eps)
    return (streams, *split, rms_norm_ref(hc_collapse_ref(streams, pre), weight, eps))


SITE = dict(eps=1e-6, norm_eps=1e-6, iters=20, hc_eps=1e-6)


def test_site_parts_are_the_mhc_site() -> None:
    """The parts (every CPU path and training) against the twins spelled out, and the maths'
    own properties: comb doubly stochastic, pre in (0, 1], post in (0, 2), x of unit RMS
    before the weight."""
    streams, pre, fn, scale, base, weight, expand = _site_inputs((2, 3), 4, 48, torch.float32)
    weight = torch.ones_like(weight)
    for exp in (None, expand):
        got = hc_site_parts(streams, pre, fn, scale, base, weight, 1e-6, 1e-6, 20, 1e-6, exp)
        for g, w in zip(got, _site_twins(streams, pre, fn, scale, base, weight, 1e-6, 20, 1e-6, exp)):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)  # equal off the interpreter
        s, p, q, c, x = got
        assert p.min() > 0 and p.max() <= 1 + 1e-5 and q.min() > 0 and q.max() < 2
        torch.testing.assert_close(c.sum(-2), torch.ones_like(p), atol=1e-4, rtol=0)
        torch.testing.assert_close(c.sum(-1), torch.ones_like(p), atol=1e-2, rtol=0)  # rows: 20 steps near
        torch.testing.assert_close(x.square().mean(-1), torch.ones_like(x[..., 0]), atol=1e-4, rtol=0)
    assert not torch.equal(got[0], streams)  # the expand took effect


@needs_kernel
@pytest.mark.parametrize("lead,hc,D", [((1, 1), 4, 2048), ((3, 1), 4, 100), ((2, 1), 2, 128), ((1, 1), 4, 4096)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("expanded", [False, True])
def test_site_kernel_matches_its_parts(lead, hc, D, dtype, expanded) -> None:
    """Expanded streams bit for bit (``_expand_kernel``'s sums); mixes to fp32 rounding (the
    dots summed in another order); x as the norm kernel's (a few fp32 ulps, then the cast)."""
    from model.kernels import streams as kernel

    streams, pre, fn, scale, base, weight, expand = _site_inputs(lead, hc, D, dtype, seed=D + expanded)
    expand = expand if expanded else None
    got = kernel.hc_site(streams, pre, fn, scale, base, weight, 1e-6, 1e-6, 20, 1e-6, expand)
    want = _site_twins(streams, pre, fn, scale, base, weight, 1e-6, 20, 1e-6, expand)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
    assert torch.equal(_bits(got[0]), _bits(want[0]))
    for g, w in zip(got[1:4], want[1:4]):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(got[4], want[4], atol=1e-5, rtol=1e-5)
    else:  # a few fp32 ulps can round a bf16 the other way: one bf16 ulp, rarely
        torch.testing.assert_close(got[4].float(), want[4].float(), atol=0, rtol=2 ** -7)
        assert (got[4] != want[4]).float().mean() < 0.01


@needs_kernel
@pytest.mark.parametrize("lead,hc,D,dtype", [((1, 1), 4, 2048, torch.bfloat16), ((3, 1), 4, 100, torch.float32),
                                              ((2, 1), 2, 128, torch.bfloat16)])
@pytest.mark.parametrize("expanded", [False, True])
def test_site_with_its_norm_left_for_later_gives_the_collapse(lead, hc, D, dtype, expanded, monkeypatch) -> None:
    """``norm_later``: the dots launch writes x as the streams collapsed by the incoming pre,
    bit for bit ``hc_collapse`` of the site's streams; streams and mixes the same bits as the
    site with its norm; the dispatcher says whether x still wants the norm."""
    import model.kernels as kernels
    from model.kernels import streams as kernel

    streams, pre, fn, scale, base, weight, expand = _site_inputs(lead, hc, D, dtype, seed=3 * D + expanded)
    expand = expand if expanded else None
    whole = kernel.hc_site(streams, pre, fn, scale, base, weight, 1e-6, 1e-6, 20, 1e-6, expand)
    later = kernel.hc_site(streams, pre, fn, scale, base, weight, 1e-6, 1e-6, 20, 1e-6, expand, norm_later=True)
    for a, b in zip(whole[:4], later[:4]):
        assert torch.equal(_bits(a), _bits(b))
    assert torch.equal(_bits(later[4]), _bits(kernels.hc_collapse(later[0], pre)))
    assert not torch.equal(later[4], whole[4])
    monkeypatch.setattr(kernel, "NORM_LATER", True)
    got = kernels.hc_site(streams, pre, fn, scale, base, weight, eps=1e-6, norm_eps=1e-6, iters=20, hc_eps=1e-6,
                          expand=expand, norm_later=True)
    assert len(got) == 6 and got[5] is True and torch.equal(_bits(got[4]), _bits(later[4]))
    monkeypatch.setattr(kernel, "NORM_LATER", False)  # the request not honoured: x normalised
    got = kernels.hc_site(streams, pre, fn, scale, base, weight, eps=1e-6, norm_eps=1e-6, iters=20, hc_eps=1e-6,
                          expand=expand, norm_later=True)
    assert got[5] is False and torch.equal(_bits(got[4]), _bits(whole[4]))


@needs_kernel
@pytest.mark.parametrize("warps", [1, 2])
def test_site_kernel_with_fewer_finish_warps_matches_its_parts(warps, monkeypatch) -> None:
    """``FINISH_WARPS`` (a sweep's knob): the second launch on 1 or 2 warps, 2,048 channels in
    bf16, against the parts as above (on the GPU a reduction over other warps may sum in another
    order: fp32 rounding)."""
    from model.kernels import streams as kernel

    monkeypatch.setattr(kernel, "FINISH_WARPS", warps)
    streams, pre, fn, scale, base, weight, expand = _site_inputs((2, 1), 4, 2048, torch.bfloat16, seed=warps)
    got = kernel.hc_site(streams, pre, fn, scale, base, weight, 1e-6, 1e-6, 20, 1e-6, expand)
    want = _site_twins(streams, pre, fn, scale, base, weight, 1e-6, 20, 1e-6, expand)
    assert torch.equal(_bits(got[0]), _bits(want[0]))
    for g, w in zip(got[1:4], want[1:4]):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got[4].float(), want[4].float(), atol=0, rtol=2 ** -7)
    assert (got[4] != want[4]).float().mean() < 0.01


@needs_kernel
def test_site_dispatcher_takes_the_kernel_for_decode_steps_only(monkeypatch) -> None:
    """A few tokens without a gradient: the kernel; a prefill chunk's rows, or a gradient
    wanted (training): the parts."""
    from model.kernels import streams as kernel

    calls = []
    real = kernel.hc_site
    monkeypatch.setattr(kernel, "hc_site", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    streams, pre, fn, scale, base, weight, expand = _site_inputs((4, 1), 4, 64, torch.float32)
    got = hc_site(streams, pre, fn, scale, base, weight, expand=expand, **SITE)
    assert calls == [streams.shape]
    want = hc_site_parts(streams, pre, fn, scale, base, weight, *SITE.values(), expand)
    torch.testing.assert_close(got[4], want[4], atol=1e-5, rtol=1e-5)
    long, lpre, *_ = _site_inputs((1, 17), 4, 64, torch.float32)
    hc_site(long, lpre, fn, scale, base, weight, **SITE)
    hc_site(streams, pre, fn.clone().requires_grad_(), scale, base, weight, **SITE)
    assert calls == [streams.shape]


def test_site_overlap_off_cuda_changes_nothing() -> None:
    """``overlap`` asks for the split on a side stream only inside a CUDA graph's capture:
    elsewhere (here on the CPU, or eager on a GPU) the site is the plain one, bit for bit."""
    inputs = _site_inputs((2, 1), 4, 256, torch.float32, seed=7)
    streams, pre, fn, scale, base, weight, expand = inputs
    plain = hc_site(streams, pre, fn, scale, base, weight, expand=expand, **SITE)
    beside = hc_site(streams, pre, fn, scale, base, weight, expand=expand, overlap=True, **SITE)
    assert all(torch.equal(a, b) for a, b in zip(plain, beside))


@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="a CUDA graph's capture")
def test_site_split_beside_in_a_capture_gives_the_same_bits() -> None:
    """``overlap`` in a CUDA graph's capture: the split runs on a side stream and is pending
    until :func:`mhc_join`; the replay's outputs equal an eager site's bit for bit, and a
    second site in the same capture joins the first one's split before it reads its mixes."""
    from model.kernels import mhc_join, streams as kernel

    streams, pre, fn, scale, base, weight, expand = _site_inputs((1, 1), 4, 2048, torch.bfloat16, seed=8)

    def two_sites(overlap: bool):
        first = hc_site(streams, pre, fn, scale, base, weight, expand=expand, overlap=overlap, **SITE)
        # the second site expands by the first's post / comb and collapses by its pre
        second = hc_site(first[0], first[1], fn, scale, base, weight, expand=(first[4], first[2], first[3]),
                         overlap=overlap, **SITE)
        return first, second

    want = two_sites(False)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        two_sites(True)  # the warm-up a capture needs: not capturing, so plain
    torch.cuda.current_stream().wait_stream(side)
    assert not kernel._PENDING
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = two_sites(True)
        assert len(kernel._PENDING) == 1  # the second site's split; the first's was joined by the second
        mhc_join()
    assert not kernel._PENDING
    graph.replay()
    torch.cuda.synchronize()
    for g, w in zip(got, want):
        assert all(torch.equal(a, b) for a, b in zip(g, w))


@needs_kernel
def test_forget_drops_pending_splits_unjoined() -> None:
    """``mhc_forget`` (a failed capture's clean-up) empties the pending splits without
    waiting on their stream; ``mhc_join`` has nothing left to do."""
    from model.kernels import mhc_forget, mhc_join, streams as kernel

    kernel._PENDING.append((object(), ()))  # a stream no one may wait on
    mhc_forget()
    assert not kernel._PENDING
    mhc_join()
