"""Decode steps whose cache-free segments replay as CUDA graphs (model/graphs.py).

On the CPU a test double stands in for the graphs (it calls each segment directly), so the
split of a layer into graphed segments and eager cache work is checked on every run; on
CUDA the real captures are compared with eager steps bit for bit (skips without a GPU).
"""
from __future__ import annotations

import copy

import pytest
import torch

from model import decode_step, graphs, kernels
from model.args import ModelArgs
from model.engine import Engine
from model.linear import ALONE, World
from model.loading import BUNDLED_TOKENIZER, bind_tokenizer, build

SMALL = dict(sliding_window=16, index_topk=8, candidate_topk_blocks=3, candidate_block_size=2)


class DirectSegments:
    """Test double for SegmentGraphs: runs each segment eagerly and records its key."""

    def __init__(self):
        self.keys: list = []

    def __len__(self) -> int:
        return len(set(self.keys))

    def for_step(self):
        return self

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
    """Captures over a few steps: two segments a layer; where the fused kernels run
    (``fused``; default: where they are enabled) the whole step is one, its cache work in the
    graph, captured twice where a compressor pools pairs (a step that completes one and a
    step that does not)."""
    if not (kernels.enabled(model.embed.weight) if fused is None else fused):
        return 2 * len(model.layers)
    return 2 if any(b.attn.compressor is not None and b.attn.ratio == 2 for b in model.layers) else 1


def _fused_anywhere(monkeypatch):
    """Decode steps take the fused path here too, on the kernels' PyTorch twins (no Triton
    on the CPU)."""
    monkeypatch.setattr(decode_step, "takes_fused", decode_step.is_decode_step)


def _tiny(device="cpu", dtype=torch.float32, weights: str = "plain", world: World = ALONE):
    """The tiny preset, seeded, with a short window and top-k (every layer kind within 90 tokens);
    ``world``: its part of it on those ranks."""
    model = build(ModelArgs.preset("tiny").replace(**SMALL), seed=1, device=device, dtype=dtype, weights=weights,
                  world=world).eval()
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
    model.derived["graphs"] = segments
    return (state, plain), (other, [engine.decode(other, token).clone() for _ in range(steps)])


def _segments_only(monkeypatch):
    """Decode steps off the fused path (the two-segments-a-layer form), also where the
    kernels are enabled or ``--fused-twins`` puts the fused path everywhere."""
    monkeypatch.setattr(decode_step, "takes_fused", lambda x, step, kv: False)


def test_segmented_decode_steps_equal_whole_ones(monkeypatch):
    """The graphed form of a step off the fused path (projections + mixes + FFN as segments,
    cache work between them) computes exactly what the plain layer does, over several steps
    of every layer kind."""
    _segments_only(monkeypatch)
    model = _tiny()
    (state, plain), (other, segmented) = _plain_then_segmented(monkeypatch, model, double := DirectSegments(), 0, 5)
    assert len(double) == _segments_per_step(model, fused=False) and len(double.keys) == 5 * 2 * len(model.layers)
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


def _greedy_logits(model, ids, steps: int = 6) -> torch.Tensor:
    """[steps, B, vocab]: the logits of ``steps`` greedy decode steps after a CED prefill of
    ``ids`` [B, n] (on their device)."""
    engine = Engine(model, mode="ced", chunk=40)
    state = engine.new_state(batch=ids.shape[0])
    engine.prefill(state, ids)
    token, logits = state.last_logits.argmax(-1), []
    for _ in range(steps):
        logits.append(engine.decode(state, token).float().cpu())
        token = logits[-1].argmax(-1).to(ids.device)
    return torch.stack(logits)


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
        runs[flag] = _greedy_logits(model, ids)
    assert len(decode_step.graphs_of(model)) == _segments_per_step(model)
    assert torch.equal(runs["0"], runs["1"])
    model.to(torch.float32)
    assert len(decode_step.graphs_of(model)) == 0


def _same_logits_either_way(monkeypatch, module, name: str, seed: int, check) -> None:
    """A tiny bf16 model's greedy decode logits (CUDA) with the knob ``module.name`` off and on
    are equal bit for bit; ``check(value)`` after each run (what the run launched)."""
    model = _tiny("cuda", torch.bfloat16)
    ids = torch.randint(3, 1000, (1, 90), generator=torch.Generator().manual_seed(seed)).cuda()
    runs = {}
    for value in (False, True):
        monkeypatch.setattr(module, name, value)
        model.derived.clear()
        runs[value] = _greedy_logits(model, ids)
        check(value, model)
    assert torch.equal(runs[True], runs[False])


@pytest.mark.skipif(not torch.cuda.is_available() or not kernels.triton_available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("knob", ["engram.BESIDE", "select.POOL_BESIDE", "pack.COMPRESS_BESIDE"])
def test_work_beside_the_layers_gives_the_same_steps(monkeypatch, knob):
    """Work launched on a side stream of the step's graph and joined where it is first read —
    each Engram layer's projection, which reads only the step's inputs, from the step's start
    (``engram.BESIDE``); the candidate pool from its source layer's scores (``select.POOL_BESIDE``);
    a ratio-2 source's compressor beside the query's projections (``pack.COMPRESS_BESIDE``) —
    gives the logits of the same work inline, bit for bit."""
    from model.bench import kernel_knob

    for other in ("engram.BESIDE", "select.POOL_BESIDE", "pack.COMPRESS_BESIDE"):  # only the one tested beside
        monkeypatch.setattr(*kernel_knob(other)[:2], False)
    module, name, _ = kernel_knob(knob)
    made = []

    class Counted(kernels.Beside):
        def __init__(self, *args, **kw):
            made.append(True)
            super().__init__(*args, **kw)

    def check(value, model):
        assert bool(made) == value  # launched beside in each capture
        made.clear()

    monkeypatch.setattr(kernels, "Beside", Counted)
    _same_logits_either_way(monkeypatch, module, name, 2, check)


@pytest.mark.skipif(not torch.cuda.is_available() or not kernels.triton_available(), reason="needs CUDA and Triton")
def test_the_attentions_merge_turning_its_output_back_gives_the_same_steps(monkeypatch):
    """``fused.MERGE_TURNS_BACK``: each layer's attention de-rotates its output in its merge
    launch and ``wo_a``'s GEMV reads it as it is — the logits of the GEMV de-rotating, bit for
    bit (the same products and roundings in another launch)."""
    from model.kernels import fused

    turned = []
    real = fused.sparse_attention

    def counted(*args, **kw):
        turned.append(kw.get("turn_back", args[10] if len(args) > 10 else None) is not None)
        return real(*args, **kw)

    def check(value, model):
        assert turned and all(t == value for t in turned[-model.args.num_hidden_layers:])
        turned.clear()

    monkeypatch.setattr(fused, "sparse_attention", counted)
    _same_logits_either_way(monkeypatch, fused, "MERGE_TURNS_BACK", 4, check)


def test_graphs_need_every_moe_on_its_grouped_path(monkeypatch):
    """The per-expert loop reads expert ids on the host, which a capture cannot hold: a step
    is graphed only where every layer's MoE runs grouped (the fused MoE kernel off, as on a
    CPU without Triton's interpreter, which would run it and be capturable)."""
    monkeypatch.setenv("DSAGENT_FUSED_MOE", "0")
    model = _tiny()
    x = torch.zeros(1, 1, model.args.hidden_size)
    with torch.no_grad():
        assert decode_step.ffn_capturable(model, x)  # fp32 on the CPU: torch._grouped_mm loops over groups
        monkeypatch.setenv("DSAGENT_GROUPED_MOE", "0")
        assert not decode_step.ffn_capturable(model, x)
    monkeypatch.delenv("DSAGENT_GROUPED_MOE")
    assert not decode_step.ffn_capturable(model, x)  # autograd on: the loop, for training


def test_a_failed_capture_warns_once_and_runs_eagerly(monkeypatch):
    """A failed capture warns once and the segments run eagerly from then on; the mHC splits it
    put on a side stream are dropped unjoined (they never ran)."""
    segments, captures, forgotten = graphs.SegmentGraphs(), [], []

    def failing(fn, inputs):
        captures.append(fn)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(segments, "_capture", failing)
    monkeypatch.setattr(graphs.kernels, "mhc_forget", lambda: forgotten.append(True))
    x = torch.arange(4.0)
    with pytest.warns(RuntimeWarning, match="decoding eagerly"):
        out = segments.run("a", lambda t: (t * 2,), x)
    assert torch.equal(out[0], x * 2) and "stream is capturing" in segments.failed and forgotten == [True]
    assert torch.equal(segments.run("b", lambda t: (t + 1,), x)[0], x + 1)
    assert len(captures) == 1 and len(segments) == 0  # no second try


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fused_moe", ["0", "1"])
def test_fp32_decode_on_cuda_is_graphed_only_with_the_fused_moe(monkeypatch, fused_moe):
    """fp32 experts take the loop on CUDA without the fused MoE (grouped GEMMs want bf16):
    no capture is tried then; the fused MoE kernels take fp32, and the step is graphed."""
    monkeypatch.setenv("DSAGENT_GRAPHS", "1")
    monkeypatch.setenv("DSAGENT_FUSED_MOE", fused_moe)
    model = _tiny("cuda", torch.float32)
    engine = Engine(model, mode="ced", chunk=40)
    state = engine.new_state(batch=1)
    engine.prefill(state, torch.randint(3, 1000, (1, 50), generator=torch.Generator().manual_seed(0)).cuda())
    engine.decode(state, state.last_logits.argmax(-1))
    assert decode_step.graphs_of(model).failed is None
    assert len(decode_step.graphs_of(model)) == (1 if fused_moe == "1" and kernels.enabled(model.embed.weight) else 0)


def test_replayed_segments_pass_outputs_on_without_copies(monkeypatch):
    """Segments that read other segments' outputs where those are written (no copy) give
    the plain steps' logits, over steps where the static buffers are rewritten each time
    (two segments a layer: the fused path's one graph a step has no segment to hand on to)."""
    _segments_only(monkeypatch)
    model = _tiny()
    (_, plain), (_, replayed) = _plain_then_segmented(monkeypatch, model, segments := ReplayedSegments(), 2, 4)
    assert len(segments) == _segments_per_step(model, fused=False) and not segments.failed
    for a, b in zip(plain, replayed):
        assert torch.equal(a, b)
    shared = sum(any(graphs._same_memory(x, o) for o in segments._outputs)
                 for _, _, static_in, _ in segments._graphs.values() for x in static_in)
    assert shared > len(segments)  # streams and pre (and a split layer's attention mixes) mostly


def test_whole_step_segments_follow_the_cache_they_write(monkeypatch):
    """With the fused kernels the whole step replays as one segment that writes every
    layer's window ring, KV source and selection and reads the records in place; decoding
    two states in turn captures again for each (their buffers differ) and stays equal to
    plain steps. The fused path runs here on its PyTorch twins (no Triton on the CPU)."""
    _fused_anywhere(monkeypatch)
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
    model.derived["graphs"] = segments = ReplayedSegments()
    replayed = steps(copies)
    assert [key[0][:3] for key in segments._graphs] == [("step", 0, len(model.layers))] * 2
    assert len(segments) == _segments_per_step(model, fused=True)
    for a, b in zip(plain, replayed):
        assert torch.equal(a, b)
    compressors = tuple(b.attn.compressor is not None for b in model.layers)
    last = segments._graphs[(("step", 0, len(model.layers), compressors, (), ()), 1)]  # position 89 completes pairs
    for memory, ring in zip(last[0][0], copies[1].cache.windows):  # it holds the memory of the state decoded last
        assert memory[:2] == ((ring.data.data_ptr(), tuple(ring.data.shape)),
                              (ring.pos.data_ptr(), tuple(ring.pos.shape)))




def test_a_switch_that_changes_the_kernels_replaces_the_capture(monkeypatch):
    """A capture holds the kernels (and launch settings) of the switches it was made under:
    flipped between steps, the next step captures anew rather than replaying the old one."""
    recorded = []

    class Counted(ReplayedSegments):
        def _record(self, fn, static_in):
            recorded.append(fn)
            return super()._record(fn, static_in)

    monkeypatch.delenv("DSAGENT_PDL", raising=False)
    segments, x = Counted(), torch.ones(2, 3)
    for _ in range(2):
        segments.for_step().run("site", lambda t: (t * 2,), x)
    monkeypatch.setenv("DSAGENT_PDL", "0")
    segments.run("site", lambda t: (t * 2,), x)
    assert len(recorded) == 1  # read once a step: not before the next one
    out = segments.for_step().run("site", lambda t: (t * 2,), x)
    assert len(recorded) == 2 and torch.equal(out[0], x * 2)


def test_a_replaced_capture_leaves_no_outputs_behind():
    segments = ReplayedSegments()
    x = torch.arange(3.0)
    for version in range(5):
        segments.run("k", lambda t: (t + 1,), x, version=version)
    assert len(segments) == 1 and len(segments._outputs) == 1


def test_rope_angles_are_shared_within_a_scope_and_never_into_a_nested_one():
    """A graph segment opens its own scope: angles an eager warm-up computed outside it (in
    memory the graph does not own) must not be reused by its capture — the bug that made
    the first H200 run of 2026-11-30 (bf14f19) read freed memory on replay."""
    from model.rope import rope_angles, shared_rope_angles

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


def test_angles_shared_between_tables_are_each_tables_own():
    """``share_rope_angles``: both tables' angles made side by side, found by ``rope_angles``
    within the scope, bit for bit what each table's own ``RopeAngles`` makes (a decode step's
    one position: each slice contiguous, as the kernels read it); outside a scope, nothing."""
    from model.args import ModelArgs
    from model.rope import RopeAngles, Ropes, rope_angles, share_rope_angles, shared_rope_angles

    ropes = Ropes(ModelArgs.preset("tiny"))
    for start in (0, 1, 4095, 131071):
        pos = torch.tensor([start])
        with shared_rope_angles():
            share_rope_angles(pos, ropes)
            for table in (ropes.main, ropes.compress):
                got, want = rope_angles(pos, table), RopeAngles(pos, table)
                for a, b in ((got.cos, want.cos), (got.sin, want.sin), (got.neg_sin, want.neg_sin)):
                    assert torch.equal(a, b) and a.is_contiguous()
    share_rope_angles(pos, ropes)  # no scope: a no-op
    assert rope_angles(pos, ropes.main) is not rope_angles(pos, ropes.main)


def _prefilled_twice(model, n: int, seed: int):
    """(engine, state, a copy of it) after a CED prefill of ``n`` random tokens, one row."""
    engine = Engine(model, mode="ced", chunk=40)
    state = engine.new_state(batch=1)
    engine.prefill(state, torch.randint(3, 1000, (1, n), generator=torch.Generator().manual_seed(seed)))
    return engine, state, copy.deepcopy(state)


def _decode(engine, state, steps: int) -> list[torch.Tensor]:
    out = []
    for _ in range(steps):
        out.append(engine.decode(state, state.last_logits.argmax(-1)).clone())
    return out


def test_fused_steps_keep_the_cache_the_reference_path_keeps(monkeypatch):
    """A decode step on the fused path (twins here) does its cache work on the fixed buffers
    with the position as a tensor: over steps that complete a ratio-2 group and steps that
    do not, its logits, counts and pending group follow the reference path's (the fused
    attention sums in another order, so to rounding), and a rollback works on what it
    leaves."""
    model = _tiny()
    engine = Engine(model, mode="ced", chunk=40)
    reference = engine.new_state(batch=2)
    engine.prefill(reference, torch.randint(3, 1000, (2, 40), generator=torch.Generator().manual_seed(5)))
    fused = copy.deepcopy(reference)
    plain = _decode(engine, reference, 5)
    _fused_anywhere(monkeypatch)
    stepped = _decode(engine, fused, 5)
    for a, b in zip(plain, stepped):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    mine, theirs = fused.cache, reference.cache
    for s, src in mine.sources.items():
        other = theirs.sources[s]
        assert (src.n, src.done) == (other.n, other.done)
        torch.testing.assert_close(src.pending_kv, other.pending_kv, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(src.pending_gate, other.pending_gate, rtol=1e-4, atol=1e-4)
    assert mine.sources[2].pending_n == 1  # 45 tokens at ratio 2
    for cache in (mine, theirs):
        cache.truncate(cache.length - 2)  # a rollback rebuilds the pending group from the history
    assert mine.sources[2].pending_n == 1
    torch.testing.assert_close(mine.sources[2].pending_kv, theirs.sources[2].pending_kv, rtol=1e-4, atol=1e-4)
    for a, b in zip(_decode(engine, reference, 2), _decode(engine, fused, 2)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    more = torch.randint(3, 1000, (2, 30), generator=torch.Generator().manual_seed(6))  # the next turn's prompt:
    for state in (reference, fused):  # longer than the history ring, so the pending group is taken out first
        engine.prefill(state, more)
    torch.testing.assert_close(fused.last_logits, reference.last_logits, rtol=1e-4, atol=1e-4)
    assert [s.done for s in fused.cache.sources.values()] == [s.done for s in reference.cache.sources.values()]


def test_graphed_fused_steps_equal_eager_fused_ones(monkeypatch):
    """Every layer as one replayed segment (compressor, indexer, candidate pool inside)
    gives the eager fused steps' logits and cache bytes bit for bit, across a records buffer
    that grows (a new capture) and a rollback."""
    _fused_anywhere(monkeypatch)
    model = _tiny()
    engine, eager, graphed = _prefilled_twice(model, 29, seed=6)
    room = eager.cache.sources[6].records.shape[1]
    assert room == 29  # full: the first step grows the ratio-1 source's buffers
    plain = _decode(engine, eager, 6)
    eager.cache.truncate(eager.cache.length - 2)
    plain += _decode(engine, eager, 3)
    monkeypatch.setattr(graphs, "wanted", lambda ids, image_mask, packed: ids.shape[1] == 1 and packed)
    model.derived["graphs"] = segments = ReplayedSegments()
    replayed = _decode(engine, graphed, 6)
    graphed.cache.truncate(graphed.cache.length - 2)
    replayed += _decode(engine, graphed, 3)
    assert graphed.cache.sources[6].records.shape[1] > room and not segments.failed
    assert len(segments) == _segments_per_step(model, fused=True)
    for a, b in zip(plain, replayed):
        assert torch.equal(a, b)
    for (name, t), (_, u) in zip(eager.cache.state()[0].items(), graphed.cache.state()[0].items()):
        assert torch.equal(t, u), name


@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_compressor_step_makes_what_its_forward_makes(ratio, dtype):
    """decode_step.compressor_step (position a tensor, the group pooled from the history ring) gives the
    latents Compressor.forward gives one token at a time, bit for bit, at every phase of a
    group; the source's counts and pending group after it are the same."""
    from model.cache import SourceKV
    from model.csa2 import Compressor
    from model.layer import Step

    args = ModelArgs.preset("tiny")
    torch.manual_seed(ratio)
    comp = Compressor(args, ratio).to(dtype)
    x = torch.randn(2, 13, args.hidden_size).to(dtype)
    plain, fixed = (SourceKV(2, ratio, args.head_dim, args.index_head_dim, "cpu") for _ in range(2))

    def forward(src, start, length):  # and the records Attention.update_source appends
        latent, first = comp(x[:, start:start + length], Step(start=start, length=length), src)
        if latent is not None:
            g = latent.shape[1]
            src.append(torch.zeros(2, g, src.records.shape[2], dtype=torch.uint8),
                       torch.zeros(2, g, src.index.shape[2], dtype=torch.uint8))
        return latent, first

    with torch.no_grad():
        forward(plain, 0, 5), forward(fixed, 0, 5)
        for t in range(5, 13):
            want, first = forward(plain, t, 1)
            fixed.reserve(t)
            got = decode_step.compressor_step(comp, x[:, t:t + 1], torch.tensor([t]), fixed, emits=(t + 1) % ratio == 0)
            fixed.stepped(t)
            assert (got is None) == (want is None), t
            if want is not None:
                assert got[0].dtype == want.dtype == dtype
                assert torch.equal(got[0], want) and got[1].tolist() == [first], t
            assert (fixed.n, fixed.done) == (plain.n, plain.done)
            assert torch.equal(fixed.pending_kv, plain.pending_kv)
            assert torch.equal(fixed.pending_gate, plain.pending_gate)


def test_a_replayed_position_takes_the_reference_path(monkeypatch):
    """A one-token CED prefill runs the decoder layers on a position whose records the
    decoder's source already holds (made from the encoder's output): not a decode step, so
    the decoder takes the reference path there (the fused one asserted on it). The encoder
    layers did step a new position, fused: the logits follow the reference path's to rounding."""
    _fused_anywhere(monkeypatch)
    model = _tiny()
    engine = Engine(model, mode="ced", chunk=40)
    states = [engine.new_state(batch=1) for _ in range(2)]
    ids = torch.randint(3, 1000, (1, 31), generator=torch.Generator().manual_seed(8))
    for state in states:
        engine.prefill(state, ids[:, :30])
    engine.prefill(states[0], ids[:, 30:])  # one token, CED: the fused path must not take it
    monkeypatch.undo()
    engine.prefill(states[1], ids[:, 30:])
    torch.testing.assert_close(states[0].last_logits, states[1].last_logits, rtol=1e-4, atol=1e-4)
    assert [s.done for s in states[0].cache.sources.values()] == [31] * len(states[1].cache.sources)


def test_fused_steps_after_a_resume_from_the_global_kv(monkeypatch):
    """Export the global KV (an odd length: a ratio-2 group pending), import it, replay the
    log's tail, decode: the fused path (twins here) continues the rebuilt cache as the
    reference path does."""
    model = _tiny()
    engine = Engine(model, mode="ced", chunk=40)
    ids = torch.randint(3, 1000, (1, 57), generator=torch.Generator().manual_seed(9))
    source = engine.new_state(batch=1)
    engine.prefill(source, ids)
    resumed = []
    for fused in (False, True):
        if fused:
            _fused_anywhere(monkeypatch)
        state = engine.import_global(*engine.export_global(source))
        engine.replay(state, ids)
        assert state.cache.sources[2].pending_n == 1
        resumed.append(_decode(engine, state, 3))
    for a, b in zip(*resumed):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_the_fused_twins_option_puts_the_fused_path_everywhere(pytestconfig):
    """``--fused-twins`` (tests/conftest.py): with it every decode step's choice is the fused
    path's condition alone; without it the kernels must be enabled too."""
    assert (decode_step.takes_fused is decode_step.is_decode_step) == pytestconfig.getoption("--fused-twins")


def test_a_graphed_step_hands_out_the_taps_an_eager_step_makes(monkeypatch):
    """DSpark's taps (the target layers' inputs) asked of a one-token step come out of the
    whole-step graph, equal to the eager fused step's, and as copies: the next replay does
    not rewrite the taps a drafter already holds."""
    _fused_anywhere(monkeypatch)
    model = _tiny()
    engine, eager, graphed = _prefilled_twice(model, 50, seed=11)

    def tapped_steps(state):
        out = []
        for _ in range(8):  # past a grown buffer's new captures: replays that rewrite the same outputs
            ids = state.last_logits.argmax(-1)[:, None]
            with torch.no_grad():
                streams, pre, step = decode_step.begin(model, ids, state.cache, state.cache.length)
                step.shared["taps"] = taps = {}
                streams, pre = decode_step.run_layers(model, streams, pre, step, state.cache, range(len(model.layers)))
                state.last_logits = model.logits(streams, pre)[:, -1]
            state.cache.length = step.end
            out.append((step.graphs is not None, taps))
        return out

    plain = tapped_steps(eager)
    monkeypatch.setattr(graphs, "wanted", lambda ids, image_mask, packed: ids.shape[1] == 1 and packed)
    model.derived["graphs"] = segments = ReplayedSegments()
    replayed = tapped_steps(graphed)
    assert len(segments) == 2 and not segments.failed  # two captures: pairs completing or not
    for (was_graphed, a), (is_graphed, b) in zip(plain, replayed):
        assert not was_graphed and is_graphed
        assert sorted(a) == sorted(b) == sorted(model.args.dspark_target_layer_ids)
        assert all(torch.equal(a[k], b[k]) for k in a)
