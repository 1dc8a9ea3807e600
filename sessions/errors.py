"""Typed errors of the session store.

Owns: the exception classes the store raises, each with a message that says what
to do. Does not own: turning them into exit codes (the CLI in `dsagent` does that).
"""


class StoreError(Exception):
    """Base class of every error the session store raises on purpose."""


class NotADatabase(StoreError):
    """The store file exists but is not an SQLite database."""


class SchemaTooNew(StoreError):
    """The database was written by a newer dsagent with migrations we do not know."""


class SessionInUse(StoreError):
    """Another process holds the session's lock."""

    def __init__(self, name: str, pid: int | None):
        holder = f"process {pid}" if pid else "another process"
        super().__init__(
            f"session '{name}' is in use by {holder}; close it there, or wait and retry"
        )
        self.name = name
        self.pid = pid


class SessionNotFound(StoreError):
    """No session of that name exists."""

    def __init__(self, name: str):
        super().__init__(f"no session named '{name}' (see `dsagent sessions list`)")
        self.name = name


class SessionExists(StoreError):
    """A session of that name already exists."""

    def __init__(self, name: str):
        super().__init__(f"a session named '{name}' already exists; pick another name")
        self.name = name


class BlobError(StoreError):
    """A stored KV blob failed a check (header, size, zstd frame or checksum)."""
