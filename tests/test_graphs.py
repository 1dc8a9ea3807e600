"""Decode steps whose cache-free segments replay as CUDA graphs (model/graphs.py).

On the CPU a test double stands in for the graphs (it calls each segment directly), so the
split of a layer into graphed segments and eager cache work is checked on every run; on
CUDA the real captures are compared with eager steps bit for bit (skips without a GPU).
"""
from __future__ import annotations

import copy

import pytest
import torch

from model import graphs, kernels
from model.args import ModelArgs
from model.engine import Engine
from model.loading import BUNDLED_TOKENIZER, bind_tokenizer, build

SMALL = dict(sliding_window=16, index_topk=8, candidate_topk_blocks=3, candidate_block_size=2)


class DirectSegments:
    """Test double for SegmentGraphs: runs each segment eagerly and records its key."""

    def __init__(self):
        self.keys: list = []

    def __len__(self) -> int:
        return len(set(self.keys))

    def run(self, key, fn, *inputs, version=None):
        self.keys.append(key)
        return fn(*inputs)


class ReplayedSegments(graphs.SegmentGraphs):
    """Test double for the CUDA part of SegmentGraphs: a "graph" that, on replay, reruns its
    segment on the static inputs and writes the results into the static outputs in place,
    as a real replay does. Everything else (which inputs are copied, which are another
    graph's outputs read in place) is the real class's."""

    def _record(self, fn, static_in):
        static_out = tuple(t.clone() for t in fn(*static_in))

        class Replay:
            @staticmethod
            def replay():
                for dst, src in zip(static_out, fn(*static_in)):
                    dst.copy_(src)

        return Replay, static_out


def _segments_per_step(model, fused: bool | None = None) -> int:
    """Two segments a layer; one where the fused kernels run (``fused``; default: where they
    are enabled) and the layer has neither a compressor nor an indexer (its cache work joins
    the graph)."""
    whole = kernels.enabled(model.embed.weight) if fused is None else fused
    return sum(1 if whole and b.attn.compressor is None and b.attn.indexer is None else 2 for b in model.layers)


def _tiny(device="cpu", dtype=torch.float32):
    model = build(ModelArgs.preset("tiny").replace(**SMALL), seed=1, device=device, dtype=dtype).eval()
    bind_tokenizer(model, BUNDLED_TOKENIZER)
    return model


def _plain_then_segmented(monkeypatch, model, segments, seed: int, steps: int):
    """(state, logits) of ``steps`` plain decode steps after a 70-token prefill of 2 rows, then
    the same from a copy of the prefilled state with ``segments`` standing in for the graphs."""
    engine = Engine(model, mode="ced", chunk=40)
    state = engine.new_state(batch=2)
    engine.prefill(state, torch.randint(3, 1000, (2, 70), generator=torch.Generator().manual_seed(seed)))
    other = copy.deepcopy(state)
    token = state.last_logits.argmax(-1)
    plain = [engine.decode(state, token).clone() for _ in range(steps)]
    monkeypatch.setattr(graphs, "wanted", lambda ids, image_mask, packed: ids.shape[1] == 1 and packed)
    model._graphs = segments
    return (state, plain), (other, [engine.decode(other, token).clone() for _ in range(steps)])


def test_segmented_decode_steps_equal_whole_ones(monkeypatch):
    """The graphed form of a step (projections + mixes + FFN as segments, cache work between
    them) computes exactly what the plain layer does, over several steps of every layer kind."""
    model = _tiny()
    (state, plain), (other, segmented) = _plain_then_segmented(monkeypatch, model, double := DirectSegments(), 0, 5)
    assert len(double) == _segments_per_step(model) and len(double.keys) == 5 * len(double)
    for a, b in zip(plain, segmented):
        assert torch.equal(a, b)
    assert torch.equal(state.cache.global_state()[0]["layers.6.kv"], other.cache.global_state()[0]["layers.6.kv"])


def test_graphs_only_for_one_token_cuda_steps():
    ids = torch.zeros(1, 1, dtype=torch.long)
    assert not graphs.wanted(ids, None, True)  # CPU
    if torch.cuda.is_available():
        with torch.no_grad():
            assert graphs.wanted(ids.cuda(), None, True)
            assert not graphs.wanted(torch.zeros(1, 2, dtype=torch.long, device="cuda"), None, True)
            assert not graphs.wanted(ids.cuda(), None, False)
        assert not graphs.wanted(ids.cuda(), None, True)  # autograd on: training


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 3])
def test_graphed_decode_steps_equal_eager_ones(monkeypatch, batch):
    """Real CUDA graphs give the eager steps' logits bit for bit, at two batch sizes; a
    weight move drops the captures."""
    model = _tiny("cuda", torch.bfloat16)
    ids = torch.randint(3, 1000, (batch, 90), generator=torch.Generator().manual_seed(0)).cuda()
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("DSAGENT_GRAPHS", flag)
        engine = Engine(model, mode="ced", chunk=40)
        state = engine.new_state(batch=batch)
        engine.prefill(state, ids)
        token, logits = state.last_logits.argmax(-1), []
        for _ in range(6):
            logits.append(engine.decode(state, token).float().cpu())
            token = logits[-1].argmax(-1).cuda()
        runs[flag] = torch.stack(logits)
    assert len(model._graphs) == _segments_per_step(model)
    assert torch.equal(runs["0"], runs["1"])
    model.to(torch.float32)
    assert len(model._graphs) == 0


def test_graphs_need_every_moe_on_its_grouped_path(monkeypatch):
    """The per-expert loop reads expert ids on the host, which a capture cannot hold: a step
    is graphed only where every layer's MoE runs grouped."""
    model = _tiny()
    x = torch.zeros(1, 1, model.args.hidden_size)
    with torch.no_grad():
        assert model.ffn_capturable(x)  # fp32 on the CPU: torch._grouped_mm loops over groups
        monkeypatch.setenv("DSAGENT_GROUPED_MOE", "0")
        assert not model.ffn_capturable(x)
    monkeypatch.delenv("DSAGENT_GROUPED_MOE")
    assert not model.ffn_capturable(x)  # autograd on: the loop, for training


def test_a_failed_capture_warns_once_and_runs_eagerly(monkeypatch):
    segments, captures = graphs.SegmentGraphs(), []

    def failing(fn, inputs):
        captures.append(fn)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(segments, "_capture", failing)
    x = torch.arange(4.0)
    with pytest.warns(RuntimeWarning, match="decoding eagerly"):
        out = segments.run("a", lambda t: (t * 2,), x)
    assert torch.equal(out[0], x * 2) and "stream is capturing" in segments.failed
    assert torch.equal(segments.run("b", lambda t: (t + 1,), x)[0], x + 1)
    assert len(captures) == 1 and len(segments) == 0  # no second try


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp32_decode_on_cuda_stays_eager(monkeypatch):
    """fp32 experts take the loop on CUDA (grouped GEMMs want bf16): no capture is tried."""
    monkeypatch.setenv("DSAGENT_GRAPHS", "1")
    model = _tiny("cuda", torch.float32)
    engine = Engine(model, mode="ced", chunk=40)
    state = engine.new_state(batch=1)
    engine.prefill(state, torch.randint(3, 1000, (1, 50), generator=torch.Generator().manual_seed(0)).cuda())
    engine.decode(state, state.last_logits.argmax(-1))
    assert len(model._graphs) == 0 and model._graphs.failed is None


def test_replayed_segments_pass_outputs_on_without_copies(monkeypatch):
    """Segments that read other segments' outputs where those are written (no copy) give
    the plain steps' logits, over steps where the static buffers are rewritten each time."""
    model = _tiny()
    (_, plain), (_, replayed) = _plain_then_segmented(monkeypatch, model, segments := ReplayedSegments(), 2, 4)
    assert len(segments) == _segments_per_step(model) and not segments.failed
    for a, b in zip(plain, replayed):
        assert torch.equal(a, b)
    shared = sum(any(graphs._same_memory(x, o) for o in segments._outputs)
                 for _, _, static_in, _ in segments._graphs.values() for x in static_in)
    assert shared > len(segments)  # streams and pre (and a split layer's attention mixes) mostly


def test_whole_layer_segments_follow_the_cache_they_write(monkeypatch):
    """Layers without a compressor or an indexer replay as one segment that writes their
    window ring and reads the selected records in place; decoding two states in turn
    captures again for each (their buffers differ) and stays equal to plain steps. The
    fused path runs here on its PyTorch twins (no Triton on the CPU)."""
    import model.model as mm

    monkeypatch.setattr(mm, "_fused_step", lambda x, step, kv: (x.shape[1] == 1 and kv.packed and step.floor is None
                                                               and step.index_losses is None and not step.dense))
    model = _tiny()
    engine = Engine(model, mode="ced", chunk=40)
    states = []
    for seed in (3, 4):
        state = engine.new_state(batch=1)
        engine.prefill(state, torch.randint(3, 1000, (1, 60 + 7 * seed), generator=torch.Generator().manual_seed(seed)))
        states.append(state)
    copies = [copy.deepcopy(s) for s in states]

    def steps(pair):
        out = []
        for turn in (0, 1, 0, 1):  # alternate: each switch moves every whole-layer segment's memory
            state = pair[turn]
            out.append(engine.decode(state, state.last_logits.argmax(-1)).clone())
        return out

    plain = steps(states)
    monkeypatch.setattr(graphs, "wanted", lambda ids, image_mask, packed: ids.shape[1] == 1 and packed)
    model._graphs = segments = ReplayedSegments()
    replayed = steps(copies)
    whole = [key for key in segments._graphs if key[0][1] == "layer"]
    assert whole and len(segments) == _segments_per_step(model, fused=True)
    for a, b in zip(plain, replayed):
        assert torch.equal(a, b)
    ring = copies[1].cache.windows[whole[0][0][0]]
    assert segments._graphs[whole[0]][0][:2] == (ring.data.data_ptr(), ring.pos.data_ptr())  # the last state's




def test_a_replaced_capture_leaves_no_outputs_behind():
    segments = ReplayedSegments()
    x = torch.arange(3.0)
    for version in range(5):
        segments.run("k", lambda t: (t + 1,), x, version=version)
    assert len(segments) == 1 and len(segments._outputs) == 1


def test_rope_angles_are_shared_within_a_scope_and_never_into_a_nested_one():
    """A graph segment opens its own scope: angles an eager warm-up computed outside it (in
    memory the graph does not own) must not be reused by its capture — the bug that made
    the first H200 run of session 5 read freed memory on replay."""
    from model.model import rope_angles, shared_rope_angles

    pos, inv = torch.arange(3), torch.rand(4)
    with shared_rope_angles():
        outer = rope_angles(pos, inv)
        assert rope_angles(pos, inv) is outer and rope_angles(pos.clone(), inv) is not outer
        with shared_rope_angles():
            inner = rope_angles(pos, inv)
            assert inner is not outer and rope_angles(pos, inv) is inner
            assert torch.equal(inner.cos, outer.cos) and torch.equal(inner.neg_sin, -outer.sin)
        assert rope_angles(pos, inv) is outer  # the outer scope's memo is back
    assert rope_angles(pos, inv) is not outer  # no scope: nothing kept
