"""The RAM pool for local (sliding-window) state, and the resume decision it drives.

Owns: keeping opaque local-state objects (SWA rings, compressor pending tokens,
engram history, draft rings — whatever the engine hands in) for a few minutes, keyed
by session, with a byte cap and least-recently-used eviction; and `plan_resume`,
which says whether a resume continues exactly (pool hit) or replays the last
`window` tokens (miss). Does not own: the objects (never copied, never serialised)
nor the replay itself (the engine runs it).

An entry records the token position its state belongs to; a lookup at another
position is a miss, so a state can never be resumed at the wrong place.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class _Entry:
    obj: Any
    nbytes: int
    position: int | None
    expires: float


class LocalStatePool:
    """Local state by session: expires `ttl_s` seconds after its last put or hit."""

    def __init__(self, ttl_s: float, max_bytes: int, clock: Callable[[], float] = time.monotonic):
        if ttl_s <= 0 or max_bytes <= 0:
            raise ValueError("ttl_s and max_bytes must be positive")
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0
        self._stats = {"hits": 0, "misses": 0, "evictions": 0, "expirations": 0, "rejected": 0}

    def put(self, key: str, obj: Any, nbytes: int, *, position: int | None = None) -> bool:
        """Keep `obj` (about `nbytes` in RAM); False when it alone exceeds the cap."""
        self.pop(key)
        if nbytes > self.max_bytes:
            self._stats["rejected"] += 1
            return False
        self._expire()
        self._entries[key] = _Entry(obj, nbytes, position, self._clock() + self.ttl_s)
        self._bytes += nbytes
        while self._bytes > self.max_bytes:
            self._drop(next(iter(self._entries)), "evictions")
        return True

    def get(self, key: str, *, position: int | None = None) -> Any | None:
        """The object for `key` if alive (and at `position`, when given), else None."""
        self._expire()
        entry = self._entries.get(key)
        if entry is None or (position is not None and entry.position != position):
            self._stats["misses"] += 1
            return None
        self._entries.move_to_end(key)
        entry.expires = self._clock() + self.ttl_s
        self._stats["hits"] += 1
        return entry.obj

    def pop(self, key: str) -> Any | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self._bytes -= entry.nbytes
        return entry.obj

    def _drop(self, key: str, reason: str) -> None:
        self.pop(key)
        self._stats[reason] += 1

    def _expire(self) -> None:
        now = self._clock()
        for key in [k for k, e in self._entries.items() if e.expires <= now]:
            self._drop(key, "expirations")

    def stats(self) -> dict[str, int]:
        self._expire()
        return {**self._stats, "entries": len(self._entries), "bytes": self._bytes,
                "max_bytes": self.max_bytes}


@dataclass(frozen=True)
class ResumePlan:
    """What the engine does to resume: use `local_state`, or replay then prefill."""

    local_state: Any | None  # pool hit: continue exactly from kv_tokens
    replay_from: int | None  # miss: replay tokens [replay_from, kv_tokens) to rebuild SWA
    kv_tokens: int  # global KV covers [0, kv_tokens)
    prefill_from: int  # then prefill tokens [prefill_from, n_tokens)


def plan_resume(pool: LocalStatePool, key: str, kv_tokens: int, window: int) -> ResumePlan:
    state = pool.get(key, position=kv_tokens) if kv_tokens else None
    if state is not None:
        return ResumePlan(state, None, kv_tokens, kv_tokens)
    return ResumePlan(None, max(0, kv_tokens - window), kv_tokens, kv_tokens)
