"""One engine over several ranks: rank 0 drives, the other ranks follow its calls in lockstep.

A model split over N ranks (``model.linear.World``) computes only when every rank runs the
same forward at the same time: its all-reduces and gathers pair up across the ranks. So the
application runs on rank 0 alone — the session, the store, the terminal, sampling — through
a :class:`Leader`, an ``Engine`` that, before each call that runs the model or makes a cache,
sends that call (its name, the state's handle, its tensors) to the other ranks; each of them
runs :func:`follow`, which makes the same call on its own engine and its own copy of the
state. The caches come out the same on every rank (the K=V latent, index keys and windows are
replicated, ``docs/tensor-and-expert-parallel-design.md``), so rank 0 alone reads its cache to
save a session, and a session's KV does not depend on N.

What rank 0 can refuse (a context limit, stored chunks that do not parse) it refuses before it
sends anything. A Ctrl-C on rank 0 waits for the call in progress to end on every rank (the
ranks would otherwise stop in the middle of a collective), then is raised as usual.

Does not own: starting the ranks or joining them into a world (``model.distributed``, the
application), nor the split itself (``model.linear``).
"""
from __future__ import annotations

import contextlib
import itertools
import signal
import threading
import time
import weakref

import torch
import torch.distributed as dist

from model.engine import Engine, State
from model.linear import World
from model.quant import KVFormat

STOP = "stop"
_HANDLES = itertools.count()  # one numbering for every leader of this process: the followers' states share a dict


class Leader(Engine):
    """Rank 0's engine over a world of several ranks: every model call is made on all of them."""

    def __init__(self, model, world: World, **engine_options):
        super().__init__(model, **engine_options)
        assert world.size > 1 and world.rank == 0, "the leader is rank 0 of several"
        self.world = world
        self._dropped: list[int] = []  # states rank 0 no longer holds: the followers drop theirs with the next call

    # ------------------------------------------------------------------ states
    def new_state(self, batch: int = 1, kv: KVFormat = KVFormat.PACKED) -> State:
        state = super().new_state(batch, kv)
        self._send("new", self._handle(state), batch, kv)
        return state

    def state_from_chunks(self, chunks: list[dict[str, bytes]], length: int) -> State:
        state = super().state_from_chunks(chunks, length)  # refused here (CacheFormatError) before any rank sees it
        self._send("chunks", self._handle(state), chunks, length)
        return state

    def import_global(self, tensors: dict[str, torch.Tensor], meta: dict) -> State:
        state = super().import_global(tensors, meta)
        self._send("global", self._handle(state), _cpu(tensors), meta)
        return state

    # ------------------------------------------------------------------ model calls
    def prefill(self, state: State, ids: torch.Tensor, *, mode: str | None = None, images=None,
                progress=None) -> torch.Tensor:
        self._check_room(state, ids.shape[1])
        with _interrupts_held():
            self._send("prefill", state.rank_handle, _cpu(ids), mode or self.mode, _cpu(images), self.chunk)
            return super().prefill(state, ids, mode=mode, images=images, progress=progress)

    def decode(self, state: State, token: torch.Tensor) -> torch.Tensor:
        self._check_room(state, 1)
        with _interrupts_held():
            self._send("decode", state.rank_handle, _cpu(token))
            return super().decode(state, token)

    def replay(self, state: State, log_ids: torch.Tensor, images=None, tokens: int | None = None) -> torch.Tensor:
        """As ``Engine.replay``; ``images`` (a callable of log ranges) is asked here for the
        ranges the replay reads, and the followers get their answers."""
        n = log_ids.shape[1]
        if n != state.length or n == 0:  # refused, or nothing to run: as the engine does, here alone
            return super().replay(state, log_ids, images=images, tokens=tokens)
        table = {}
        if images is not None:
            first, begin = self.replay_spans(n, tokens)
            table = {(first, begin): images(first, begin), (begin, n): images(begin, n)}
        with _interrupts_held():
            self._send("replay", state.rank_handle, _cpu(log_ids), _cpu(table), tokens)
            return super().replay(state, log_ids, images=_ranges(table) if images is not None else None,
                                  tokens=tokens)

    def all_reduce_seconds(self, shape: tuple, dtype: torch.dtype, repeats: int = 20) -> float:
        """Seconds of one all-reduce (sum) of a ``shape`` tensor of ``dtype`` on the model's
        device over the world, every rank taking part: the mean of ``repeats`` after one."""
        with _interrupts_held():
            self._send("all_reduce", None, shape, dtype, repeats)
            return _all_reduces(self.world, shape, dtype, repeats, self.model.device)

    def close(self) -> None:
        """The followers leave :func:`follow` (once; later calls do nothing)."""
        if self.world is not None:
            self._send(STOP, None)
            self.world = None

    # ------------------------------------------------------------------ the wire
    def _handle(self, state: State) -> int:
        handle = next(_HANDLES)
        state.rank_handle = handle
        weakref.finalize(state, self._dropped.append, handle)
        return handle

    def _send(self, op: str, handle: int | None, *args) -> None:
        if self.world is None:
            raise RuntimeError("the other ranks have left: this engine was closed")
        dropped, self._dropped = self._dropped, []
        with _interrupts_held():  # one message is two collectives (its size, its bytes): never half sent
            dist.broadcast_object_list([(op, handle, args, dropped)], src=0, group=self.world.group)


def follow(engine: Engine, world: World) -> None:
    """Rank ``world.rank`` > 0: make rank 0's calls on ``engine`` until it closes."""
    states: dict[int, State] = {}
    device = engine.model.device
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=world.group)
        op, handle, args, dropped = box[0]
        for h in dropped:
            states.pop(h, None)
        if op == STOP:
            return
        if op == "new":
            states[handle] = engine.new_state(*args)
        elif op == "chunks":
            states[handle] = engine.state_from_chunks(*args)
        elif op == "global":
            states[handle] = engine.import_global(*args)
        elif op == "prefill":
            ids, mode, images, engine.chunk = args  # chunks as rank 0's: the same forwards, the same collectives
            engine.prefill(states[handle], ids, mode=mode, images=_on(images, device))
        elif op == "decode":
            engine.decode(states[handle], args[0])
        elif op == "replay":
            log_ids, table, tokens = args
            table = _on(table, device)
            engine.replay(states[handle], log_ids, images=_ranges(table) if table else None, tokens=tokens)
        elif op == "all_reduce":
            _all_reduces(world, *args, device)
        else:
            raise ValueError(f"rank 0 sent an unknown call {op!r}")


def _ranges(table: dict):
    """The ``images`` callable of a replay, ``(begin, end) -> embeds or None``, answered from
    ``table`` (the ranges rank 0 asked its own callable for)."""
    return lambda begin, end: table.get((begin, end))


def _all_reduces(world: World, shape: tuple, dtype: torch.dtype, repeats: int, device) -> float:
    x = torch.ones(shape, dtype=dtype, device=device)
    dist.all_reduce(x, group=world.group)  # the first: connections made
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(x, group=world.group)
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    return (time.perf_counter() - start) / repeats


def _cpu(x):
    """Tensors (in tuples, dicts) moved to the CPU: what crosses to another rank's device."""
    return _mapped(x, lambda t: t.cpu())


def _on(x, device):
    return _mapped(x, lambda t: t.to(device))


def _mapped(x, fn):
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, tuple):
        return tuple(_mapped(v, fn) for v in x)
    if isinstance(x, dict):
        return {k: _mapped(v, fn) for k, v in x.items()}
    return x


@contextlib.contextmanager
def _interrupts_held():
    """Ctrl-C (SIGINT) held while every rank makes one call, then raised: a rank stopped in the
    middle of a forward would leave the others waiting in a collective."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda *a: caught.append(a))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught and callable(previous):
        previous(*caught[0])  # Python's own handler raises KeyboardInterrupt
    elif caught and previous != signal.SIG_IGN:
        raise KeyboardInterrupt
