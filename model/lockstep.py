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

DSpark speculation (``model.dspark``) runs the same way: :meth:`Leader.speculator` gives rank 0
a speculator that sends each of its model calls first (the context sync's tail forward, a
draft block's forward and head, the verification forward, the settle that rolls back to the
accepted tokens and extends the draft context), and every other rank makes it on its own copy
of that speculator. Rank 0 alone samples and accepts; the others make the calls with its
choices (the ids, how many tokens are kept), so their caches and draft contexts stay its.
The draft stages are split over the ranks as the layers are, and the embedding and the head
they share with the target by vocabulary, so a draft block's forward has collectives too.

What rank 0 can refuse (a context limit, stored chunks that do not parse, a history too short
for the draft context) it refuses before it sends anything. A Ctrl-C on rank 0 waits for the
call in progress to end on every rank (the ranks would otherwise stop in the middle of a
collective), then is raised as usual.

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

from model.dspark import DraftBlock, Speculator
from model.engine import Engine, Sampling, State
from model.linear import World
from model.quant import KVFormat

STOP = "stop"
_HANDLES = itertools.count()  # one numbering for every leader of this process: the followers' copies share it


class Leader(Engine):
    """Rank 0's engine over a world of several ranks: every model call is made on all of them."""

    def __init__(self, model, world: World, **engine_options):
        super().__init__(model, **engine_options)
        assert world.size > 1 and world.rank == 0, "the leader is rank 0 of several"
        self.world = world
        self._dropped: list[int] = []  # handles rank 0 no longer holds: the followers drop theirs with the next call

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

    def speculator(self, **options) -> Speculator:
        """A DSpark speculator whose model calls every rank makes: ``Speculator``'s ``options``,
        its drafter the model's own draft stages (those a follower runs). Raises
        SpeculationUnavailable here alone when the model has none."""
        return _LeadSpeculator(self, **options)

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
    def _handle(self, held) -> int:
        """A new handle for ``held`` (a state, a speculator): the followers keep their copy of it
        under that handle until rank 0 lets go of ``held``."""
        handle = next(_HANDLES)
        held.rank_handle = handle
        weakref.finalize(held, self._dropped.append, handle)  # this list object for good: emptied in place
        return handle

    def _send(self, op: str, handle: int | None, *args) -> None:
        if self.world is None:
            raise RuntimeError("the other ranks have left: this engine was closed")
        dropped = []
        while self._dropped:  # popped one by one: a finalizer that runs meanwhile is not lost
            dropped.append(self._dropped.pop())
        with _interrupts_held():  # one message is two collectives (its size, its bytes): never half sent
            dist.broadcast_object_list([(op, handle, args, dropped)], src=0, group=self.world.group)


class _LeadSpeculator(Speculator):
    """Rank 0's speculator over the world: each call that runs the model or changes the draft
    context is sent before it is made, with the state it is made on and rank 0's choices."""

    def __init__(self, leader: Leader, **options):
        super().__init__(leader.model, leader, drafter=None, **options)
        leader._send("speculator", leader._handle(self))

    def sync(self, state: State, history) -> None:
        tail = self.sync_tail(state, history)  # a history too short is refused here, before any rank sees it
        with _interrupts_held():
            self.engine._send("sync", self.rank_handle, state.rank_handle, _cpu(tail))
            super().sync(state, tail)

    def propose(self, state: State, anchor: int, n: int, params: Sampling, generator) -> DraftBlock:
        with _interrupts_held():
            self.engine._send("draft", self.rank_handle, state.rank_handle, anchor)
            return super().propose(state, anchor, n, params, generator)

    def verify(self, state: State, ids: list[int]):
        with _interrupts_held():
            self.engine._send("verify", self.rank_handle, state.rank_handle, ids)
            return super().verify(state, ids)

    def settle(self, state: State, r, fed: int) -> None:
        with _interrupts_held():
            self.engine._send("settle", self.rank_handle, state.rank_handle, fed)
            super().settle(state, r, fed)


class _Mirror:
    """A follower's copy of one of rank 0's speculators: its own draft context, kept equal to
    rank 0's by the same calls, and the round it verified last (the settles after it read its taps)."""

    def __init__(self, engine: Engine):
        self.speculator, self.round = Speculator(engine.model, engine), None

    @torch.no_grad()
    def make(self, op: str, state: State, arg) -> None:
        """Rank 0's call ``op`` (one of ``_SPECULATION``) on ``state`` with its choice ``arg``."""
        s = self.speculator
        if op == "sync":
            s.sync(state, arg)
        elif op == "draft":  # the block's model calls; its tokens are rank 0's to draw
            s.drafter.block_logits(s.model, arg, state.length, s.context)
        elif op == "verify":
            self.round = s.verify(state, arg)
        else:
            s.settle(state, self.round, arg)


_SPECULATION = ("sync", "draft", "verify", "settle")


def follow(engine: Engine, world: World) -> None:
    """Rank ``world.rank`` > 0: make rank 0's calls on ``engine`` until it closes."""
    states: dict[int, State] = {}
    mirrors: dict[int, _Mirror] = {}
    device = engine.model.device
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=world.group)
        op, handle, args, dropped = box[0]
        for h in dropped:
            states.pop(h, None)
            mirrors.pop(h, None)
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
        elif op == "speculator":
            mirrors[handle] = _Mirror(engine)
        elif op in _SPECULATION:
            mirrors[handle].make(op, states[args[0]], args[1])
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
