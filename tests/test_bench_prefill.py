"""``dsagent bench prefill``: the model FLOPs of each mode over its time against the matmul
rate of the same run (``prefill_mfu``), and the time split by part (``model.bench._PartTimer``)."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from model.census import prefill_flops


@pytest.fixture(scope="module")
def result():
    from model import load
    from model.bench import bench_prefill

    return bench_prefill(load("tiny"), 200, chunk=64, gen=4, matmul_size=256)


def test_prefill_mfu_is_the_census_flops_over_the_time_and_the_matmul_rate(result) -> None:
    from model.args import ModelArgs

    args = ModelArgs.preset("tiny")
    for mode in ("exact", "ced"):
        flops = prefill_flops(args, 200, mode)["total"]
        assert result[f"{mode}_gflop_per_token"] == pytest.approx(flops / 200 / 1e9)
        seconds = 200 / result[f"{mode}_tokens_per_s"]
        assert result[f"{mode}_prefill_mfu"] == pytest.approx(flops / seconds / 1e12 / result["matmul_tflops"])
        # no upper bound: the matmul rate and the prefill are timed apart, and on a loaded CPU
        # either may be slowed alone (an mfu over 1.5 was seen so)
        assert 0 < result[f"{mode}_prefill_mfu"] < float("inf")


def test_the_parts_split_the_time_and_carry_the_census_flops(result) -> None:
    from model.args import ModelArgs

    for mode in ("exact", "ced"):
        parts = result[f"{mode}_by_part"]
        census = prefill_flops(ModelArgs.preset("tiny"), 200, mode)["by_part"]
        assert {p: row["flops"] for p, row in parts.items() if row["flops"]} == {p: f for p, f in census.items() if f}
        assert {"linear", "attention", "indexer", "mhc", "moe_dispatch", "engram", "other"} <= set(parts)
        assert sum(row["share"] for row in parts.values()) == pytest.approx(1.0, abs=1e-6)
        assert all(row["seconds"] > 0 for p, row in parts.items() if p != "other")


def test_cli_bench_prefill_json() -> None:
    from dsagent.commands.bench import app

    out = CliRunner().invoke(app, ["prefill", "--preset", "tiny", "--ctx", "96", "--chunk", "48", "--no-parts",
                                   "--device", "cpu", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["chunk"] == 48 and "ced_prefill_mfu" in data and "ced_by_part" not in data
