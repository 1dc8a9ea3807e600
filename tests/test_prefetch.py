"""The L2 prefetch beside a decode step (model/kernels/prefetch.py): its byte ranges on every
run; its build for sm_90 where Triton is installed; on a GPU of compute capability 9 or
later, graphed decode steps with it equal those without, bit for bit (it is a hint)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from model import kernels
from model.args import ModelArgs
from model.engine import Engine
from model.loading import BUNDLED_TOKENIZER, bind_tokenizer, build

HAS_TRITON = importlib.util.find_spec("triton") is not None
ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.skipif(not HAS_TRITON, reason="the module needs Triton")
def test_ranges_cover_each_tensor_once_in_aligned_pieces():
    """Every byte of each tensor (views at odd offsets included) lies in exactly one range; a
    range starts 16-aligned, is a multiple of 16 long and at most a chunk; no range reaches
    more than 15 bytes beyond its tensor."""
    from model.kernels.prefetch import ranges

    base = torch.zeros(10_000, dtype=torch.uint8)
    tensors = [base[3:4099], base[5000:5001], base[6000:9999], torch.zeros(3, 5, dtype=torch.bfloat16)]
    for chunk in (16, 256, 1024):
        got = ranges(tensors, chunk)
        assert all(a % 16 == 0 and 0 < n <= chunk and n % 16 == 0 for a, n in got)
        for t in tensors:
            lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
            mine = sorted((a, n) for a, n in got if a < hi and a + n > lo)
            assert mine[0][0] <= lo and lo - mine[0][0] < 16 and hi <= mine[-1][0] + mine[-1][1] < hi + 16
            assert all(a + n == b for (a, n), (b, _) in zip(mine, mine[1:]))  # no gap, no overlap


@pytest.mark.skipif(torch.cuda.is_available() or not HAS_TRITON,
                    reason="needs Triton installed; on a GPU the kernel itself runs below")
def test_prefetch_kernel_compiles_for_hopper(tmp_path):
    """The kernel's inline PTX (``cp.async.bulk.prefetch.L2``, with and without the
    evict-last policy) builds for sm_90."""
    from model.kernels import prefetch
    from tests.hopper import compile_for_hopper

    signature = {"table_ptr": "*i64", "sink_ptr": "*i32", "n": "i32", "ASK": "constexpr", "LANES": "constexpr"}
    r = compile_for_hopper([{"module": "model.kernels.prefetch", "name": "_prefetch_kernel", "signature": signature,
                             "constants": {"ASK": ask, "LANES": prefetch.LANES}, "options": {"num_warps": 1}}
                            for ask in prefetch._ASK.values()], tmp_path)
    assert r.returncode == 0 and "2 distinct launches compiled for sm_90, 0 failed" in r.stdout, r.stdout + r.stderr


@pytest.mark.skipif(not ON_HOPPER or not kernels.triton_available(), reason="needs a GPU of compute capability 9+")
@pytest.mark.parametrize("priority", ["last", "normal"])
def test_graphed_steps_with_the_prefetch_equal_those_without(monkeypatch, priority):
    """A `tiny` model's graphed fused decode steps, with the weights asked into the L2 beside
    them, give the logits of steps without, bit for bit; the prefetches ran (their tables
    were made) and were joined."""
    from model.kernels import prefetch

    model = build(ModelArgs.preset("tiny"), seed=3, device="cuda", dtype=torch.bfloat16).eval()
    bind_tokenizer(model, BUNDLED_TOKENIZER)
    ids = torch.randint(3, 1000, (1, 90), generator=torch.Generator().manual_seed(2)).cuda()
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(prefetch, "ENABLED", on)
        monkeypatch.setattr(prefetch, "PRIORITY", priority)
        model.reset_graphs()
        engine = Engine(model, mode="ced", chunk=40)
        state = engine.new_state(batch=1)
        engine.prefill(state, ids)
        token, logits = state.last_logits.argmax(-1), []
        for _ in range(5):
            logits.append(engine.decode(state, token).float().cpu())
            token = logits[-1].argmax(-1).cuda()
        runs[on] = torch.stack(logits)
    assert prefetch._TABLES and not prefetch._PENDING
    assert torch.equal(runs[False], runs[True])
