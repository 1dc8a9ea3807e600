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


class StoreReadOnly(StoreError):
    """The store's file or folder cannot be written; reading commands still work."""

    def __init__(self, path: object, doing: str = "write to it"):
        super().__init__(
            f"the store is read-only: {path}; cannot {doing}. Make the file and its folder writable, "
            "or set DSAGENT_HOME to a writable directory (list, show, export and verify still work)"
        )
        self.path = path


class StoreFull(StoreError):
    """The device holding the store ran out of space during a write; nothing of it was kept."""

    def __init__(self, path: object):
        super().__init__(
            f"no space left on the device holding the store ({path}); nothing of this save was "
            "written and the previous turn is intact: free some space and retry"
        )
        self.path = path


class SessionDamaged(StoreError):
    """A session's own rows (a message body, its token log) cannot be read back."""

    def __init__(self, name: str, what: str):
        super().__init__(
            f"session '{name}': {what}; `dsagent sessions verify {name}` shows the damage and "
            f"`dsagent sessions verify {name} --repair` cuts the session back to its last whole turn"
        )
        self.name = name
