"""The linear family (``model.linear``): packed formats against the checkpoint's dequantiser,
and the parallel splits over a world of two gloo processes against the whole layer."""
from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from model.checkpoint import dequantize_tensor, quantize_tensor
from model.distributed import run_ranks
from model.linear import ALONE, Linear, World, grouped_linear, shard

FP8_NAME = "layers.0.attn.wq_a.weight"  # an FP8 family in the checkpoint
FP4_NAME = "layers.0.ffn.experts.0.w1.weight"  # a routed expert: FP4


def _packed_layer(fmt: str, out_f: int, in_f: int, seed: int) -> tuple[Linear, torch.Tensor]:
    """A packed Linear loaded from the checkpoint's own stored tensors, and the float weight
    ``model.checkpoint`` dequantises from them."""
    w = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed))
    name = FP8_NAME if fmt == "fp8" else FP4_NAME
    stored = quantize_tensor(name, w)
    q, scale = stored[name], stored[name.removesuffix(".weight") + ".scale"]
    layer = Linear(in_f, out_f, fmt=fmt)
    layer.load_state_dict({"weight": q, "scale": scale})
    assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))  # the stored bytes, as stored
    return layer, dequantize_tensor(fmt, q, scale, (out_f, in_f))


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@pytest.mark.parametrize("out_f,in_f", [(64, 96), (40, 72), (7, 33)])
def test_a_packed_weight_dequantises_as_the_checkpoint_does(fmt, out_f, in_f):
    layer, want = _packed_layer(fmt, out_f, in_f, seed=out_f + in_f)
    assert layer.weight.dtype == (torch.float8_e4m3fn if fmt == "fp8" else torch.int8)
    assert torch.equal(layer.dense_weight(torch.float32), want)
    x = torch.randn(3, 5, in_f, generator=torch.Generator().manual_seed(1))
    assert torch.equal(layer(x), F.linear(x, want))


def test_a_plain_linear_is_nn_linear():
    """Same init, same parameter names, same outputs: the checkpoint's names and seeded models stay."""
    torch.manual_seed(3)
    ours = Linear(16, 8)
    torch.manual_seed(3)
    theirs = torch.nn.Linear(16, 8, bias=False)
    assert list(ours.state_dict()) == ["weight"] and torch.equal(ours.weight, theirs.weight)
    x = torch.randn(4, 16)
    assert torch.equal(ours(x), theirs(x))


def test_grouped_linear_reads_each_group_alone():
    layer = Linear(12, 8)
    x = torch.randn(2, 3, 24)  # 2 groups of 12 inputs -> 2 groups of 4 outputs
    want = torch.cat([F.linear(x[..., g * 12:(g + 1) * 12], layer.weight[g * 4:(g + 1) * 4]) for g in range(2)], -1)
    torch.testing.assert_close(grouped_linear(layer, x, groups=2), want)


def test_bad_formats_splits_and_worlds_are_refused():
    with pytest.raises(ValueError, match="fp16"):
        Linear(8, 8, fmt="fp16")
    with pytest.raises(ValueError, match="diagonal"):
        Linear(8, 8, split="diagonal")
    with pytest.raises(ValueError, match="do not split evenly over 3 ranks"):
        Linear(8, 10, split="column", world=World(rank=0, size=3))
    with pytest.raises(ValueError, match="rank 2"):
        World(rank=2, size=2)


def test_a_rank_holds_its_part_of_each_split():
    full = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
    world = World(rank=1, size=2)
    column, row = Linear(6, 8, split="column", world=world), Linear(6, 8, split="row", world=world)
    assert tuple(column.weight.shape) == (4, 6) and tuple(row.weight.shape) == (8, 3)
    assert torch.equal(shard(full, column), full[4:]) and torch.equal(shard(full, row), full[:, 3:])
    assert torch.equal(shard(full, Linear(6, 8)), full)
    assert ALONE.part(8, "rows") == slice(0, 8)


def _two_ranks(world: World, results) -> None:
    """One rank: an MLP split column -> row, and a vocab-split head gathered, from the same
    seeded whole weights as the single-process reference."""
    g = torch.Generator().manual_seed(0)
    w1, w2, head = torch.randn(16, 8, generator=g), torch.randn(8, 16, generator=g), torch.randn(12, 8, generator=g)
    x = torch.randn(3, 8, generator=g)
    up, down = Linear(8, 16, split="column", world=world), Linear(16, 8, split="row", world=world)
    vocab = Linear(8, 12, split="vocab", world=world)
    with torch.no_grad():
        for layer, full in ((up, w1), (down, w2), (vocab, head)):
            layer.weight.copy_(shard(full, layer))
        y = down(F.silu(up(x)))
        logits = world.gather(vocab(y))
    want_y = F.linear(F.silu(F.linear(x, w1)), w2)
    results[world.rank] = (torch.allclose(y, want_y, rtol=1e-5, atol=1e-5),
                           torch.allclose(logits, F.linear(want_y, head), rtol=1e-5, atol=1e-5))


def test_column_then_row_over_two_ranks_equals_the_whole_layer(tmp_path):
    """World size 2 on the CPU (gloo): each rank's column slice of the up projection and row
    slice of the down projection, summed by one all-reduce, give the whole MLP's output on
    every rank; a vocab-split head's slices gathered give the whole head's logits."""
    init = f"file://{tmp_path / 'rendezvous'}"
    with mp.Manager() as manager:
        results = manager.dict()
        run_ranks(_two_ranks, 2, results, init_method=init, timeout_s=60)
        assert dict(results) == {0: (True, True), 1: (True, True)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_layers_on_the_gpu_equal_the_cpu_twin():
    for fmt in ("fp8", "fp4"):
        layer, want = _packed_layer(fmt, 256, 512, seed=2)
        x = torch.randn(4, 512, generator=torch.Generator().manual_seed(3))
        got = layer.cuda()(x.cuda().bfloat16()).float().cpu()
        torch.testing.assert_close(got, F.linear(x.bfloat16(), want.bfloat16()).float(), rtol=2e-2, atol=2e-2)
