"""An mHC site's input left for its reader to make (``model.kernels.Collapsed``,
``streams.DOTS_BESIDE``): where a decode step's site runs its launches beside the layer, the
projections' GEMV and the MoE's gate launch each collapse the site's streams at the channels
they read, so the site puts no launch on the step's path.

Against the site's own collapse (``streams.hc_site`` with ``norm_later``, its dots launch
writing x): the reader's outputs bit for bit — the same products, sums and roundings — with
and without the site before's expand, in fp32 and bf16. Kernel tests run on CUDA or under
``TRITON_INTERPRET=1``, else skip; the seen-as-a-tensor tests and the readers that fall back
to ``value()`` run everywhere; the decode steps with the knob on and off on CUDA only.
"""
from __future__ import annotations

import pytest
import torch

import model.kernels as kernels
from tests.interpreted import interpretable
from tests.test_moe_kernel import decode_call, random_moe
from tests.test_streams_kernel import DEVICE, _bits, _site_inputs

kernel_only = pytest.mark.skipif(not kernels.triton_available(),
                                 reason="needs Triton with CUDA, or TRITON_INTERPRET=1 for its CPU interpreter")
SITE = (1e-6, 1e-6, 20, 1e-6)  # eps, norm_eps, iters, hc_eps


@pytest.fixture(autouse=True)
def _interpretable(monkeypatch):
    interpretable(monkeypatch)


def _site_and_collapsed(rows: int, hc: int, D: int, dtype: torch.dtype, expanded: bool, seed: int):
    """(the site's input as its dots launch writes it, the same input as a Collapsed, the norm's
    weight): the site's own collapse where kernels run, else its parts'."""
    streams, pre, fn, scale, base, weight, (y, post, comb) = _site_inputs((rows,), hc, D, dtype, seed=seed)
    expand = (y, post, comb) if expanded else None
    if kernels.triton_available():
        from model.kernels import streams as kernel

        new, *_, x = kernel.hc_site(streams, pre, fn, scale, base, weight, *SITE, expand, norm_later=True)
    else:
        new = kernels.hc_expand(y, streams, post, comb) if expanded else streams
        x = kernels.hc_collapse(new, pre)
    parts = (y, post, comb) if expanded else (None, None, None)
    return x, kernels.Collapsed(streams, pre, *parts, new, kernels.hc_collapse), weight


@kernel_only
@pytest.mark.parametrize("rows,hc,D,dtype", [(1, 4, 256, torch.bfloat16), (3, 4, 128, torch.float32),
                                             (2, 2, 192, torch.bfloat16)])
@pytest.mark.parametrize("expanded", [True, False])
def test_the_gemv_makes_the_sites_input_it_reads(rows, hc, D, dtype, expanded) -> None:
    """The projections' GEMV (two weights, the site's norm, the normalised x kept) on the
    Collapsed gives the outputs and kept x of the GEMV on the site's own collapse, bit for bit."""
    x, collapsed, weight = _site_and_collapsed(rows, hc, D, dtype, expanded, seed=D + rows)
    g = torch.Generator().manual_seed(rows)
    w1, w2 = ((torch.randn(o, D, generator=g) * D ** -0.5).to(DEVICE, dtype) for o in (64, 32))
    want = kernels.gemv(x, w1, w2, norm=(weight, 1e-6), keep=True)
    got = kernels.gemv(collapsed, w1, w2, norm=(weight, 1e-6), keep=True)
    assert len(got) == len(want) == 3
    for g_, w_ in zip(got, want):
        assert g_.shape == w_.shape and torch.equal(_bits(g_), _bits(w_))
    assert torch.equal(_bits(collapsed.value()), _bits(x))  # the fallback's bits too


@kernel_only
@pytest.mark.parametrize("rows,dtype", [(1, torch.bfloat16), (2, torch.float32)])
@pytest.mark.parametrize("expanded", [True, False])
def test_the_moe_gate_makes_the_sites_input_it_reads(rows, dtype, expanded) -> None:
    """``moe_decode`` on the Collapsed (the gate launch makes and normalises the rows, program 0
    writing them for the experts) gives the MoE of the site's own collapse, bit for bit."""
    moe = random_moe("sqrtsoftplus", dtype, seed=rows)
    D = moe.gate.weight.shape[1]
    x, collapsed, weight = _site_and_collapsed(rows, 4, D, dtype, expanded, seed=rows + 5)
    want = decode_call(moe, x, out_dtype=dtype, x_norm=(weight, 1e-6))
    got = decode_call(moe, collapsed, out_dtype=dtype, x_norm=(weight, 1e-6))
    assert torch.equal(_bits(got), _bits(want))


def test_a_collapsed_input_is_seen_as_the_tensor_it_stands_for() -> None:
    """Shape, dtype, device and element count of x; :meth:`reshape` regroups the leading dims
    (the last stays D); :func:`kernels.resolve` and ``value()`` make it."""
    x, collapsed, _ = _site_and_collapsed(3, 4, 64, torch.float32, True, seed=1)
    assert collapsed.shape == x.shape == (3, 64) and collapsed.dtype == x.dtype and collapsed.device == x.device
    assert collapsed.numel() == x.numel() and collapsed.is_cuda == x.is_cuda
    seen = collapsed.reshape(1, 3, -1)
    assert seen.shape == (1, 3, 64) and collapsed.shape == (3, 64)
    with pytest.raises(AssertionError):
        collapsed.reshape(6, 32)
    made = kernels.resolve(seen)
    assert made.shape == (1, 3, 64) and torch.equal(_bits(made.view(3, 64)), _bits(x))


def test_readers_that_cannot_make_it_take_its_value(monkeypatch) -> None:
    """Where the fused kernels do not run (``DSAGENT_KERNELS=0``), the MoE and the attention's
    projections take the Collapsed's value: their outputs are those of the tensor."""
    from model.args import ModelArgs
    from model import decode_step as ds
    from model.block import Attention
    from model.rope import Ropes
    from model.quant import KVFormat

    monkeypatch.setenv("DSAGENT_KERNELS", "0")
    moe = random_moe("sqrtsoftplus", torch.float32, seed=4)
    D = moe.gate.weight.shape[1]
    x, collapsed, weight = _site_and_collapsed(2, 4, D, torch.float32, True, seed=6)
    with torch.no_grad():
        assert torch.equal(ds.moe_step(moe, collapsed.reshape(2, 1, D), norm=(weight, 1e-6)),
                           ds.moe_step(moe, x.view(2, 1, D), norm=(weight, 1e-6)))
        args = ModelArgs.preset("tiny")
        attn, ropes, pos = Attention(args, layer=0).to(DEVICE).eval(), Ropes(args).to(DEVICE), torch.tensor([5]).to(DEVICE)
        x, collapsed, weight = _site_and_collapsed(1, 4, args.hidden_size, torch.float32, True, seed=7)
        want = ds._project(attn, x.view(1, 1, -1), pos, ropes, norm=(weight, 1e-6))
        got = ds._project(attn, collapsed.reshape(1, 1, -1), pos, ropes, norm=(weight, 1e-6))
    assert len(got) == len(want) == 4
    for g, w in zip(got, want):
        assert (g is None and w is None) or torch.equal(g, w)


def _graphed_steps_either_way(monkeypatch, check) -> None:
    """``test_graphs._same_logits_either_way`` on ``streams.DOTS_BESIDE``, ``check(value, model,
    made)`` after each run with ``made`` the ``Collapsed`` inputs its capture left to readers."""
    from model.kernels import streams
    from tests.test_graphs import _same_logits_either_way

    made = []

    class Counted(kernels.Collapsed):
        def __init__(self, *args, **kw):
            made.append(True)
            super().__init__(*args, **kw)

    def counted(value, model):
        check(value, model, len(made))
        made.clear()

    monkeypatch.setattr(kernels, "Collapsed", Counted)
    _same_logits_either_way(monkeypatch, streams, "DOTS_BESIDE", 3, counted)


@pytest.mark.skipif(not torch.cuda.is_available() or not kernels.triton_available(), reason="needs CUDA and Triton")
def test_decode_steps_with_the_dots_beside_keep_their_logits(monkeypatch) -> None:
    """A model's graphed decode steps with ``streams.DOTS_BESIDE`` on (each site's launches on
    the side stream, its input made by its readers) give the logits of the steps with it off,
    bit for bit; on, every layer's two sites left their input to a reader."""
    def check(value, model, made):
        assert (made >= 2 * model.args.num_hidden_layers) == value, made

    _graphed_steps_either_way(monkeypatch, check)


@pytest.mark.skipif(not torch.cuda.is_available() or not kernels.triton_available(), reason="needs CUDA and Triton")
def test_streams_wider_than_the_limit_keep_their_dots_on_the_path(monkeypatch) -> None:
    """Past ``streams.DOTS_BESIDE_MAX_D`` channels (where each reader's collapse of the whole
    row spills) no site leaves its input to a reader, and the steps' logits are the same."""
    from model.kernels import streams

    def check(value, model, made):
        assert made == 0, made

    monkeypatch.setattr(streams, "DOTS_BESIDE_MAX_D", 16)  # narrower than the tiny model's streams
    _graphed_steps_either_way(monkeypatch, check)
