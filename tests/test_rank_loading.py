"""A rank's part of a model (``load(..., world=World(rank, 2))``), read by slices straight from a
checkpoint's shards or taken from a preset's seeded whole model: bit for bit the part
``local_state`` cuts from the whole model, plain and packed; only that part's bytes asked of
the shards; a packed part off the scales' block boundaries refused by name.

Loading does no collective, so each rank's part is loaded here in one process (``World``
without a group); the model over two gloo ranks runs in ``tests/test_parallel.py``.
"""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from model import checkpoint
from model.args import ConfigError, ModelArgs
from model.checkpoint import CheckpointError, iter_checkpoint, write_checkpoint
from model.linear import World
from model.loading import BUNDLED_TOKENIZER, build, expected_shapes, load, local_state, rank_slices

RANKS = [World(rank=r, size=2) for r in range(2)]
FEW_EXPERTS = ModelArgs.preset("tiny").replace(n_routed_experts=2)  # one a rank: packing FP4 is the slow part


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))[:5]
    for k in got:
        assert got[k].dtype == want[k].dtype and torch.equal(_bytes(got[k]), _bytes(want[k])), k


def _write(path, block: int, args: ModelArgs | None = None):
    """The tiny preset written by the project's writer in several shards, FP8 blocks ``block``."""
    model = load("tiny", seed=0, args=args)
    write_checkpoint(path, model.args.to_config(), model.state_dict(), tokenizer_json=BUNDLED_TOKENIZER,
                     expert_dtype=model.args.expert_dtype, block=block, shard_bytes=4_000_000)
    return path


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("ranks") / "m", block=32)


@pytest.fixture(scope="module")
def written_128(tmp_path_factory):
    """128-blocks: a rank's 64 rows of the tiny ``wo_a`` are half a block."""
    return _write(tmp_path_factory.mktemp("ranks128") / "m", block=128, args=FEW_EXPERTS)


@pytest.mark.parametrize("weights", ["plain", "packed"])
def test_a_ranks_slices_are_its_part_of_the_whole_model(written, weights):
    whole = load(written, weights=weights).state_dict()
    for world in RANKS:
        part = load(written, weights=weights, world=world)
        _assert_same(part.state_dict(), local_state(part, whole))
    assert part.layers[0].attn.wq_b.fmt == ("fp8" if weights == "packed" else "plain")


class CountingShards:
    """Test double for ``safe_open``: the real shard, with the bytes of every tensor, or slice of
    one, that a reader asks it for added up by name."""

    def __init__(self, asked: dict, path: str, framework: str):
        self.asked, self.inner = asked, safe_open(path, framework=framework)

    def __enter__(self):
        self.handle = self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def _count(self, name: str, t: torch.Tensor) -> torch.Tensor:
        self.asked[name] = self.asked.get(name, 0) + t.numel() * t.element_size()
        return t

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._count(name, self.handle.get_tensor(name))

    def get_slice(self, name: str):
        whole, count = self.handle.get_slice(name), self._count

        class Slice:
            get_dtype, get_shape = whole.get_dtype, whole.get_shape

            def __getitem__(self, index):
                return count(name, whole[index])

        return Slice()


def _asked(monkeypatch, path, weights: str, world: World) -> dict[str, int]:
    asked: dict[str, int] = {}
    monkeypatch.setattr(checkpoint, "safe_open", lambda p, framework: CountingShards(asked, p, framework))
    load(path, weights=weights, world=world)
    return asked


@pytest.mark.parametrize("weights", ["plain", "packed"])
def test_a_rank_asks_the_shards_for_its_share_only(written, weights, monkeypatch):
    """Each split tensor's bytes are asked for once over the two ranks, each routed expert by one
    rank, every other tensor whole by each."""
    split = set(rank_slices(load(written, weights=weights, world=RANKS[0])))
    whole = _asked(monkeypatch, written, weights, World())
    ranks = [_asked(monkeypatch, written, weights, world) for world in RANKS]
    split |= {n.removesuffix(".weight") + ".scale" for n in split}  # a plain load reads the scales too
    for name, n in whole.items():
        got = [r.get(name, 0) for r in ranks]
        if name in split or ".ffn.experts." in name:
            assert sum(got) == n, (name, got, n)
        else:
            assert got == [n, n], (name, got, n)
    share = [sum(r.values()) / sum(whole.values()) for r in ranks]
    print(f"{weights}: a rank of 2 asks for {share[0]:.3f} / {share[1]:.3f} of a whole load's "
          f"{sum(whole.values())} bytes")


def test_a_packed_slice_off_the_block_boundaries_is_refused_by_name(written_128):
    with pytest.raises(ConfigError, match=r"layers\.0\.attn\.wo_a\.weight: a rank's 64 of its 128 rows .* "
                                          r"not whole 128-blocks"):
        load(written_128, weights="packed", world=RANKS[1])
    with pytest.raises(ConfigError, match=r"layers\.0\.attn\.wo_a\.weight"):
        build(FEW_EXPERTS.replace(weight_block_size=128), weights="packed", world=RANKS[0])


def test_plain_slices_off_the_block_boundaries_read_their_blocks_and_cut(written_128):
    whole = load(written_128).state_dict()
    for world in RANKS:
        part = load(written_128, world=world)
        _assert_same(part.state_dict(), local_state(part, whole))


def test_the_reader_holds_a_part_as_stored_only_in_whole_blocks(written_128):
    """The checkpoint reader's own check, for a caller that asks it for such a part as stored."""
    expected = expected_shapes(load(written_128))
    name = "layers.0.attn.wo_a.weight"
    groups = iter_checkpoint(written_128, expected, compressed=True, parts={name: (0, 64, 128)})
    with pytest.raises(CheckpointError, match=rf"{name}: rows \[64, 128\) are not whole 128-blocks"):
        list(groups)


@pytest.mark.parametrize("weights", ["plain", "packed"])
def test_a_preset_per_rank_is_its_part_of_the_whole_preset(weights):
    whole = build(FEW_EXPERTS, seed=3, weights=weights).state_dict()
    for world in RANKS:
        part = load("tiny", args=FEW_EXPERTS, seed=3, weights=weights, world=world)
        assert part.world == world and list(part.layers[0].ffn.experts.keys()) == [str(world.rank)]
        _assert_same(part.state_dict(), local_state(part, whole))
