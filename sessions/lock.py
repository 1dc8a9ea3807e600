"""Cross-process exclusive lock on one session.

Owns: `<home>/locks/<name>.lock`, held with `fcntl.flock` while a process works on
a session; the holder's pid is written into the file for the error message. The
kernel releases a flock when its holder dies, so a dead holder's lock is reclaimed
by the next caller without any cleanup. Does not own: database transactions (SQLite
serialises writers itself; this lock keeps two *sessions of work* apart).
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from .errors import SessionInUse

_POLL_S = 0.05


class SessionLock:
    """An acquired lock; call `release()` (the store's `lock()` context does)."""

    def __init__(self, path: Path, name: str, timeout: float):
        self.path = path
        self.name = name
        self._fd: int | None = None
        self._acquire(timeout)

    def _acquire(self, timeout: float) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    pid = _read_pid(fd)
                    os.close(fd)
                    raise SessionInUse(self.name, pid) from None
                time.sleep(_POLL_S)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def _read_pid(fd: int) -> int | None:
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return int(text) if text.isdigit() else None
