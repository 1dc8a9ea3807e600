"""The session store: one SQLite file (WAL) holding transcripts, token logs, images
and the global-KV chunks derived from them.

Owns: opening the file (and refusing one that is not SQLite or is too new; opening one
this process may not write read-only), the session rows, the save point (one transaction
per turn), loading a session with the longest prefix of KV chunks that passes every
check, finding the chunks any session stored for a new session's leading tokens (and
linking them into its chain rather than writing them again), and turning SQLite's and
the file system's errors into typed `StoreError`s that name the file (disk full,
read-only, busy, damaged). Does not own: what the messages, tokens or KV bytes mean
(`dsagent` and `model` decide), recomputing KV (the engine prefills what we could not
return), or printing anything.

Management (fork, rm, prune, verify, gc, storage, export) lives in `manage.py`;
the methods here only delegate to it, so that callers see one object.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import platformdirs
import sqlite_utils

from . import export as _export
from . import integrity
from . import manage
from . import schema
from .blob import (
    DEFAULT_ZSTD_LEVEL, FORMAT_VERSION, ROOT_KEY, ImageSpan, KVChunk, chunk_key,
    decode_blob, encode_blob, tokens_from_bytes, tokens_to_bytes,
)
from .errors import (
    BlobError, NotADatabase, SessionDamaged, SessionExists, SessionNotFound, StoreError, StoreFull, StoreReadOnly,
)
from .lock import SessionLock
from .names import check_name

DB_NAME = "sessions.db"
_SQLITE_MAGIC = b"SQLite format 3\x00"


def default_home() -> Path:
    """`$DSAGENT_HOME` if set, else the platform's user data directory."""
    env = os.environ.get("DSAGENT_HOME")
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_data_dir("dsagent", appauthor=False))


@dataclass(frozen=True)
class SessionInfo:
    name: str
    fingerprint: str
    chunk_tokens: int | None
    meta: dict[str, Any]
    parent: str | None
    created_at: float
    updated_at: float
    n_tokens: int
    n_messages: int


@dataclass
class Loaded:
    """A session as `load` returns it: everything needed to resume."""

    session: SessionInfo
    messages: list[dict]
    tokens: list[int]
    image_spans: list[ImageSpan]
    kv: list[KVChunk]  # longest valid prefix, payloads decoded
    kv_tokens: int  # tokens [0, kv_tokens) have KV in `kv`
    warnings: list[str]
    chunk_tokens: int

    @property
    def next_chunk_start(self) -> int:
        """Where the first chunk of the next save point must start."""
        return self.kv_tokens - self.kv_tokens % self.chunk_tokens


@dataclass
class Prefix:
    """Stored KV chunks that match the start of a new session's tokens (`Store.prefix_chunks`),
    made by whichever sessions stored them; resumed from as a `Loaded` is."""

    kv: list[KVChunk]  # whole chunks from token 0, payloads decoded
    kv_tokens: int
    warnings: list[str]  # a matching chunk that failed a check, where the prefix stops
    chunk_tokens: int

    @property
    def next_chunk_start(self) -> int:
        return self.kv_tokens


@dataclass(frozen=True)
class SaveResult:
    n_tokens: int
    n_messages: int
    kv_tokens: int
    next_chunk_start: int
    chunks_written: int
    kv_bytes_written: int


def _info(row: dict) -> SessionInfo:
    # damaged settings must not make the session (or a listing of all of them) unreadable
    return SessionInfo(
        name=row["name"], fingerprint=row["fingerprint"], chunk_tokens=row["chunk_tokens"],
        meta=integrity.parse_meta(row["meta"]) or {}, parent=row["parent"], created_at=row["created_at"],
        updated_at=row["updated_at"], n_tokens=row["n_tokens"], n_messages=row["n_messages"],
    )


def _check_is_sqlite(path: Path) -> None:
    if not path.exists() or path.stat().st_size == 0:
        return
    try:
        with open(path, "rb") as f:
            head = f.read(len(_SQLITE_MAGIC))
    except OSError as exc:
        raise StoreError(f"cannot read the store {path}: {exc.strerror or exc}; check its permissions, "
                         "or set DSAGENT_HOME to another directory") from None
    if head != _SQLITE_MAGIC:
        raise NotADatabase(
            f"{path} is not an SQLite database; move it away, or set DSAGENT_HOME "
            "to another directory"
        )


# SQLite's primary result codes (the low byte of an extended code)
_SQLITE_BUSY, _SQLITE_READONLY, _SQLITE_CORRUPT, _SQLITE_FULL, _SQLITE_NOTADB = 5, 8, 11, 13, 26


def store_error(path: Path, exc: BaseException) -> BaseException:
    """The typed error for a failure of SQLite or the file system on the store at ``path``."""
    if isinstance(exc, StoreError) or not isinstance(exc, (sqlite3.Error, OSError)):
        return exc
    code = (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF
    text = str(exc).lower()
    err = exc.errno if isinstance(exc, OSError) else None
    if err == errno.ENOSPC or code == _SQLITE_FULL or "disk is full" in text:
        return StoreFull(path)
    if err in (errno.EROFS, errno.EACCES, errno.EPERM) or code == _SQLITE_READONLY or "readonly database" in text:
        return StoreReadOnly(path)
    if code == _SQLITE_BUSY or "database is locked" in text:
        return StoreError(f"the store {path} is busy: another process held its write lock for too long; retry")
    if code in (_SQLITE_CORRUPT, _SQLITE_NOTADB) or "not a database" in text or "malformed" in text:
        return NotADatabase(f"{path} cannot be read as an SQLite database ({exc}); move it away, "
                            "or set DSAGENT_HOME to another directory")
    if isinstance(exc, OSError):
        return StoreError(f"cannot use the store {path}: {exc.strerror or exc}")
    return StoreError(f"the store {path} failed: {exc}")


def _writable(path: Path) -> bool:
    """Whether this process may write the store: its file and the folder that holds it
    (SQLite keeps the -wal and -shm files beside it; the session locks live there too)."""
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent  # where creating the store's folder would start
    if path.exists():
        return os.access(path, os.W_OK) and os.access(path.parent, os.W_OK | os.X_OK)
    return os.access(folder, os.W_OK | os.X_OK)


def spans_in(spans: Sequence[ImageSpan], start: int, end: int) -> list[ImageSpan]:
    """Image spans overlapping tokens [start, end)."""
    return [s for s in spans if s.start < end and s.end > start]


class Store:
    """An open session store. Create with `Store.open()`."""

    def __init__(
        self, path: Path, *, zstd_level: int = DEFAULT_ZSTD_LEVEL,
        lock_timeout: float = 0.0, busy_timeout_s: float = 30.0,
    ):
        self.path = path
        self.zstd_level = zstd_level
        self.lock_timeout = lock_timeout
        self._held: dict[str, SessionLock] = {}
        if path.is_dir():
            raise NotADatabase(f"{path} is a directory, not the session store; move it away, "
                               "or set DSAGENT_HOME to another directory")
        _check_is_sqlite(path)
        self.read_only = not _writable(path)
        if self.read_only and not path.exists():
            raise StoreReadOnly(path, "create it")
        try:
            if not self.read_only:
                path.parent.mkdir(parents=True, exist_ok=True)
            self.conn = self._connect(busy_timeout_s)
        except (sqlite3.Error, OSError) as exc:
            raise store_error(path, exc) from None
        try:
            self.db = sqlite_utils.Database(self.conn)
            schema.check_not_newer(self.db, str(path))  # before anything could write
            if self.read_only:
                schema.check_readable(self.db, str(path))
            else:
                self._configure()
                schema.migrate(self.db, str(path))
        except (sqlite3.Error, OSError) as exc:
            self.conn.close()
            raise store_error(path, exc) from None
        except BaseException:
            self.conn.close()
            raise

    def _connect(self, busy_timeout_s: float) -> sqlite3.Connection:
        conn = self._connect_mode(busy_timeout_s)
        # A damaged text cell (a name, settings) reads as U+FFFD instead of failing the whole
        # query, and with it every other session; message bodies are read as bytes and checked.
        conn.text_factory = lambda b: b.decode("utf-8", "replace")
        return conn

    def _connect_mode(self, busy_timeout_s: float) -> sqlite3.Connection:
        if not self.read_only:
            return sqlite3.connect(self.path, isolation_level=None, timeout=busy_timeout_s)
        uri = self.path.resolve().as_uri()
        conn = sqlite3.connect(f"{uri}?mode=ro", uri=True, isolation_level=None, timeout=busy_timeout_s)
        try:
            conn.execute("select count(*) from sqlite_master").fetchone()
            return conn
        except sqlite3.OperationalError:
            # A WAL database needs its -shm file, which a read-only folder cannot hold.
            # Without a -wal file every commit is in the main file, so reading it as
            # immutable is exact; with one, the error above stands.
            conn.close()
            if Path(f"{self.path}-wal").exists():
                raise
            return sqlite3.connect(f"{uri}?immutable=1", uri=True, isolation_level=None)

    @classmethod
    def open(cls, path_or_home: str | Path | None = None, **kwargs: Any) -> "Store":
        """Open (creating if needed) `<home>/sessions.db`, or a `.db` file given directly."""
        p = Path(path_or_home).expanduser() if path_or_home is not None else default_home()
        if not (p.suffix == ".db" or p.is_file()):
            p = p / DB_NAME
        return cls(p, **kwargs)

    def _configure(self) -> None:
        # auto_vacuum only takes effect before the first table exists; it lets gc
        # hand freed pages back to the file system.
        self.conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
        self.conn.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL: a killed process never loses a commit; a power cut may lose
        # the last turn but never corrupts the file.
        self.conn.execute("PRAGMA synchronous=NORMAL")

    def close(self) -> None:
        for lk in list(self._held.values()):
            lk.release()
        self._held.clear()
        self.conn.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def home(self) -> Path:
        return self.path.parent

    # -- transactions and locks ------------------------------------------------

    @contextlib.contextmanager
    def _tx(self, mode: str = "IMMEDIATE") -> Iterator[None]:
        """One transaction; joins the caller's when one is already open. Whatever fails
        inside rolls all of it back; SQLite's and the OS's errors leave as StoreErrors."""
        if self.conn.in_transaction:
            yield
            return
        if mode == "IMMEDIATE" and self.read_only:
            raise StoreReadOnly(self.path)
        try:
            self.conn.execute(f"BEGIN {mode}")
            try:
                yield
                self.conn.execute("COMMIT")
            except BaseException:
                # SQLite may have rolled back already (a full disk does), so ask first
                if self.conn.in_transaction:
                    self.conn.execute("ROLLBACK")
                raise
        except (sqlite3.Error, OSError) as exc:
            raise store_error(self.path, exc) from exc

    def _read(self) -> contextlib.AbstractContextManager[None]:
        """A read transaction: one consistent snapshot across several queries."""
        return self._tx("DEFERRED")

    @contextlib.contextmanager
    def lock(self, name: str, timeout: float = 0.0) -> Iterator[None]:
        """Hold the session's cross-process lock; raises SessionInUse after `timeout` s."""
        check_name(name)
        if name in self._held:
            yield
            return
        if self.read_only:  # a lock is taken to change a session, and its file could not be made
            raise StoreReadOnly(self.path, f"change session '{name}'")
        path = self.home / "locks" / f"{name}.lock"
        try:
            self._held[name] = SessionLock(path, name, timeout)
        except OSError as exc:
            raise store_error(path.parent, exc) from None
        try:
            yield
        finally:
            self._held.pop(name).release()

    def _locked(self, name: str) -> contextlib.AbstractContextManager[None]:
        return self.lock(name, self.lock_timeout)

    # -- sessions --------------------------------------------------------------

    def _row(self, name: str) -> dict:
        rows = list(self.db.query("select * from sessions where name = ?", [name]))
        if not rows:
            raise SessionNotFound(name)
        return rows[0]

    def create_session(self, name: str, *, fingerprint: str, meta: dict | None = None) -> SessionInfo:
        check_name(name)
        now = time.time()
        with self._tx():
            if list(self.db.query("select 1 from sessions where name = ?", [name])):
                raise SessionExists(name)
            self.conn.execute(
                "insert into sessions (name, fingerprint, meta, created_at, updated_at,"
                " n_tokens, n_messages) values (?, ?, ?, ?, ?, 0, 0)",
                [name, fingerprint, json.dumps(meta or {}), now, now],
            )
        return self.get_session(name)

    def get_session(self, name: str) -> SessionInfo:
        with self._read():
            return _info(self._row(name))

    def latest_session(self) -> SessionInfo | None:
        with self._read():
            rows = list(self.db.query("select * from sessions order by updated_at desc limit 1"))
        return _info(rows[0]) if rows else None

    def list_sessions(self) -> list[SessionInfo]:
        with self._read():
            return [_info(r) for r in self.db.query("select * from sessions order by updated_at desc")]

    def messages(self, name: str) -> list[dict]:
        """The transcript of a session, oldest first; a row that does not read back is a
        SessionDamaged naming it (other sessions are unaffected)."""
        with self._read():
            sid = self._row(name)["id"]
            out = []
            for seq, body in self.conn.execute(
                    "select seq, cast(body as blob) from messages where session_id = ? order by seq", [sid]):
                if seq != len(out):
                    raise SessionDamaged(name, f"message row {len(out)} is missing")
                try:
                    out.append(integrity.parse_body(body))
                except ValueError as e:
                    raise SessionDamaged(name, f"message row {seq} {e}") from None
            return out

    def image(self, sha256: str) -> bytes:
        """The bytes of a stored image; verified against its hash."""
        with self._read():
            rows = list(self.db.query("select data from images where sha256 = ?", [sha256]))
        if not rows:
            raise StoreError(f"image {sha256[:12]}… is not in the store")
        data = bytes(rows[0]["data"])
        if hashlib.sha256(data).hexdigest() != sha256:
            raise StoreError(f"image {sha256[:12]}… is damaged (hash mismatch)")
        return data

    # -- save point ------------------------------------------------------------

    def save_point(
        self, name: str, *, messages: Sequence[dict] = (), new_tokens: Sequence[int] = (),
        image_spans: Sequence[ImageSpan] = (), images: dict[str, bytes] | None = None,
        kv_chunks: Sequence[KVChunk] = (), fingerprint: str, chunk_tokens: int, closed: bool = True,
        shared_tokens: int = 0,
    ) -> SaveResult:
        """Append one turn (messages, tokens, images, KV chunks) in ONE transaction.

        `closed`: the session now ends at a finished turn (False: it ends where the next
        save continues it, e.g. at a prompt not yet answered); `verify` reports a session
        whose last save was not closed. `kv_chunks` must start at a chunk boundary no
        later than the previous save's `next_chunk_start` (earlier rewrites the chain from
        there), be contiguous, all of `chunk_tokens` tokens but the last, and end within
        the token log.

        `shared_tokens`: tokens [0, shared_tokens) of a session with no KV yet have whole
        chunks already in the store under the keys its own tokens give (`prefix_chunks`
        found them): they are linked into its chain, not written again, and `kv_chunks`
        go on from there.
        """
        if shared_tokens % chunk_tokens:
            raise ValueError(f"shared_tokens ({shared_tokens}) must be whole chunks of {chunk_tokens}")
        images = dict(images or {})
        _check_images(images)
        encoded = [self._encode(ch) for ch in kv_chunks]  # compress outside the write lock
        with self._locked(name), self._tx():
            row = self._row(name)
            sid, n0 = row["id"], row["n_tokens"]
            n1 = n0 + len(new_tokens)
            self._append_messages(sid, row["n_messages"], messages)
            self._append_tokens(sid, n0, new_tokens)
            self._add_images(sid, images, image_spans, n1)
            kv_tokens, written = self._write_kv(row, n1, encoded, fingerprint, chunk_tokens, shared_tokens)
            n_messages = row["n_messages"] + len(messages)
            self.conn.execute(
                "update sessions set n_tokens = ?, n_messages = ?, updated_at = ?,"
                " fingerprint = ?, chunk_tokens = ? where id = ?",
                [n1, n_messages, time.time(), fingerprint, chunk_tokens, sid],
            )
            self.conn.execute("insert or replace into save_points values (?, ?, ?, ?, ?)",
                              [sid, n1, n_messages, int(closed), time.time()])
        return SaveResult(n1, n_messages, kv_tokens, kv_tokens - kv_tokens % chunk_tokens,
                          len(kv_chunks), written)

    def _encode(self, ch: KVChunk) -> tuple[KVChunk, dict[str, bytes]]:
        blobs = {layer: encode_blob(layer, ch.start, ch.end, payload, self.zstd_level)
                 for layer, payload in sorted(ch.blobs.items())}
        return ch, blobs

    def _append_messages(self, sid: int, seq0: int, messages: Sequence[dict]) -> None:
        now = time.time()
        rows = [(sid, seq0 + i, str(m.get("role", "")), json.dumps(m), now)
                for i, m in enumerate(messages)]
        self.conn.executemany("insert into messages values (?, ?, ?, ?, ?)", rows)

    def _append_tokens(self, sid: int, start: int, tokens: Sequence[int]) -> None:
        if not tokens:
            return
        try:
            ids = tokens_to_bytes(tokens)
        except (OverflowError, TypeError):
            raise ValueError("token ids must be integers in [0, 2**32)") from None
        self.conn.execute("insert into token_segments values (?, ?, ?, ?)",
                          [sid, start, start + len(tokens), ids])

    def _add_images(self, sid: int, images: dict[str, bytes], spans: Sequence[ImageSpan], n_tokens: int) -> None:
        now = time.time()
        for sha, data in images.items():
            self.conn.execute("insert or ignore into images values (?, ?, ?, ?)", [sha, len(data), data, now])
            self.conn.execute("insert or ignore into session_images values (?, ?)", [sid, sha])
        known = {r["sha256"] for r in self.db.query("select sha256 from session_images where session_id = ?", [sid])}
        for s in spans:
            if not (0 <= s.start < s.end <= n_tokens) or s.sha256 not in known:
                raise ValueError(f"image span {s} is outside the token log or names an image not handed in")
            self.conn.execute("insert into image_spans values (?, ?, ?, ?)", [sid, s.start, s.end, s.sha256])

    # -- KV chain --------------------------------------------------------------

    def _chain(self, sid: int) -> list[dict]:
        return list(self.db.query("select * from session_chunks where session_id = ? order by idx", [sid]))

    def _tokens_from(self, sid: int, start: int) -> list[int]:
        """The token log from `start` on; a gap or a damaged segment is a SessionDamaged."""
        segs = list(self.db.query("select * from token_segments where session_id = ? and end > ?"
                                  " order by start", [sid, start]))
        out: list[int] = []
        pos = segs[0]["start"] if segs else start
        if pos > start:
            raise SessionDamaged(self._name_of(sid), f"the token log has a gap at token {start}")
        base = pos
        for seg in segs:
            if seg["start"] != pos:
                raise SessionDamaged(self._name_of(sid), f"the token log has a gap at token {pos}")
            ids = seg["ids"]
            if not isinstance(ids, bytes) or len(ids) != 4 * (seg["end"] - seg["start"]):
                raise SessionDamaged(self._name_of(sid), f"token log segment row {seg['start']}-{seg['end']} "
                                     "is damaged")
            out.extend(tokens_from_bytes(ids))
            pos = seg["end"]
        return out[start - base :]

    def _name_of(self, sid: int) -> str:
        rows = self.conn.execute("select name from sessions where id = ?", [sid]).fetchall()
        return rows[0][0] if rows else f"#{sid}"

    def _spans(self, sid: int) -> list[ImageSpan]:
        rows = self.db.query("select start, end, sha256 from image_spans where session_id = ? order by start", [sid])
        return [ImageSpan(r["start"], r["end"], r["sha256"]) for r in rows]

    def _truncate_chain(self, sid: int, chain: list[dict], start: int) -> None:
        keys = [c["key"] for c in chain if c["start"] >= start]
        self.conn.execute("delete from session_chunks where session_id = ? and start >= ?", [sid, start])
        for key in keys:
            self.conn.execute("delete from kv_chunks where key = ? and not exists"
                              " (select 1 from session_chunks where key = ?)", [key, key])

    def _write_kv(self, row: dict, n_tokens: int, encoded: list, fingerprint: str, C: int,
                  shared: int = 0) -> tuple[int, int]:
        sid, chain = row["id"], self._chain(row["id"])
        if row["fingerprint"] != fingerprint or row["chunk_tokens"] not in (None, C):
            self._truncate_chain(sid, chain, 0)
            chain = []
        if shared and not chain:
            chain = self._link_shared(sid, min(shared, n_tokens), fingerprint, C)
            if encoded and encoded[0][0].start > (chain[-1]["end"] if chain else 0):
                encoded = []  # a shared chunk was collected since it was found: keep the chain there is
        if not encoded:
            return (chain[-1]["end"] if chain else 0), 0
        first = encoded[0][0].start
        keep = [c for c in chain if c["end"] <= first]
        _validate_chunks([e[0] for e in encoded], chain, keep, C, n_tokens)
        self._truncate_chain(sid, chain, first)
        parent = keep[-1]["key"] if keep else ROOT_KEY
        tokens, spans = self._tokens_from(sid, first), self._spans(sid)
        written = 0
        for ch, blobs in encoded:
            key = chunk_key(parent, ch.start, tokens[ch.start - first : ch.end - first],
                            spans_in(spans, ch.start, ch.end), fingerprint)
            written += self._put_chunk(sid, ch.start // C, key, ch, blobs, fingerprint)
            parent = key
        return encoded[-1][0].end, written

    def _link_shared(self, sid: int, n: int, fingerprint: str, C: int) -> list[dict]:
        """Link the stored chunks of tokens [0, n) into the session's empty chain, up to the
        first one no longer stored; return the chain."""
        tokens, spans, parent = self._tokens_from(sid, 0)[:n], self._spans(sid), ROOT_KEY
        for start in range(0, n - n % C, C):
            key = chunk_key(parent, start, tokens[start:start + C], spans_in(spans, start, start + C), fingerprint)
            layers = self._linked_layers(key)
            stored = {r[0] for r in self.conn.execute("select layer from kv_chunks where key = ?", [key])}
            if layers is None or not set(layers) <= stored:
                break
            self.conn.execute("insert into session_chunks values (?, ?, ?, ?, ?, ?)",
                              [sid, start // C, key, start, start + C, json.dumps(layers)])
            parent = key
        return self._chain(sid)

    def _linked_layers(self, key: str) -> list[str] | None:
        """The layers of chunk ``key`` as a session that links it lists them; None when no
        session does (rows no session links wait for gc and are not reused)."""
        row = self.conn.execute("select layers from session_chunks where key = ? limit 1", [key]).fetchone()
        try:
            layers = json.loads(row[0]) if row else None
        except ValueError:
            return None
        return layers if isinstance(layers, list) and layers else None

    def _put_chunk(self, sid: int, idx: int, key: str, ch: KVChunk, blobs: dict[str, bytes], fingerprint: str) -> int:
        for layer, blob in blobs.items():
            self.conn.execute(
                "insert or replace into kv_chunks values (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [key, layer, ch.start, ch.end, fingerprint, FORMAT_VERSION,
                 len(ch.blobs[layer]), len(blob), blob],
            )
        self.conn.execute("insert into session_chunks values (?, ?, ?, ?, ?, ?)",
                          [sid, idx, key, ch.start, ch.end, json.dumps(sorted(blobs))])
        return sum(len(b) for b in blobs.values())

    # -- load ------------------------------------------------------------------

    def load(self, name: str, *, fingerprint: str, chunk_tokens: int) -> Loaded:
        """Transcript, token log and the longest prefix of KV chunks that passes every check."""
        with self._read():
            row = self._row(name)
            info, sid = _info(row), row["id"]
            messages = self.messages(name)
            tokens, spans = self._tokens_from(sid, 0), self._spans(sid)
            refusal = _kv_refusal(info, fingerprint, chunk_tokens)
            kv, problems = ([], [refusal]) if refusal else self.check_chain(sid, tokens, spans, fingerprint, chunk_tokens)
        kv_tokens = kv[-1].end if kv else 0
        warnings = [f"session '{name}': {p}; dropping its KV from token {kv_tokens} on, "
                    f"it will be rebuilt by prefilling the token log" for p in problems]
        return Loaded(info, messages, tokens, spans, kv, kv_tokens, warnings, chunk_tokens)

    def check_chain(
        self, sid: int, tokens: list[int], spans: list[ImageSpan], fingerprint: str,
        C: int, *, stop_first: bool = True,
    ) -> tuple[list[KVChunk], list[str]]:
        """Walk a session's chunk chain; return the valid prefix and the problems found."""
        good: list[KVChunk] = []
        problems: list[str] = []
        parent = ROOT_KEY
        chain = self._chain(sid)
        for i, link in enumerate(chain):
            try:
                chunk = self._check_link(i, link, i == len(chain) - 1, parent, tokens, spans, fingerprint, C)
                if not problems:
                    good.append(chunk)
            except BlobError as exc:
                problems.append(f"KV chunk {i} (tokens {link['start']}-{link['end']}) {exc}")
                if stop_first:
                    break
            parent = link["key"]
        return good, problems

    def _check_link(self, i: int, link: dict, last: bool, parent: str, tokens: list[int],
                    spans: list[ImageSpan], fingerprint: str, C: int) -> KVChunk:
        start, end = link["start"], link["end"]
        if start != i * C or not (0 < end - start <= C) or (end - start < C and not last) or end > len(tokens):
            raise BlobError("is not where the chain expects it (a chunk is missing)")
        key = chunk_key(parent, start, tokens[start:end], spans_in(spans, start, end), fingerprint)
        if key != link["key"]:
            raise BlobError("does not match the token log or model (chain hash differs)")
        return self._read_chunk(key, json.loads(link["layers"]), start, end, fingerprint)

    def _read_chunk(self, key: str, layers: list[str], start: int, end: int, fingerprint: str) -> KVChunk:
        """The decoded blobs of chunk ``key``; a BlobError when any layer is missing or fails a check."""
        rows = {r["layer"]: r for r in self.db.query("select * from kv_chunks where key = ?", [key])}
        missing = sorted(set(layers) - rows.keys())
        if missing:
            raise BlobError(f"is missing layer(s) {', '.join(missing)}")
        blobs = {}
        for layer in layers:
            if rows[layer]["fingerprint"] != fingerprint:
                raise BlobError(f"layer {layer} was made by another model")
            blobs[layer] = decode_blob(rows[layer]["blob"], layer=layer, start=start, end=end)
        return KVChunk(start, end, blobs)

    def prefix_chunks(self, tokens: Sequence[int], spans: Sequence[ImageSpan], *, fingerprint: str,
                      chunk_tokens: int) -> Prefix:
        """The longest chain of stored chunks, whichever sessions stored them, whose keys are
        the ones ``tokens`` (with the image ``spans`` among them) give from the root, as a
        save would compute them: whole chunks only, none reaching the last token (a prefill
        must be left to give the next logits); it stops at the first key not stored, and at
        the first chunk that fails a check (with a warning)."""
        C, good, warnings, parent = chunk_tokens, [], [], ROOT_KEY
        with self._read():
            for start in range(0, len(tokens) - C, C):
                key = chunk_key(parent, start, tokens[start:start + C], spans_in(spans, start, start + C), fingerprint)
                layers = self._linked_layers(key)
                if layers is None:
                    break
                try:
                    good.append(self._read_chunk(key, layers, start, start + C, fingerprint))
                except BlobError as exc:
                    warnings.append(f"stored KV chunk {key[:12]}… (tokens {start}-{start + C}) {exc}; "
                                    f"not reused, prefilling from token {start}")
                    break
                parent = key
        return Prefix(good, good[-1].end if good else 0, warnings, C)

    # -- management (see manage.py) --------------------------------------------

    def fork(self, src: str, dst: str) -> SessionInfo:
        return manage.fork(self, src, dst)

    def rm(self, name: str) -> None:
        manage.rm(self, name)

    def prune(self, older_than_days: float, dry_run: bool = False) -> manage.PruneResult:
        return manage.prune(self, older_than_days, dry_run)

    def verify(self, name: str | None = None) -> list[manage.VerifyResult]:
        return manage.verify(self, name)

    def repair(self, name: str, dry_run: bool = False) -> integrity.RepairPlan:
        return manage.repair(self, name, dry_run)

    def gc(self, dry_run: bool = False) -> manage.GcResult:
        return manage.gc(self, dry_run)

    def storage(self) -> manage.StorageReport:
        return manage.storage(self)

    def export(self, name: str, fmt: str = "markdown") -> str:
        return _export.export(self, name, fmt)


def _check_images(images: dict[str, bytes]) -> None:
    for sha, data in images.items():
        if hashlib.sha256(data).hexdigest() != sha:
            raise ValueError(f"image {sha[:12]}... does not hash to its key (sha256 of the bytes)")


def _kv_refusal(info: SessionInfo, fingerprint: str, C: int) -> str | None:
    if info.fingerprint != fingerprint:
        return f"KV was made by another model (fingerprint {info.fingerprint[:12]}..., now {fingerprint[:12]}...)"
    if info.chunk_tokens not in (None, C):
        return f"KV was stored in chunks of {info.chunk_tokens} tokens, now {C}"
    return None


def _validate_chunks(chunks: list[KVChunk], chain: list[dict], keep: list[dict], C: int, n_tokens: int) -> None:
    if C <= 0:
        raise ValueError("chunk_tokens must be positive")
    complete_end = sum(1 for c in chain if c["end"] - c["start"] == C) * C
    if chunks[0].start % C or chunks[0].start > complete_end:
        raise ValueError(f"first KV chunk starts at {chunks[0].start}; it must be a multiple of "
                         f"{C} no later than {complete_end}")
    layers = set(chunks[0].blobs) if not keep else set(json.loads(keep[-1]["layers"]))
    for i, ch in enumerate(chunks):
        size_ok = ch.end - ch.start == C or (i == len(chunks) - 1 and 0 < ch.end - ch.start < C)
        if not size_ok or (i and ch.start != chunks[i - 1].end) or ch.end > n_tokens:
            raise ValueError(f"KV chunk {ch.start}-{ch.end} is not contiguous, not {C} tokens, "
                             f"or beyond the token log ({n_tokens})")
        if not ch.blobs or set(ch.blobs) != layers:
            raise ValueError(f"KV chunk {ch.start}-{ch.end} has layers {sorted(ch.blobs)}, expected {sorted(layers)}")
