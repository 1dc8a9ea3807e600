"""The processes that share one model: joining them into a ``World``, and running a function on each.

One ``init_world`` serves both ways a run gets its ranks: ``torchrun`` (which sets ``RANK``,
``WORLD_SIZE`` and the rendezvous variables) and :func:`run_ranks` (which spawns them from this
process with ``torch.multiprocessing``). NCCL on CUDA, gloo on the CPU; every group gets a
timeout, so a rank that dies ends the others' waiting collectives with an error instead of a
hang, and :func:`run_ranks` re-raises the first failure in the caller with the failed rank's
traceback and stops the rest (no orphan processes).

Does not own: how the model splits over the world (``model.linear``, the model's modules), nor
which rank talks to the user (the application).
"""
from __future__ import annotations

import os
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model.linear import ALONE, World

TIMEOUT_S = 600.0  # a collective waits this long for a missing rank before it fails


def init_world(rank: int | None = None, size: int | None = None, *, init_method: str | None = None,
               backend: str | None = None, timeout_s: float = TIMEOUT_S, device: str | None = None,
               group_alone: bool = False) -> World:
    """This process's place among ``size`` ranks (read from torchrun's environment where not
    given); one process alone needs no group and gets ``ALONE``, or with ``group_alone`` a
    group of its own whose collectives run (``World.joined``). ``device``: the CUDA device
    this rank's NCCL work goes to (default: ``LOCAL_RANK``, else the rank)."""
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    size = int(os.environ.get("WORLD_SIZE", 1)) if size is None else size
    if size == 1 and not group_alone:
        return ALONE
    # with CUDA, each tensor's collectives by its device: a model on the CPU (the tests') still runs
    backend = backend or ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    if "nccl" in backend:
        torch.cuda.set_device(device or int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=init_method or "env://", rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))
    return World(rank=rank, size=size, group=dist.group.WORLD if size == 1 else None)


def close_world(world: World) -> None:
    if world.joined and dist.is_initialized():
        dist.destroy_process_group()


class RankFailed(RuntimeError):
    """A rank of :func:`run_ranks` raised: the first to fail, with its traceback (the others'
    errors — a collective whose peer is gone — follow from it)."""


def run_ranks(fn, size: int, *args, init_method: str, backend: str | None = None,
              timeout_s: float = TIMEOUT_S, group_alone: bool = False) -> None:
    """``fn(world, *args)`` on ``size`` spawned processes joined through ``init_method`` (a
    ``file://`` or ``tcp://`` rendezvous; ``group_alone``: :func:`init_world`'s). Returns when
    all have; if any raises, the others are stopped and the first failure is raised here as
    :class:`RankFailed`."""
    failures = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(_rank_main, args=(size, fn, args, init_method, backend, timeout_s, failures, group_alone),
                 nprocs=size, join=True)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        seen = []
        while not failures.empty():
            seen.append(failures.get())
        if not seen:
            raise
        _, rank, trace = min(seen)
        raise RankFailed(f"rank {rank} of {size} failed:\n{trace}") from e


def _rank_main(rank: int, size: int, fn, args: tuple, init_method: str, backend: str | None,
               timeout_s: float, failures, group_alone: bool = False) -> None:
    world = init_world(rank, size, init_method=init_method, backend=backend, timeout_s=timeout_s,
                       group_alone=group_alone)
    try:
        fn(world, *args)
    except BaseException:
        failures.put((time.monotonic(), rank, traceback.format_exc()))  # before the peers see it
        raise
    finally:
        close_world(world)
