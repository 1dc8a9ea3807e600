"""The model over a world of two gloo processes on the CPU (attention heads, vocabulary,
routed experts and Engram table rows split, ``model.linear.World``) against one process: the same logits to float rounding on a
float KV cache (with the FP8 / FP4 cache a sum in another order can flip a rounding, and
the logits then move by more), the same 32 greedy tokens on the packed cache; with plain
weights and with packed ones (each rank holding its slices of the stored FP8 bytes and scales)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from model.args import ModelArgs
from model.distributed import run_ranks
from model.linear import World
from model.quant import KVFormat



DEFAULT = Path(__file__).resolve().parents[1] / "model" / "assets" / "default"  # trained: margins, not near-ties
ARGS = ModelArgs.from_file(DEFAULT)


def _whole(weights: str = "plain"):
    from model.loading import load

    return load(DEFAULT, weights=weights)


# A gap between the two best logits below which a sum in another order may swap them on the
# FP8 / FP4 cache (logits of spread ~2; the default of 2026-12-06 has a gap of 0.014 at step 23
# of the random prompt below, and two ranks picked the other token there)
NEAR_TIE = 0.05


def _greedy(model, ids: torch.Tensor, n: int, gaps: list | None = None) -> list[int]:
    """``n`` greedy tokens after a CED prefill of ``ids``; ``gaps``: each step's gap between its
    two best logits appended."""
    from model.engine import Engine

    engine = Engine(model, mode="ced", chunk=64)
    state = engine.new_state()
    tokens = []
    with torch.no_grad():
        engine.prefill(state, ids)
        for _ in range(n):
            token = state.last_logits.argmax(-1)
            tokens.append(int(token[0]))
            if gaps is not None:
                top = state.last_logits[0].float().topk(2).values
                gaps.append(float(top[0] - top[1]))
            engine.decode(state, token)
    return tokens


def _same_until_a_near_tie(got: list[int], want: list[int], gaps: list[float]) -> None:
    """``got`` is ``want`` token for token, or up to a step where ``want``'s two best logits were
    within NEAR_TIE (after which the two decode different contexts)."""
    differ = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), None)
    if differ is not None:
        assert gaps[differ] < NEAR_TIE, f"step {differ}: {got[differ]} for {want[differ]}, a gap of {gaps[differ]:.4f}"
    assert len(got) == len(want)


def _rank(world: World, ids: torch.Tensor, weights: str, results, fused: bool = False) -> None:
    """One rank: its part of the default checkpoint, read from the shards (``load(..., world=)``);
    ``fused``: its decode steps on the fused step's path (the kernels' twins here)."""
    from model.loading import load

    torch.set_num_threads(1)
    if fused:
        _fused_decode()
    model = load(DEFAULT, weights=weights, world=world)
    assert model.layers[0].attn.n_heads == ARGS.num_attention_heads // world.size
    assert model.layers[0].attn.wo_b.fmt == ("fp8" if weights == "packed" else "plain")
    assert len(model.layers[0].ffn.experts) == ARGS.n_routed_experts // world.size
    shared = model.layers[0].ffn.shared_experts  # its share of the intermediate channels, summed with the routed
    assert shared.w1.out_features == shared.w2.in_features == ARGS.moe_intermediate_size // world.size
    table = next(b.engram.embed for b in model.layers if b.engram is not None)  # its share of the rows
    assert table.weight.shape[0] == -(-table.full_rows // world.size) < table.full_rows
    with torch.no_grad():
        full = model(ids, model.new_cache(1, kv=KVFormat.FLOAT))
    results[world.rank] = (full, _greedy(model, ids, 32))


@pytest.mark.parametrize("weights", ["plain", "packed"])
def test_two_ranks_give_one_process_logits_and_tokens(tmp_path, weights):
    ids = torch.randint(3, ARGS.vocab_size, (1, 150), generator=torch.Generator().manual_seed(5))
    model = _whole(weights)
    with torch.no_grad():
        want_full = model(ids, model.new_cache(1, kv=KVFormat.FLOAT))
    want_tokens = _greedy(model, ids, 32)
    with mp.Manager() as manager:
        results = manager.dict()
        run_ranks(_rank, 2, ids, weights, results, init_method=f"file://{tmp_path / 'rendezvous'}", timeout_s=300)
        got = dict(results)
    for rank in (0, 1):
        full, tokens = got[rank]
        torch.testing.assert_close(full, want_full, rtol=1e-4, atol=1e-4)
        assert tokens == want_tokens


def _fused_decode() -> None:
    """Decode steps through ``decode_step``'s fused path where no kernel runs (its twins), as
    the kernel tests do: ``takes_fused`` becomes ``is_decode_step``."""
    from model import decode_step

    decode_step.takes_fused = decode_step.is_decode_step


def _fused_rank(world: World, ids: torch.Tensor, results) -> None:
    from model import decode_step

    calls, real = [], decode_step._fused_layers
    decode_step._fused_layers = lambda *a, **k: calls.append(1) or real(*a, **k)
    _rank(world, ids, "plain", results, fused=True)
    results[f"fused{world.rank}"] = len(calls)  # decode steps that took the fused path


def test_two_ranks_decode_on_the_fused_path(tmp_path, monkeypatch):
    """The fused decode step over two ranks (each its heads, experts and table rows, the
    partial sums added where the reference adds them) gives one process's greedy tokens, up to
    a step where one process's two best logits are within rounding of a sum in another order."""
    from model import decode_step

    ids = torch.randint(3, ARGS.vocab_size, (1, 150), generator=torch.Generator().manual_seed(5))
    monkeypatch.setattr(decode_step, "takes_fused", decode_step.is_decode_step)
    calls = []
    real = decode_step._fused_layers
    monkeypatch.setattr(decode_step, "_fused_layers", lambda *a, **k: calls.append(1) or real(*a, **k))
    gaps = []
    want_tokens = _greedy(_whole(), ids, 32, gaps)
    assert calls  # the one process decoded on the fused path too
    with mp.Manager() as manager:
        results = manager.dict()
        run_ranks(_fused_rank, 2, ids, results, init_method=f"file://{tmp_path / 'rendezvous'}", timeout_s=300)
        got = dict(results)
    assert got["fused0"] == got["fused1"] == len(calls) > 0
    for rank in (0, 1):
        _same_until_a_near_tie(got[rank][1], want_tokens, gaps)
    assert got[0][1] == got[1][1]  # the ranks' own sums are one sum


def test_a_ranks_part_of_a_whole_state_dict():
    """``local_state``: the slices a rank of two holds, by name, from a whole model's tensors."""
    from model.loading import local_state
    from model.model import Transformer

    whole = _whole().state_dict()
    with torch.device("meta"):
        rank1 = Transformer(ARGS, World(rank=1, size=2))
    part = local_state(rank1, whole)
    H, V, E = ARGS.num_attention_heads, ARGS.vocab_size, ARGS.n_routed_experts
    assert torch.equal(part["embed.weight"], whole["embed.weight"][V // 2:])
    assert torch.equal(part["layers.0.attn.attn_sink"], whole["layers.0.attn.attn_sink"][H // 2:])
    assert torch.equal(part["layers.0.attn.wo_b.weight"], whole["layers.0.attn.wo_b.weight"][:, ARGS.o_groups * ARGS.o_lora_rank // 2:])
    assert f"layers.0.ffn.experts.{E - 1}.w1.weight" in part and "layers.0.ffn.experts.0.w1.weight" not in part
    assert part.keys() == rank1.state_dict().keys()


def test_a_split_that_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="vocab_size: 1024 do not split evenly over 3 ranks"):
        with torch.device("meta"):
            from model.model import Transformer

            Transformer(ModelArgs.preset("tiny"), World(rank=0, size=3))


def _table_rank(world: World, ids: torch.Tensor, results) -> None:
    """One rank's rows of a packed 10-row table (3 ranks: 4, 4 and 2 of them) looked up."""
    from model.linear import Table

    torch.manual_seed(0)
    whole = Table(10, 64)
    whole.weight.data.normal_()
    whole.pack("fp8")
    part = Table(10, 64, world=world)
    part.pack("fp8")  # the stored shapes of its rows, then its rows of the whole table's bytes
    part.load_state_dict({k: v[part.rows] for k, v in whole.state_dict().items()}, assign=True)
    results[world.rank] = (part.rows, part(ids), whole(ids))


def test_a_table_splits_by_rows_unevenly_and_gives_the_same_bits(tmp_path):
    """An Engram table over three ranks: its rows in ceil-sized ranges (the tables' prime-sum
    row counts rarely divide), the rows each lookup gives the same bits as the whole table's."""
    ids = torch.tensor([[0, 3, 4, 7, 8, 9, 9, 1]])
    with mp.Manager() as manager:
        results = manager.dict()
        run_ranks(_table_rank, 3, ids, results, init_method=f"file://{tmp_path / 'rendezvous'}", timeout_s=120)
        got = dict(results)
    assert [got[r][0] for r in range(3)] == [slice(0, 4), slice(4, 8), slice(8, 10)]
    for rank in range(3):
        assert torch.equal(got[rank][1], got[rank][2])
    with pytest.raises(ValueError, match="leaves rank 3 of 4 none"):
        from model.linear import Table

        Table(5, 32, world=World(3, 4))


def _counted_all_reduces() -> list[bool]:
    """Wraps ``torch.distributed.all_reduce`` in this process: each call appends whether a
    CUDA graph was being captured on the current stream."""
    import torch.distributed as dist

    calls, real = [], dist.all_reduce
    dist.all_reduce = lambda t, *a, **k: (
        calls.append(t.is_cuda and torch.cuda.is_current_stream_capturing()) or real(t, *a, **k))
    return calls


def _group_of_one(world: World, device: str, results) -> None:
    """One process in a group of its own: its decode logits (the steps' CUDA graphs on, then
    off, where ``device`` is CUDA) and those of the same model alone (no group), how many
    all-reduces ran and how many of them a graph captured."""
    import os

    from model import decode_step
    from tests.test_graphs import _greedy_logits, _tiny

    torch.set_num_threads(1)
    calls = _counted_all_reduces()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    ids = torch.randint(3, 1000, (1, 90), generator=torch.Generator().manual_seed(0)).to(device)
    for weights in ("plain", "packed"):
        model = _tiny(device, dtype, weights, world)
        for flag in ("1", "0"):
            os.environ["DSAGENT_GRAPHS"] = flag
            results[weights, flag] = _greedy_logits(model, ids)
        results[weights, "graphs"] = len(decode_step.graphs_of(model))
        del model
        os.environ["DSAGENT_GRAPHS"] = "0"
        results[weights, "alone"] = _greedy_logits(_tiny(device, dtype, weights), ids)
    results["calls"], results["captured"] = len(calls), sum(calls)
    results["captures"] = decode_step.captures_collectives(world)


def test_a_group_of_one_sums_through_its_collectives(tmp_path):
    """``World(0, 1, group)`` (``init_world(group_alone=True)``): the model as one process
    holds it, each sum an all-reduce over gloo — which a CUDA graph could not hold, so such a
    world is never captured — and the logits of one process alone."""
    from model import decode_step
    from model.linear import ALONE

    assert decode_step.captures_collectives(ALONE) and not ALONE.joined
    with mp.Manager() as manager:
        results = manager.dict()
        run_ranks(_group_of_one, 1, "cpu", results, init_method=f"file://{tmp_path / 'rendezvous'}", timeout_s=300,
                  group_alone=True, backend="gloo")
        got = dict(results)
    assert got["captures"] is False and got["captured"] == 0
    assert got["calls"] > 0  # the attention's wo_b and the MoE's sums, each step and prefill chunk
    for weights in ("plain", "packed"):
        assert torch.equal(got[weights, "1"], got[weights, "0"])
        assert torch.equal(got[weights, "0"], got[weights, "alone"])


@pytest.mark.skipif(not torch.cuda.is_available() or not torch.distributed.is_nccl_available(),
                    reason="needs CUDA and NCCL")
def test_nccl_collectives_captured_in_the_step_graph_give_the_plain_steps_bits(tmp_path):
    """World size 1 through NCCL on one GPU: the decode step's all-reduces are captured in its
    CUDA graph (counted while capturing), and the graphed steps give the eager steps' logits
    bit for bit, which are one process alone's, with plain and packed weights."""
    with mp.Manager() as manager:
        results = manager.dict()
        run_ranks(_group_of_one, 1, "cuda", results, init_method=f"file://{tmp_path / 'rendezvous'}", timeout_s=300,
                  group_alone=True)
        got = dict(results)
    assert got["captures"] is True and got["captured"] > 0
    for weights in ("plain", "packed"):
        assert got[weights, "graphs"] > 0
        assert torch.equal(got[weights, "1"], got[weights, "0"])
        assert torch.equal(got[weights, "0"], got[weights, "alone"])
