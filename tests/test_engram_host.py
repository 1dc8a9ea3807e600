"""Where the Engram tables are kept (``model.linear.Table``, ``load(..., engram=)``): on the
model's device, a rank its share of the rows, or whole in host memory, read from a
checkpoint's shards as their memory maps (one copy in the page cache for every rank). Either
way a lookup gives the same bits, so the logits and the tokens are the same."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from model.distributed import run_ranks
from model.linear import World
from model.quant import KVFormat

DEFAULT = Path(__file__).resolve().parents[1] / "model" / "assets" / "default"
IDS = torch.randint(3, 1000, (1, 150), generator=torch.Generator().manual_seed(3))


def _tables(model) -> list:
    return [b.engram.embed for b in model.layers if b.engram is not None]


def _mapped_file(t: torch.Tensor) -> str | None:
    """The file whose memory map holds ``t``'s bytes (Linux's ``/proc/self/maps``), or None."""
    address = t.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split()
        low, high = (int(x, 16) for x in span.split("-"))
        if low <= address < high:
            return rest[-1] if len(rest) >= 5 and rest[-1].startswith("/") else None
    return None


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS.to(model.device), model.new_cache(1, kv=KVFormat.FLOAT))  # over ranks: sums reordered


def _greedy(model, n: int = 24) -> list[int]:
    from model.engine import Engine, Sampling

    engine = Engine(model, chunk=64)
    state = engine.new_state()
    engine.prefill(state, IDS.to(model.device))
    return list(engine.generate(state, Sampling(max_new_tokens=n)))


@pytest.mark.parametrize("source,weights", [("tiny", "plain"), ("tiny", "packed"), (DEFAULT, "packed"),
                                            (DEFAULT, "plain")])
def test_tables_in_host_memory_give_the_same_logits_and_tokens(source, weights):
    from model.loading import load

    on_device, in_host = load(source, weights=weights), load(source, weights=weights, engram="host")
    assert all(t.host and not d.host for t, d in zip(_tables(in_host), _tables(on_device)))
    assert torch.equal(_logits(in_host), _logits(on_device))
    assert _greedy(in_host) == _greedy(on_device)


def test_a_packed_table_in_host_memory_is_the_shards_memory_map():
    """Read as stored from a checkpoint, a table's bytes are the shard's pages: a second process
    (another rank) that maps the shard shares them, and nothing was copied."""
    from model.loading import load

    if not Path("/proc/self/maps").is_file():
        pytest.skip("reads Linux's /proc/self/maps")
    model = load(DEFAULT, weights="packed", engram="host")
    for t in _tables(model):
        for stored in (t.weight, t.scale):
            assert _mapped_file(stored) == str((DEFAULT / "model-00001-of-00001.safetensors").resolve())
    plain = load(DEFAULT, weights="plain", engram="host")
    assert _mapped_file(_tables(plain)[0].weight) is None  # dequantised: its own floats


def test_a_table_in_host_memory_stays_there_through_moves_and_casts():
    from model.loading import load

    model = load("tiny", engram="host")
    table = _tables(model)[0]
    model.to(torch.bfloat16)
    assert (table.weight.device.type, table.weight.dtype) == ("cpu", torch.bfloat16)  # a plain table is cast
    packed = load("tiny", weights="packed", engram="host")
    packed.to(torch.bfloat16)
    assert _tables(packed)[0].weight.dtype == torch.float8_e4m3fn  # stored bytes keep their dtype
    packed.to("meta")
    assert _tables(packed)[0].weight.is_meta


def test_an_unknown_place_is_refused():
    from model.args import ModelArgs
    from model.model import Transformer

    with pytest.raises(ValueError, match="device or host"):
        Transformer(ModelArgs.preset("tiny"), engram="disk")


def _host_rank(world: World, results) -> None:
    from model.loading import load

    torch.set_num_threads(1)
    model = load(DEFAULT, weights="packed", world=world, engram="host")
    tables = _tables(model)
    results[world.rank] = ([(t.weight.shape[0], t.full_rows) for t in tables],
                           [_mapped_file(t.weight) for t in tables], _logits(model))


def test_over_two_ranks_each_maps_the_whole_tables_from_the_same_shard(tmp_path):
    """In host memory the tables are whole on every rank and not summed over the ranks: each
    rank maps the same shard pages, and the logits are one process's."""
    from model.loading import load

    want = _logits(load(DEFAULT, weights="packed"))
    with mp.Manager() as manager:
        results = manager.dict()
        run_ranks(_host_rank, 2, results, init_method=f"file://{tmp_path / 'rendezvous'}", timeout_s=300)
        got = dict(results)
    for rank in (0, 1):
        rows, files, logits = got[rank]
        assert all(held == whole for held, whole in rows)
        if Path("/proc/self/maps").is_file():
            assert set(files) == {str((DEFAULT / "model-00001-of-00001.safetensors").resolve())}
        torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("weights", ["plain", "packed"])
def test_on_cuda_host_tables_give_the_device_tables_bits(weights):
    """A model on the GPU with its tables in host memory: rows gathered on the host, copied
    beside the layers, dequantised on the GPU — the same logits and tokens as tables on the GPU."""
    from model.loading import load

    on_device = load(DEFAULT, device="cuda", dtype=torch.bfloat16, weights=weights)
    in_host = load(DEFAULT, device="cuda", dtype=torch.bfloat16, weights=weights, engram="host")
    assert all(t.weight.device.type == "cpu" for t in _tables(in_host))
    assert torch.equal(_logits(in_host), _logits(on_device))
    assert _greedy(in_host) == _greedy(on_device)


def test_the_engram_bench_times_both_places_and_puts_the_tables_back():
    """``bench_engram`` runs a model's decode steps with its tables on the device and in host
    memory in turn, then leaves them where they were (their bytes unchanged); the decode
    bench's weights read are counted as held: packed bytes for a packed model."""
    from model.bench import bench_engram, bench_model, weights_read_bytes
    from model.census import census

    model, _ = bench_model("tiny", device="cpu", dtype=torch.float32)
    before = [(t.host, t.weight.clone()) for t in _tables(model)]
    out = bench_engram(model, 256, steps=2, repeats=2)
    assert out["tables"] == 2 and all(out[k] > 0 for k in ("step_ms_device", "step_ms_host", "gather_us_host"))
    assert all(t.host == h and torch.equal(t.weight, w) for t, (h, w) in zip(_tables(model), before))
    plain = weights_read_bytes(model)
    assert abs(plain - 4 * census(model.args)["params_active_decode"]) < 1e-3 * plain
    packed, _ = bench_model("tiny", device="cpu", dtype=torch.float32, weights="packed")
    assert weights_read_bytes(packed) < plain / 2


def test_the_fused_step_takes_host_rows_as_inputs(monkeypatch):
    """A decode step of the fused path (on the kernels' twins here) with the tables in host
    memory takes their rows, fetched before the step, as inputs, and gives the logits of the
    tables on the device."""
    from model import decode_step as ds
    from model.loading import load

    monkeypatch.setenv("DSAGENT_KERNELS", "0")
    monkeypatch.setattr(ds, "takes_fused", ds.is_decode_step)
    seen = []
    fused = ds._fused_layers
    monkeypatch.setattr(ds, "_fused_layers", lambda m, s, p, step, *a: seen.append(step.engram_rows) or
                        fused(m, s, p, step, *a))
    logits = {}
    for place in ("device", "host"):
        model = load(DEFAULT, weights="packed", engram=place)
        cache = model.new_cache(1)
        with torch.no_grad():
            model(IDS[:, :40], cache)
            logits[place] = torch.stack([ds.forward(model, IDS[:, t: t + 1], cache)[:, -1] for t in range(40, 44)])
    assert len(seen) == 8 and all(r is None for r in seen[:4]) and all(sorted(r) == [0, 1] for r in seen[4:])
    assert torch.equal(logits["host"], logits["device"])
