"""A chunk of more than two bands of queries attends in bands (``Attention._banded_window``): each query
scored against its band's W + b entries instead of the whole ring plus chunk. Against the dense
form (``_window_keys``) on the same ring: equal within float summation order, wherever the
chunk starts, however long it is, after a rollback (replayed positions come from the chunk),
with training's per-row floors, and through a whole prefill."""
from __future__ import annotations

import pytest
import torch

from dsagent.evaluate import make_cases, prompt_inputs
from dsagent.runtime import Runtime, Settings
from model.args import ModelArgs
from model import block
from model.block import Attention
from model.cache import Cache
from model.engine import Engine
from model.layer import Step

W = 16


@pytest.fixture(autouse=True)
def reference_path(monkeypatch):
    monkeypatch.setenv("DSAGENT_KERNELS", "0")


def args() -> ModelArgs:
    return ModelArgs.preset("tiny").replace(sliding_window=W, index_topk=8, candidate_topk_blocks=3,
                                           candidate_block_size=2)


def attention_of(a: ModelArgs, step: Step, ring_before: list[tuple[int, int]], S: int, *, banded: bool,
                 floor=None, seed: int = 0) -> torch.Tensor:
    """Layer 0's window attention (no records) of S new entries at ``step``, the ring first
    written with the spans ``ring_before`` [(start, length)], entries and queries seeded."""
    g = torch.Generator().manual_seed(seed)
    attn = Attention(a, 0)
    cache = Cache(a, batch=2)
    for start, n in ring_before:
        cache.windows[0].write(torch.randn(2, n, a.head_dim, generator=g), torch.arange(start, start + n))
    q = torch.randn(2, S, attn.n_heads, a.head_dim, generator=g)
    kv = torch.randn(2, S, a.head_dim, generator=g)
    step.floor = floor
    keys, mask = (attn._banded_window if banded else attn._window_keys)(kv, step, cache)
    if banded:
        assert keys.shape[2] == W + block.WINDOW_BAND == mask.shape[-1]
    out = attn.attend(q, keys, mask, None)
    return out, cache.windows[0].read()


@pytest.mark.parametrize("start,S,ring", [
    (0, 3 * W, []),  # a fresh prefill, whole bands
    (0, 3 * W + 5, []),  # a part band at the end
    (40, 2 * W + 1, [(0, 40)]),  # after a chunk: the ring full
    (10, 4 * W - 3, [(0, 10)]),  # the ring part filled
    (30, 2 * W, [(0, 37)]),  # after a rollback to 30: positions 30-36 in the ring are replayed
])
@pytest.mark.parametrize("band", [5, W, 3 * W])
def test_bands_equal_the_dense_window(start, S, ring, band, monkeypatch):
    monkeypatch.setattr(block, "WINDOW_BAND", band)
    a = args()
    dense, ring_d = attention_of(a, Step(start, S), ring, S, banded=False)
    banded, ring_b = attention_of(a, Step(start, S), ring, S, banded=True)
    torch.testing.assert_close(banded, dense, rtol=1e-5, atol=1e-5)
    assert torch.equal(ring_d[0], ring_b[0]) and torch.equal(ring_d[1], ring_b[1])  # the same ring written


def test_bands_keep_training_floors():
    a = args()
    floor = torch.full((2, a.num_hidden_layers), -1, dtype=torch.long)
    floor[0, 0], floor[1, 0] = 21, 50  # row 0 sees nothing below 21, row 1 nothing below 50
    dense, _ = attention_of(a, Step(0, 4 * W + 2), [], 4 * W + 2, banded=False, floor=floor)
    banded, _ = attention_of(a, Step(0, 4 * W + 2), [], 4 * W + 2, banded=True, floor=floor)
    torch.testing.assert_close(banded, dense, rtol=1e-5, atol=1e-5)
    free, _ = attention_of(a, Step(0, 4 * W + 2), [], 4 * W + 2, banded=True)
    assert not torch.allclose(free[1, 50:60], banded[1, 50:60])  # the floor did change what row 1 saw


def test_a_whole_prefill_in_bands_matches_the_dense_one(monkeypatch):
    """The embedded default on a held-out recall case (a log of some thousand tokens), exact
    prefill in the CPU's chunks of 512 (each banded): its greedy reply as with every chunk in
    the dense form. (On random tokens the two forms' logits differ by up to ~0.1: attention
    outputs 1e-6 apart move FP4 / FP8 roundings of the records, as any change of sum order.)"""
    runtime = Runtime.load(Settings())
    case = make_cases(runtime.tokenizer, n=1, skills=["d"])[0]
    ids, _ = prompt_inputs(runtime, case)
    assert ids.shape[1] > 2 * 512
    model = runtime.model

    def run():
        engine = Engine(model, mode="exact", chunk=512)
        state = engine.new_state()
        reply = [int(engine.prefill(state, ids).argmax(-1))]
        for _ in range(case.expected_tokens - 1):
            reply.append(int(engine.decode(state, torch.tensor([[reply[-1]]])).argmax(-1)))
        return reply

    calls = []
    real = Attention._banded_window
    monkeypatch.setattr(Attention, "_banded_window", lambda self, *a: calls.append(1) or real(self, *a))
    banded = run()
    assert len(calls) >= 2 * model.args.num_hidden_layers  # the chunks went through the bands
    monkeypatch.setattr(Attention, "_banded_window", Attention._window_keys)
    assert run() == banded
