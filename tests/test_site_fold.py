"""An mHC site's first launch folded into the launch that makes its ``expand``'s y
(``model.kernels.Pending``, ``streams.Fold``): the attention's ``wo_b`` GEMV and the MoE's down
sum each do the site's expand, collapse and partial dots at their programs' output channels.

Against the site run after y is made (``streams.hc_site`` with y a tensor): the expanded
streams and the collapse bit for bit (the same per-channel products and sums), the mixes to
fp32 rounding (their dots summed over other channel blocks). And in a model's decode steps:
the fold taken where a site follows a Pending, the logits those of the steps without it.
Kernel tests run on CUDA, or under ``TRITON_INTERPRET=1``, else skip. The fold is off by
default (``streams.SITE_FOLD``, ``moe.DOWN_FOLD``: timed, no faster); these tests turn it on.
"""
from __future__ import annotations

import pytest
import torch

import model.kernels as kernels
from tests.interpreted import interpretable
from tests.test_moe_kernel import decode_call, random_moe
from tests.test_streams_kernel import DEVICE, _bits, _site_inputs

pytestmark = pytest.mark.skipif(not kernels.triton_available(),
                                reason="needs Triton with CUDA, or TRITON_INTERPRET=1 for its CPU interpreter")
SITE = (1e-6, 1e-6, 20, 1e-6)  # eps, norm_eps, iters, hc_eps


@pytest.fixture(autouse=True)
def _folding(monkeypatch):
    """The fold on (both producers), whatever the defaults (off since timed on 2026-12-04,
    55ed118: docs/gpu-fast-path.md)."""
    from model.kernels import moe, streams

    interpretable(monkeypatch)
    monkeypatch.setattr(streams, "SITE_FOLD", True)
    monkeypatch.setattr(moe, "DOWN_FOLD", True)


def _unmade():
    raise AssertionError("y was made: the site did not fold its launch into y's")


def _same_site(got, want) -> None:
    """(streams, pre, post, comb, x) of a folded site against the site after y."""
    assert all(g.shape == w.shape and g.dtype == w.dtype for g, w in zip(got, want))
    assert torch.equal(_bits(got[0]), _bits(want[0])), "expanded streams"
    assert torch.equal(_bits(got[4]), _bits(want[4])), "the site's input"
    for g, w in zip(got[1:4], want[1:4]):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("rows,D,width,dtype", [(1, 256, 64, torch.float32), (3, 128, 96, torch.bfloat16),
                                                (1, 2048, 512, torch.bfloat16)])
@pytest.mark.parametrize("norm_later", [True, False])
def test_a_site_folded_into_the_gemv_is_the_site_after_it(rows, D, width, dtype, norm_later) -> None:
    """The GEMV's programs (2 to 4 rows each here, one per 128 or 512 blocks) do the site's
    dots launch: its expand and collapse bit for bit, its mixes to fp32 rounding; with or
    without the collapse (``norm_later``: without, the second launch makes x)."""
    from model.kernels import matvec, streams as kernel

    streams, pre, fn, scale, base, weight, (_, post, comb) = _site_inputs((rows,), 4, D, dtype, seed=D + rows)
    g = torch.Generator().manual_seed(width)
    x = torch.randn(rows, width, generator=g).to(DEVICE, dtype)
    w = (torch.randn(D, width, generator=g) * width ** -0.5).to(DEVICE, dtype)
    (y,) = kernels.gemv(x, w)
    want = kernel.hc_site(streams, pre, fn, scale, base, weight, *SITE, (y, post, comb), norm_later=norm_later)
    pending = kernels.Pending("GEMV kernel", x, _unmade, lambda fold: matvec.gemv(x, w, site=fold))
    got = kernel.hc_site(streams, pre, fn, scale, base, weight, *SITE, (pending, post, comb), norm_later=norm_later)
    _same_site(got, want)


@pytest.mark.parametrize("rows,dtype", [(1, torch.float32), (2, torch.bfloat16)])
def test_a_site_folded_into_the_moe_down_sum_is_the_site_after_it(rows, dtype) -> None:
    """``moe_decode``'s ``later``: the gate and up launches made, the down sum a Pending; the
    site folded into it is the site after the MoE's output."""
    from model.kernels import streams as kernel

    moe = random_moe("sqrtsoftplus", dtype, seed=rows)
    D = moe.gate.weight.shape[1]
    x = torch.randn(rows, D, generator=torch.Generator().manual_seed(9)).to(DEVICE, dtype)
    y = decode_call(moe, x, out_dtype=dtype)
    streams, pre, fn, scale, base, weight, (_, post, comb) = _site_inputs((rows,), 4, D, dtype, seed=rows)
    want = kernel.hc_site(streams, pre, fn, scale, base, weight, *SITE, (y, post, comb), norm_later=True)
    pending = decode_call(moe, x, out_dtype=dtype, later=_unmade)
    assert isinstance(pending, kernels.Pending)
    got = kernel.hc_site(streams, pre, fn, scale, base, weight, *SITE, (pending, post, comb), norm_later=True)
    _same_site(got, want)
    again = decode_call(moe, x, out_dtype=dtype, later=_unmade)
    assert torch.equal(_bits(again.value()), _bits(y))  # made plainly where no site takes it


def test_a_pending_output_is_made_once_where_the_fold_is_off(monkeypatch) -> None:
    """``SITE_FOLD`` off (or a fold that cannot be built): y made by its plain launch, once,
    and the site's own two launches after it — the same bits as the site after a tensor."""
    from model.kernels import streams as kernel

    streams, pre, fn, scale, base, weight, (y, post, comb) = _site_inputs((1,), 4, 64, torch.float32, seed=2)
    want = kernel.hc_site(streams, pre, fn, scale, base, weight, *SITE, (y, post, comb))
    made = []
    pending = kernels.Pending("GEMV kernel", y, lambda: made.append(1) or y, lambda fold: _unmade())
    monkeypatch.setattr(kernel, "SITE_FOLD", False)
    got = kernel.hc_site(streams, pre, fn, scale, base, weight, *SITE, (pending, post, comb))
    assert made == [1] and all(torch.equal(a, b) for a, b in zip(got, want))
    assert pending.value() is y and made == [1]


def test_a_fold_that_fails_to_build_falls_back_to_the_sites_own_launch(monkeypatch) -> None:
    """A folded launch that raises (a build error) warns once; y is made plainly and the
    site runs as before, and later pendings are not folded again in the process."""
    from model.kernels import streams as kernel

    streams, pre, fn, scale, base, weight, (y, post, comb) = _site_inputs((1,), 4, 64, torch.float32, seed=3)
    want = kernel.hc_site(streams, pre, fn, scale, base, weight, *SITE, (y, post, comb))

    def broken(fold):
        raise RuntimeError("no such kernel")

    with pytest.warns(RuntimeWarning, match="mHC site fold"):
        got = kernel.hc_site(streams, pre, fn, scale, base, weight, *SITE,
                             (kernels.Pending("GEMV kernel", y, lambda: y, broken), post, comb))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    tried = []
    later = kernels.Pending("GEMV kernel", y, lambda: y, lambda fold: tried.append(1))
    kernel.hc_site(streams, pre, fn, scale, base, weight, *SITE, (later, post, comb))
    assert tried == []


def test_decode_steps_fold_each_site_after_a_pending_and_keep_their_logits(monkeypatch) -> None:
    """The tiny net's fused decode steps: every FFN site folds into ``wo_b``'s GEMV and every
    attention site after a MoE into its down sum (not the first layer's, nor one after an
    Engram layer's expand); the logits those of the same steps with the fold off (the mixes'
    dots summed over other blocks: fp32 rounding, through ten layers)."""
    from model import decode_step as ds
    from model.kernels import streams as kernel
    from tests.test_kernels import tiny_net

    monkeypatch.setenv("DSAGENT_GRAPHS", "0")
    monkeypatch.setattr(ds, "takes_fused", ds.is_decode_step)
    net = tiny_net().to(DEVICE)
    ids = torch.randint(3, net.args.vocab_size, (1, 133), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    folds = []
    real = kernel.Fold.launch
    monkeypatch.setattr(kernel.Fold, "launch", lambda self, *a: folds.append(self) or real(self, *a))
    logits = {}
    with torch.no_grad():
        for fold in (False, True):
            monkeypatch.setattr(kernel, "SITE_FOLD", fold)
            cache = net.new_cache(1)
            net(ids[:, :131], cache)
            folds.clear()
            logits[fold] = torch.stack([ds.forward(net, ids[:, t: t + 1], cache)[:, -1] for t in (131, 132)])
    n, engram = net.args.num_hidden_layers, len(net.args.engram_layer_ids)
    # a step: n FFN sites, and the attention sites of layers 1.. whose streams need no expand first
    assert len(folds) == 2 * (n + n - 1 - engram)
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-4, atol=1e-4)
