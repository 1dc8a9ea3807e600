"""``scripts/persistent_probe.py``'s persistent chain computes the chain of GEMVs it times.

Runs on CUDA (four programs waiting on each other, all resident) when present, else under
``TRITON_INTERPRET=1`` with one program (the interpreter runs programs one after another, so
a program that waited on a later one would spin out), else skips. Each of the three ways of
waiting must leave every stage counted, no spin timed out and the outputs of a torch chain
rounded to bf16 at each stage, to a bf16 step.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import model.kernels as kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"


@pytest.mark.skipif(not kernels.triton_available(),
                    reason="needs Triton with CUDA, or TRITON_INTERPRET=1 for its CPU interpreter")
@pytest.mark.parametrize("poll", [0, 1, 2])
def test_persistent_chain_matches_a_torch_chain(poll):
    import persistent_probe

    stages, rows = 3, 64
    tile_rows = 16 if ON_CUDA else rows
    g = torch.Generator().manual_seed(poll)
    ws = (torch.randn(stages, rows, rows, generator=g) * rows ** -0.5).to(DEVICE, torch.bfloat16)
    x = torch.randn(rows, generator=g).to(DEVICE, torch.bfloat16)
    y = torch.zeros(stages, rows, dtype=torch.bfloat16, device=DEVICE)
    cnt = torch.zeros(stages * rows, dtype=torch.int32, device=DEVICE)
    err = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    persistent_probe.persistent_chain(ws, x, y, cnt, err, tile_rows, 4, poll)
    h = x.float()
    for s in range(stages):
        h = (ws[s].float() @ h).bfloat16().float()
        torch.testing.assert_close(y[s].float(), h, rtol=2 ** -7, atol=2 ** -7 * h.abs().max().item())
    programs = rows // tile_rows
    done = cnt[:stages * programs].view(stages, programs) if poll == 2 else cnt[:stages]
    assert done.tolist() == ([[1] * programs] * stages if poll == 2 else [programs] * stages)
    assert err.item() == 0
