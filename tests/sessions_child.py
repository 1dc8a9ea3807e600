"""Subprocess used by tests/test_sessions_process.py: saves turns, holds locks, dies.

Owns: a deterministic writer of save points (turn k appends TURN tokens whose ids
are a function of their position, one message, and KV chunks up to the log's end)
so that a parent can kill it at any moment and check the store afterwards. Not a
test itself. Modes: `save HOME NAME [N]` (N turns, default forever; prints
"saved K" after each commit), `die-in-tx HOME NAME` (one turn that SIGKILLs itself
after the first chunk row is written), `hold HOME NAME SECONDS` (holds the lock).
"""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sessions import KVChunk, SessionNotFound, Store  # noqa: E402
from sessions import store as store_mod  # noqa: E402

FP = "fp-test"
C = 64
TURN = 96
BYTES_PER_TOKEN = 1024
LAYERS = ("layers.2.kv", "layers.2.index")


def token(pos: int) -> int:
    return (pos * 7919) % 129280


def chunks(start: int, end: int) -> list[KVChunk]:
    out = []
    for s in range(start, end, C):
        e = min(s + C, end)
        out.append(KVChunk(s, e, {n: os.urandom((e - s) * BYTES_PER_TOKEN // 2) for n in LAYERS}))
    return out


def resume(store: Store, name: str) -> tuple[int, int]:
    """(tokens in the log, where the next chunk starts) after opening the session."""
    try:
        loaded = store.load(name, fingerprint=FP, chunk_tokens=C)
    except SessionNotFound:
        store.create_session(name, fingerprint=FP)
        return 0, 0
    return len(loaded.tokens), loaded.next_chunk_start


def turn(store: Store, name: str, n0: int, kv_from: int) -> tuple[int, int]:
    """Save turn n0 // TURN; return the new (tokens, next chunk start)."""
    res = store.save_point(
        name, messages=[{"role": "user", "content": f"turn {n0 // TURN}"}],
        new_tokens=[token(p) for p in range(n0, n0 + TURN)],
        kv_chunks=chunks(kv_from, n0 + TURN), fingerprint=FP, chunk_tokens=C)
    return res.n_tokens, res.next_chunk_start


def main() -> None:
    mode, home, name = sys.argv[1:4]
    with Store.open(home, lock_timeout=5.0) as store:
        if mode == "hold":
            with store.lock(name):
                print("locked", flush=True)
                time.sleep(float(sys.argv[4]))
            return
        if mode == "die-in-tx":
            real = store_mod.Store._put_chunk

            def put_then_die(self, *args, **kwargs):
                real(self, *args, **kwargs)
                os.kill(os.getpid(), signal.SIGKILL)
            store_mod.Store._put_chunk = put_then_die
        state = resume(store, name)
        print("ready", flush=True)
        n = int(sys.argv[4]) if len(sys.argv) > 4 else 10**9
        for _ in range(n):
            state = turn(store, name, *state)
            print(f"saved {state[0] // TURN - 1}", flush=True)


if __name__ == "__main__":
    main()
