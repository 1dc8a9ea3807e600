"""Joining ranks and running on them (``model.distributed``), over gloo on the CPU: results from
every rank, and a rank that raises ending the run with its error instead of a hang."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model.distributed import RankFailed, init_world, run_ranks
from model.linear import ALONE


def _sum_of_ranks(world, results) -> None:
    t = torch.tensor([float(world.rank + 1)])
    results[world.rank] = float(world.sum(t))


def _one_rank_fails(world) -> None:
    if world.rank == 1:
        raise RuntimeError("rank 1 failed on purpose")
    world.sum(torch.ones(1))  # rank 0 waits here for a rank that is gone


def test_every_rank_runs_and_their_collective_meets(tmp_path):
    with mp.Manager() as manager:
        results = manager.dict()
        run_ranks(_sum_of_ranks, 2, results, init_method=f"file://{tmp_path / 'rendezvous'}", timeout_s=60)
        assert dict(results) == {0: 3.0, 1: 3.0}


def test_a_rank_that_raises_ends_the_run_with_its_error(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1 of 2 failed:(.|\n)*rank 1 failed on purpose"):
        run_ranks(_one_rank_fails, 2, init_method=f"file://{tmp_path / 'rendezvous'}", timeout_s=10)
    assert time.monotonic() - start < 120  # the survivor is stopped, or its collective times out


def test_one_process_alone_joins_no_group():
    assert init_world(0, 1) is ALONE and not dist.is_initialized()
