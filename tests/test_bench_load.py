"""`dsagent bench load` on the tiny preset and on a sharded checkpoint, and the reader under it.

The figures are checked against what they are made of (the state dict's bytes, the shard
files' sizes, the resident set before and at the peak), never against a time or a size
target: a benchmark is not a test. The reader's part: each shard is closed as soon as its
last tensor is read, and a tensor goes where it is asked.
"""
import json

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

import dsagent.cli as cli
from model import checkpoint
from model.args import ModelArgs
from model.checkpoint import iter_checkpoint, read_weight_map, scale_name, write_checkpoint
from model.loading import BUNDLED_TOKENIZER, build, load


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DSAGENT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DSAGENT_THREADS", raising=False)


@pytest.fixture(scope="module")
def tiny():
    return build(ModelArgs.preset("tiny"), seed=0)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, tiny):
    """The tiny preset written in shards of about 1 MB (11 of them)."""
    out = tmp_path_factory.mktemp("bench-load") / "tiny"
    return write_checkpoint(out, tiny.args.to_config(), tiny.state_dict(), tokenizer_json=BUNDLED_TOKENIZER,
                            shard_bytes=1_000_000)


def bench_load(*args: str) -> dict:
    r = CliRunner().invoke(cli.app, ["bench", "load", *args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def state_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def check_host(out: dict, shard_bytes: int) -> None:
    """The resident set's figures against each other; the CPU's ratio from them."""
    assert out["rss_peak_bytes"] >= max(out["rss_before_bytes"], out["rss_after_bytes"])
    assert out["anon_peak_bytes"] >= max(out["anon_before_bytes"], out["anon_after_bytes"])
    assert out["host_growth_bytes"] == out["rss_peak_bytes"] - out["rss_before_bytes"]
    assert out["growth_over_held_and_shard"] == pytest.approx(
        out["host_growth_bytes"] / (out["held_bytes"] + shard_bytes))
    assert "gpu_allocated_bytes" not in out and "growth_over_shard" not in out  # CUDA's figures


def test_a_preset_reports_its_held_bytes_and_the_host_around_the_build(tiny):
    out = bench_load("--preset", "tiny")
    assert out["bench"] == "load" and out["preset"] == "tiny" and out["device"] == "cpu" and out["load_s"] > 0
    assert out["held_bytes"] == state_bytes(tiny)
    check_host(out, shard_bytes=0)
    assert "checkpoint_bytes" not in out
    short = bench_load("--preset", "tiny", "--layers", "8", "--weights", "packed")
    assert short["layers"] == 8 and short["weights"] == "packed" and short["held_bytes"] < out["held_bytes"]


@pytest.mark.parametrize("weights", ["plain", "packed"])
def test_a_checkpoint_reports_its_shards_beside_what_the_model_holds(sharded, weights):
    out = bench_load("--model", str(sharded), "--weights", weights)
    files = sorted(sharded.glob("*.safetensors"))
    assert out["checkpoint"] == str(sharded) and out["weights"] == weights and out["shards"] == len(files) > 1
    assert out["checkpoint_bytes"] == sum(f.stat().st_size for f in files)
    assert out["largest_shard_bytes"] == max(f.stat().st_size for f in files)
    assert out["held_bytes"] == state_bytes(load(sharded, weights=weights))
    assert out["held_over_checkpoint"] == pytest.approx(out["held_bytes"] / out["checkpoint_bytes"])
    check_host(out, out["largest_shard_bytes"])


def test_a_preset_cut_is_refused_for_a_checkpoint_and_weights_name_a_form(sharded):
    for args in (["--model", str(sharded), "--layers", "8"], ["--preset", "tiny", "--weights", "fp8"]):
        r = CliRunner().invoke(cli.app, ["bench", "load", *args])
        assert r.exit_code == 2, r.output


class ClosingShards:
    """Test double for ``safe_open``: the real shard, noting the tensors read before it was
    first closed (``closed``: shard file name -> that count)."""

    def __init__(self, closed: dict, read: list, path: str, framework: str):
        self.closed, self.read, self.name = closed, read, path.rsplit("/", 1)[-1]
        self.inner = safe_open(path, framework=framework)

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        self.closed.setdefault(self.name, len(self.read))
        return self.inner.__exit__(*exc)

    def get_tensor(self, name: str) -> torch.Tensor:
        self.read.append(name)
        return self.inner.get_tensor(name)

    def get_slice(self, name: str):
        return self.inner.get_slice(name)


def test_the_reader_closes_each_shard_after_its_last_tensor(sharded, tiny, monkeypatch):
    """Not at the load's end: a shard's memory map, and the pages read from it, go with it."""
    closed, read = {}, []
    monkeypatch.setattr(checkpoint, "safe_open", lambda p, framework: ClosingShards(closed, read, p, framework))
    expected = {k: tuple(v.shape) for k, v in tiny.state_dict().items()}
    for _ in iter_checkpoint(sharded, expected, compressed=True):
        pass
    shard_of, last = read_weight_map(sharded), {}
    for i, name in enumerate(read, 1):
        last[shard_of[name]] = i
    assert closed == last and len(closed) == len(set(shard_of.values()))


def test_a_tensor_goes_where_it_is_asked(sharded, tiny):
    """``devices`` sends a tensor (and its scale) apart from the rest: here the meta device
    stands for a GPU and the host keeps one Engram table."""
    table = "layers.1.engram.embed.weight"
    expected = {k: tuple(v.shape) for k, v in tiny.state_dict().items()}
    got = {}
    for _, tensors in iter_checkpoint(sharded, expected, device="meta", compressed=True, devices={table: "cpu"}):
        got.update(tensors)
    on_host = {k for k, t in got.items() if t.device.type == "cpu"}
    assert on_host == {table, scale_name(table)} and all(t.is_meta for k, t in got.items() if k not in on_host)
