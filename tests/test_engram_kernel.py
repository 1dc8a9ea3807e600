"""The Engram gate kernel (``model.kernels.engram``) against its twin ``engram_gate_ref``,
which is ``model.model.Engram``'s own code: to fp32 rounding (the channel sums in another
order), and exactly where a token is not live. Kernel tests run on CUDA, or under
``TRITON_INTERPRET=1``, else skip; the twin tests always run.
"""
from __future__ import annotations

import pytest
import torch

from model.kernels import engram_gate, engram_gate_ref, triton_available

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(not triton_available(),
                                  reason="needs Triton with CUDA, or TRITON_INTERPRET=1 for its CPU interpreter")


def _inputs(lead, hc, D, dtype, live=False, seed=0):
    """Streams, and key / value as the two parts of one projection (strided rows), as the model has them."""
    g = torch.Generator().manual_seed(seed)
    streams = (torch.randn(*lead, hc, D, generator=g) * 2).to(dtype)
    kv = (torch.randn(*lead, (hc + 1) * D, generator=g)).to(dtype)
    key, value = kv.split([hc * D, D], dim=-1)
    qw, kw = (1 + 0.2 * torch.randn(2, hc, D, generator=g)).to(dtype)
    mask = torch.rand(*lead, generator=g) > 0.4 if live else None
    return [None if t is None else t.to(DEVICE) for t in (streams, key, value, qw, kw, mask)]


def test_twin_gates_into_the_streams() -> None:
    """Each stream moves by a gate in (0, 1) times the value; not at all where not live."""
    streams, key, value, qw, kw, live = _inputs((2, 5), 4, 64, torch.float32, live=True)
    out = engram_gate_ref(streams, key, value, qw, kw, live, 1e-6)
    gate = (out - streams) / value.unsqueeze(-2)
    assert torch.equal(out[~live], streams[~live])
    assert gate[live].min() > 0 and gate[live].max() < 1
    torch.testing.assert_close(gate[live], gate[live][..., :1].expand_as(gate[live]), atol=1e-4, rtol=1e-4)


@needs_kernel
@pytest.mark.parametrize("lead,hc,D", [((1, 1), 4, 2048), ((3, 2), 4, 100), ((2, 1), 2, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("live", [False, True])
def test_kernel_matches_the_twin(lead, hc, D, dtype, live) -> None:
    from model.kernels import engram as kernel

    streams, key, value, qw, kw, mask = _inputs(lead, hc, D, dtype, live, seed=D + live)
    got, want = kernel.engram_gate(streams, key, value, qw, kw, mask, 1e-6), engram_gate_ref(
        streams, key, value, qw, kw, mask, 1e-6)
    assert got.shape == want.shape and got.dtype == want.dtype
    if mask is not None:
        assert torch.equal(got[~mask], streams[~mask])
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # a few fp32 ulps in the gate can round a bf16 the other way: one bf16 ulp, rarely
        torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2 ** -7)
        assert (got != want).float().mean() < 0.01


@needs_kernel
def test_dispatcher_takes_the_kernel_outside_autograd_only(monkeypatch) -> None:
    from model.kernels import engram as kernel

    calls = []
    real = kernel.engram_gate
    monkeypatch.setattr(kernel, "engram_gate", lambda *a: calls.append(1) or real(*a))
    streams, key, value, qw, kw, _ = _inputs((1, 3), 4, 64, torch.float32)
    engram_gate(streams, key, value, qw, kw, None, 1e-6)
    assert calls == [1]
    out = engram_gate(streams, key, value, qw.clone().requires_grad_(), kw, None, 1e-6)
    assert calls == [1] and out.requires_grad
