"""Riders of the attention launch asking the L2 for weights (model/kernels/prefetch.py): the
byte ranges on every run; nothing rides off a Hopper GPU; on a GPU of compute capability 9
or later, graphed decode steps with riders equal those without, bit for bit (a hint). The
riders' hosts build for sm_90 (their inline PTX, which the interpreter cannot run)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from model import kernels
from model.args import ModelArgs
from model.loading import build

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


@pytest.mark.skipif(not HAS_TRITON, reason="the knob lives in the Triton module")
def test_nothing_rides_off_a_hopper_gpu(monkeypatch):
    """On the CPU (and under the interpreter) a layer's asks are None whatever ``RIDE`` says:
    no launch carries riders."""
    from model.kernels import prefetch

    model = build(ModelArgs.preset("tiny"), seed=1)
    first, second = model.layers[0], model.layers[1]
    for ride in ("", "output", "both", "split"):
        monkeypatch.setattr(prefetch, "RIDE", ride)
        assert first.read_after_attention(second) == second.read_after_attention(None) == (None, None)


@pytest.mark.skipif(torch.cuda.is_available() or not HAS_TRITON,
                    reason="needs Triton installed; on a GPU the riders run in the test below")
@pytest.mark.parametrize("priority", ["last", "normal"])
def test_the_launches_with_riders_compile_for_hopper(priority, tmp_path):
    """The attention's merge kernel and the MoE gate kernel with riders (inline PTX
    ``cp.async.bulk.prefetch.L2``, which the interpreter cannot run) build for sm_90 as
    dependent launches, at either priority."""
    from model.kernels import prefetch
    from tests.hopper import compile_for_hopper

    riding = {"ride_ptr": "*i64", "ride_sink": "*i32", "ride_n": "i32",
              **dict.fromkeys(("RIDERS", "ASK", "RIDE_LANES", "RIDE_CHUNKS"), "constexpr")}
    ride = {"RIDERS": 3, "ASK": prefetch._ASK[priority], "RIDE_LANES": 128, "RIDE_CHUNKS": 8}
    merge = {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "sink_ptr": "*bf16", "out_ptr": "*i16",
             "H": "i32", "SPLITS": "i32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "OFF": "i32",
             **dict.fromkeys(("D", "BLOCK_D", "SPLITS_P2", "BF16", "TURN", "PDL"), "constexpr"), **riding}
    merged = {"D": 512, "BLOCK_D": 128, "SPLITS_P2": 64, "BF16": True, "TURN": True, "PDL": True, **ride}

    signature = {"part_ptr": "*fp32", "bias_ptr": "*fp32", "wout_ptr": "*fp32", "iout_ptr": "*i64", "E": "i32",
                 "SPLITS": "i32", "temp": "fp32", "scale": "fp32",
                 **dict.fromkeys(("K", "K_P2", "BLOCK_E", "SPLITS_P2", "SCORE", "NORM", "PDL"), "constexpr"),
                 "N": "i32", **riding}
    constants = {"K": 6, "K_P2": 8, "BLOCK_E": 64, "SPLITS_P2": 16, "SCORE": 0, "NORM": True, "PDL": True, **ride}
    options = {"launch_pdl": True, "num_warps": 4}
    r = compile_for_hopper([{"module": "model.kernels.fused", "name": "_merge_splits_kernel", "signature": merge,
                             "constants": merged, "options": {**options, "enable_fp_fusion": False}},
                            {"module": "model.kernels.moe", "name": "_gate_kernel", "signature": signature,
                             "constants": constants, "options": options}], tmp_path)
    assert r.returncode == 0 and "2 distinct launches compiled for sm_90, 0 failed" in r.stdout, r.stdout + r.stderr


@pytest.mark.skipif(not ON_HOPPER or not kernels.triton_available(), reason="needs a GPU of compute capability 9+")
@pytest.mark.parametrize("ride,priority", [("output", "last"), ("both", "last"), ("both", "normal"), ("split", "last")])
def test_graphed_steps_with_riders_equal_those_without(monkeypatch, ride, priority):
    """A `tiny` model's graphed fused decode steps whose launches carry riders (the layer's
    output weights on the attention's, the next layer's input weights there too or on the
    MoE gate's, asked into the L2 at either priority) give the logits of steps without, bit
    for bit; the riders' tables were made exactly when they ride."""
    from model.kernels import prefetch
    from tests.test_graphs import _same_logits_either_way

    monkeypatch.setattr(prefetch, "PRIORITY", priority)
    monkeypatch.setattr(prefetch, "_TABLES", {})

    def check(value, model):
        assert bool(prefetch._TABLES) == bool(value)
        prefetch._TABLES.clear()

    _same_logits_either_way(monkeypatch, prefetch, "RIDE", 5, check, values=("", ride))
