"""``--gpus N``: the model split over N processes of this machine, this one driving them.

Owns: spawning the N - 1 follower processes (``torch.multiprocessing``, spawn), joining all
N into one world (``model.distributed.init_world``: NCCL on CUDA, gloo on the CPU, a
timeout on every collective), what a follower does (load its part of the model, then
``model.lockstep.follow``), and ending them: when rank 0 closes, when a follower fails
(its traceback on rank 0's stderr, then every rank exits: no hang) and when rank 0 is gone
(a follower that finds its parent gone exits: no orphans). Under ``torchrun`` the ranks are
torchrun's (:func:`torchrun_world`); rank 0 runs the command, the others follow.

Rank r of N uses ``cuda:r`` where the device is CUDA; ``--device cpu`` runs the N ranks on
the CPU over gloo (how the tests run it). Does not own the split (``model.linear``), the
lockstep calls (``model.lockstep``), or the command line (``dsagent.cli``).
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsagent.runtime import Settings
    from model.linear import World

POLL_S = 0.2  # how often rank 0 looks at its followers, and a follower at its parent
JOIN_S = 30.0  # how long rank 0 waits for a follower to leave after it closed


class RankFailed(RuntimeError):
    """A follower rank failed; its traceback follows the message."""


def rank_device(device: str, rank: int) -> str:
    """The device rank ``rank`` runs on: ``cuda:rank`` (plus the index asked for) or the CPU."""
    if not device.startswith("cuda"):
        return device
    first = int(device.partition(":")[2] or 0)
    return f"cuda:{first + rank}"


class Ranks:
    """The followers of this process (rank 0) and the world they share."""

    def __init__(self, world: World, procs: list, failures, on_failure=None):
        self.world, self.procs, self.failures = world, procs, failures
        self.on_failure = on_failure or _exit_on_failure
        self._closing = threading.Event()
        self._watch = threading.Thread(target=self._watch_followers, name="rank watch", daemon=True)
        self._watch.start()

    def _watch_followers(self) -> None:
        """A follower that exits before rank 0 closes has failed: report it and end the run
        (rank 0 may be waiting in a collective it would never leave)."""
        while not self._closing.wait(POLL_S):
            dead = self._dead()
            if dead and not self._closing.is_set():
                self.stop()
                self.on_failure(_failure_text(self.failures, dead, self.world.size))
                return

    def failed(self, wait_s: float = 2.0) -> str | None:
        """The report of a follower that has failed, waiting up to ``wait_s`` for one to be seen
        (rank 0's own collective may fail first, when a peer's connection closes); None if none."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = self._dead()
            if dead or time.monotonic() >= deadline:
                return _failure_text(self.failures, dead, self.world.size) if dead else None
            time.sleep(POLL_S / 4)

    def _dead(self) -> list:
        """(rank, process) of each follower that has exited with an error."""
        return [(r, p) for r, p in enumerate(self.procs, 1) if p.exitcode not in (None, 0)]

    def close(self, engine=None) -> None:
        """Rank 0 is done: the followers leave their loop (``engine``: the leader that tells
        them), rank 0 waits for them, then leaves the world."""
        from model.distributed import close_world

        if self._closing.is_set():
            return
        self._closing.set()
        try:
            if engine is not None:
                engine.close()
        finally:
            deadline = time.monotonic() + JOIN_S
            for p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
            self.stop()
            close_world(self.world)

    def stop(self) -> None:
        """Every follower still running is killed (no orphan outlives rank 0)."""
        self._closing.set()
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)


def start(settings: Settings, n: int, timeout_s: float | None = None, on_failure=None) -> Ranks:
    """Spawn ranks 1..n-1 (each loads its part of ``settings``' model and follows), then
    join them as rank 0; returns once every rank is in the world (the followers load their
    model meanwhile, as rank 0 loads its own). ``on_failure``: called with the report of a
    follower that failed (default: print it and exit 1)."""
    import torch.multiprocessing as mp

    from model.distributed import TIMEOUT_S, init_world

    timeout_s = timeout_s or TIMEOUT_S
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    failures = ctx.SimpleQueue()
    procs = []
    for rank in range(1, n):
        p = ctx.Process(target=_follower, args=(rank, n, init_method, settings, timeout_s, failures, os.getpid()),
                        name=f"dsagent rank {rank}", daemon=False)
        p.start()
        procs.append(p)
    try:
        world = init_world(0, n, init_method=init_method, backend=_backend(settings.device), timeout_s=timeout_s,
                           device=rank_device(settings.device, 0))
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return Ranks(world, procs, failures, on_failure)


def torchrun_world() -> World | None:
    """Under ``torchrun`` (WORLD_SIZE > 1 in the environment): this process's place in its world."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from model.distributed import init_world

    return init_world()


def follow_as(world: World, settings: Settings) -> None:
    """Rank ``world.rank`` > 0: load its part of the model, then make rank 0's calls until it
    closes (the body of a spawned follower and of a torchrun rank other than 0)."""
    from dsagent.runtime import Runtime
    from model.lockstep import follow

    settings = replace(settings, device=rank_device(settings.device, world.rank))
    runtime = Runtime.load(settings, world=world)
    follow(runtime.engine, world)
    runtime.model.derived.clear()  # its graphs gone before the world closes (``Runtime.close``)


def _follower(rank: int, n: int, init_method: str, settings: Settings, timeout_s: float, failures,
              parent: int) -> None:
    import traceback

    from model.distributed import close_world, init_world

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle; it ends the followers
    threading.Thread(target=_exit_without, args=(parent,), name="parent watch", daemon=True).start()
    world = None
    try:
        world = init_world(rank, n, init_method=init_method, backend=_backend(settings.device), timeout_s=timeout_s,
                           device=rank_device(settings.device, rank))
        follow_as(world, settings)
    except BaseException:
        failures.put((rank, traceback.format_exc()))
        sys.stderr.flush()
        os._exit(1)  # not through the world's teardown: its peers may be gone
    close_world(world)


def _exit_without(parent: int) -> None:
    """A follower whose rank 0 is gone (killed, crashed) exits rather than wait in a collective."""
    while True:
        time.sleep(POLL_S)
        if os.getppid() != parent:
            os._exit(1)


def _failure_text(failures, dead: list, n: int) -> str:
    reports = {}
    while not failures.empty():
        rank, trace = failures.get()
        reports[rank] = trace
    lines = []
    for rank, p in dead:
        trace = reports.get(rank, f"(exit code {p.exitcode}, no traceback: killed, or out of memory)\n")
        lines.append(f"rank {rank} of {n} failed:\n{trace}")
    return "".join(lines)


def _exit_on_failure(text: str) -> None:
    """The CLI's ending for a failed follower: its report on stderr, exit 1 at once (the main
    thread may be waiting in a collective that will never complete)."""
    sys.stderr.write(f"error: a model rank failed; every rank was stopped\n{text}")
    sys.stderr.flush()
    os._exit(1)


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
