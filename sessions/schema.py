"""The store's schema as an ordered list of named migrations.

Owns: table definitions, applying the migrations a database lacks, recording them
in `_migrations`, and refusing a database that records migrations we do not know
(written by a newer dsagent). Does not own: reading or writing session data.

Append new migrations at the end; never edit or reorder one that has shipped.
"""

from __future__ import annotations

import time
from typing import Callable

import sqlite_utils

from .errors import SchemaTooNew, StoreReadOnly

MIGRATIONS_TABLE = "_migrations"


def m001_sessions(db: sqlite_utils.Database) -> None:
    db["sessions"].create(
        {
            "id": int, "name": str, "fingerprint": str, "chunk_tokens": int,
            "meta": str, "parent": str, "created_at": float, "updated_at": float,
            "n_tokens": int, "n_messages": int,
        },
        pk="id", not_null={"name", "fingerprint", "meta", "created_at", "updated_at"},
        defaults={"n_tokens": 0, "n_messages": 0, "meta": "{}"},
    )
    db["sessions"].create_index(["name"], unique=True)


def m002_transcript(db: sqlite_utils.Database) -> None:
    db["messages"].create(
        {"session_id": int, "seq": int, "role": str, "body": str, "created_at": float},
        pk=("session_id", "seq"), not_null={"body"},
    )


def m003_token_log(db: sqlite_utils.Database) -> None:
    db["token_segments"].create(
        {"session_id": int, "start": int, "end": int, "ids": bytes},
        pk=("session_id", "start"), not_null={"ids"},
    )
    db["image_spans"].create(
        {"session_id": int, "start": int, "end": int, "sha256": str},
        pk=("session_id", "start"), not_null={"sha256"},
    )


def m004_images(db: sqlite_utils.Database) -> None:
    db["images"].create(
        {"sha256": str, "size": int, "data": bytes, "created_at": float},
        pk="sha256", not_null={"data"},
    )
    db["session_images"].create({"session_id": int, "sha256": str}, pk=("session_id", "sha256"))
    db["session_images"].create_index(["sha256"])


def m005_kv_chunks(db: sqlite_utils.Database) -> None:
    db["kv_chunks"].create(
        {
            "key": str, "layer": str, "start": int, "end": int, "fingerprint": str,
            "format_version": int, "raw_bytes": int, "stored_bytes": int, "blob": bytes,
        },
        pk=("key", "layer"), not_null={"blob"},
    )
    db["session_chunks"].create(
        {"session_id": int, "idx": int, "key": str, "start": int, "end": int, "layers": str},
        pk=("session_id", "idx"), not_null={"key", "layers"},
    )
    db["session_chunks"].create_index(["key"])


def m006_save_points(db: sqlite_utils.Database) -> None:
    # Where each save point left the session (tokens, messages) and whether it closed a
    # turn: verify tells an unfinished turn by it, and repair cuts back to a whole turn.
    # Sessions saved before this migration have no rows; integrity.py infers theirs.
    db["save_points"].create(
        {"session_id": int, "n_tokens": int, "n_messages": int, "closed": int, "created_at": float},
        pk=("session_id", "n_tokens", "n_messages"), not_null={"closed"},
    )


MIGRATIONS: list[Callable[[sqlite_utils.Database], None]] = [
    m001_sessions,
    m002_transcript,
    m003_token_log,
    m004_images,
    m005_kv_chunks,
    m006_save_points,
]


def applied(db: sqlite_utils.Database) -> list[str]:
    if MIGRATIONS_TABLE not in db.table_names():
        return []
    return [r["name"] for r in db.query(f"select name from {MIGRATIONS_TABLE} order by rowid")]


def check_not_newer(db: sqlite_utils.Database, path: str) -> None:
    known = {m.__name__ for m in MIGRATIONS}
    unknown = [n for n in applied(db) if n not in known]
    if unknown:
        raise SchemaTooNew(
            f"{path} was written by a newer dsagent (unknown migrations: {', '.join(unknown)}); "
            "upgrade dsagent, or set DSAGENT_HOME to use another store. The file was not modified."
        )


# Migrations a store opened read-only may lack: the code that reads their tables copes
# without them (a read-only store cannot be migrated).
READ_OPTIONAL = {"m006_save_points"}


def check_readable(db: sqlite_utils.Database, path: str) -> None:
    """A store opened read-only has every table that reading needs."""
    missing = [m.__name__ for m in _missing(db) if m.__name__ not in READ_OPTIONAL]
    if missing:
        raise StoreReadOnly(path, f"bring its tables up to date ({', '.join(missing)})")


def _missing(db: sqlite_utils.Database) -> list[Callable[[sqlite_utils.Database], None]]:
    done = set(applied(db))
    return [m for m in MIGRATIONS if m.__name__ not in done]


def migrate(db: sqlite_utils.Database, path: str) -> list[str]:
    """Apply missing migrations in order, all in one transaction; return their names."""
    check_not_newer(db, path)
    if not _missing(db):
        return []
    db.execute("BEGIN IMMEDIATE")
    try:
        check_not_newer(db, path)  # another process may have migrated meanwhile
        db.execute(f"create table if not exists {MIGRATIONS_TABLE} (name text primary key, applied_at real)")
        todo = _missing(db)
        for m in todo:
            m(db)
            db.execute(f"insert into {MIGRATIONS_TABLE} values (?, ?)", [m.__name__, time.time()])
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    return [m.__name__ for m in todo]
