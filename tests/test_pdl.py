"""Programmatic dependent launch of the decode kernels (``model.kernels.fused.chained``).

A kernel launched so may be scheduled while the one before it still runs and waits at its
start until that one is done, so it must compute exactly what it computes without. The
decode steps of a model are compared bit for bit with PDL on and off, eager and as CUDA
graphs, on a Hopper GPU (skips elsewhere: the CPU and Triton's interpreter never launch so).
"""
from __future__ import annotations

import pytest
import torch

from model.args import ModelArgs
from model.engine import Engine
from model.loading import BUNDLED_TOKENIZER, bind_tokenizer, build

triton = pytest.importorskip("triton")
fused = pytest.importorskip("model.kernels.fused")

SMALL = dict(sliding_window=16, index_topk=8, candidate_topk_blocks=3, candidate_block_size=2)


def _hopper() -> bool:
    return torch.cuda.is_available() and fused._pdl_supported(torch.cuda.current_device())


def test_chained_is_empty_off_cuda_and_when_switched_off(monkeypatch):
    assert fused.chained(torch.zeros(2)) == {}
    if not _hopper():
        pytest.skip("no GPU of compute capability 9 with a Triton that launches dependently")
    x = torch.zeros(2, device="cuda")
    monkeypatch.delenv("DSAGENT_PDL", raising=False)
    assert fused.chained(x) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv("DSAGENT_PDL", "0")
    assert fused.chained(x) == {}


def _decode_steps(model, pdl: str, graphed: bool, monkeypatch, steps: int = 6):
    """Logits of ``steps`` decode steps of 2 rows after a 70-token CED prefill, and the cache
    bytes after them, with ``DSAGENT_PDL`` = ``pdl`` and the graphs on or off; the opt-in GEMV
    on either way, so that its kernel is launched both ways too."""
    monkeypatch.setenv("DSAGENT_PDL", pdl)
    monkeypatch.setenv("DSAGENT_GEMV", "1")
    monkeypatch.setenv("DSAGENT_GRAPHS", "1" if graphed else "0")  # a switched PDL recaptures (graphs.py)
    engine = Engine(model, mode="ced", chunk=40)
    state = engine.new_state(batch=2)
    ids = torch.randint(3, 1000, (2, 70), generator=torch.Generator().manual_seed(4)).to(model.device)
    engine.prefill(state, ids)
    token = state.last_logits.argmax(-1)
    logits = []
    for _ in range(steps):
        logits.append(engine.decode(state, token).clone())
        token = logits[-1].argmax(-1)  # [B, vocab]: each step feeds its own choice back
    return logits, state.cache.state()[0]


@pytest.mark.skipif(not _hopper(), reason="needs a GPU of compute capability 9 and Triton's dependent launch")
@pytest.mark.parametrize("graphed", [False, True])
def test_decode_steps_with_pdl_equal_those_without(monkeypatch, graphed):
    model = build(ModelArgs.preset("tiny").replace(**SMALL), seed=1, device="cuda", dtype=torch.bfloat16).eval()
    bind_tokenizer(model, BUNDLED_TOKENIZER)
    with torch.no_grad():
        on, cache_on = _decode_steps(model, "1", graphed, monkeypatch)
        off, cache_off = _decode_steps(model, "0", graphed, monkeypatch)
    for a, b in zip(on, off):
        assert torch.equal(a, b)
    for name, t in cache_on.items():
        assert torch.equal(t, cache_off[name]), name
