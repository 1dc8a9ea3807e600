"""Management of the session store: fork, rm, prune, verify (and repair), gc and storage figures.

Owns: the operations behind `dsagent sessions ...` that are not save or load, and
the small result records they return (plain dataclasses, JSON-ready through
`dataclasses.asdict`). Does not own: printing, confirmation prompts or exit codes
(the CLI), the chain checks themselves (`Store.check_chain`), nor what makes a
session's messages and token log whole (`integrity.py`).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from . import integrity
from .errors import SessionExists, SessionInUse, StoreError
from .integrity import RepairPlan
from .names import check_name

if TYPE_CHECKING:
    from .store import SessionInfo, Store

# Tables keyed by session_id, copied by fork and cleared by rm.
SESSION_TABLES = ("messages", "token_segments", "image_spans", "session_images", "session_chunks", "save_points")


@dataclass(frozen=True)
class PruneResult:
    removed: list[str]
    in_use: list[str]
    dry_run: bool


@dataclass(frozen=True)
class GcResult:
    kv_rows: int
    kv_bytes: int
    images: int
    image_bytes: int
    file_bytes_before: int
    file_bytes_after: int
    dry_run: bool


@dataclass
class VerifyResult:
    name: str
    chunks: int
    bad_chunks: int
    problems: list[str] = field(default_factory=list)
    repair: RepairPlan | None = None  # what `verify --repair` would do; None: nothing it can mend

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class SessionStorage:
    name: str
    n_tokens: int
    kv_tokens: int
    kv_bytes: int  # stored (header + zstd frame), counting chunks shared with forks
    kv_raw_bytes: int  # payload bytes as handed in
    kv_bytes_per_token: float
    transcript_bytes: int
    token_log_bytes: int
    image_bytes: int


@dataclass(frozen=True)
class StorageReport:
    sessions: list[SessionStorage]
    file_bytes: int  # sessions.db + its WAL
    kv_unique_bytes: int  # every chunk row once, however many sessions share it
    kv_unique_raw_bytes: int
    kv_unreferenced_bytes: int  # what gc would free
    image_unique_bytes: int


def fork(store: Store, src: str, dst: str) -> SessionInfo:
    """Copy a session's transcript, token log and chunk chain; chunk rows are shared."""
    check_name(dst)
    with store.lock(dst, store.lock_timeout), store._tx():
        row = store._row(src)
        if list(store.db.query("select 1 from sessions where name = ?", [dst])):
            raise SessionExists(dst)
        now = time.time()
        cur = store.conn.execute(
            "insert into sessions (name, fingerprint, chunk_tokens, meta, parent, created_at,"
            " updated_at, n_tokens, n_messages) select ?, fingerprint, chunk_tokens, meta, name,"
            " ?, ?, n_tokens, n_messages from sessions where id = ?", [dst, now, now, row["id"]])
        for table in SESSION_TABLES:
            cols = ", ".join(f'"{c.name}"' for c in store.db[table].columns if c.name != "session_id")
            store.conn.execute(f"insert into {table} (session_id, {cols}) select ?, {cols}"
                               f" from {table} where session_id = ?", [cur.lastrowid, row["id"]])
    return store.get_session(dst)


def rm(store: Store, name: str) -> None:
    """Delete a session's rows. Chunks and images it alone used stay until `gc`."""
    with store.lock(name, store.lock_timeout), store._tx():
        sid = store._row(name)["id"]
        for table in SESSION_TABLES:
            store.conn.execute(f"delete from {table} where session_id = ?", [sid])
        store.conn.execute("delete from sessions where id = ?", [sid])


def prune(store: Store, older_than_days: float, dry_run: bool = False, now: float | None = None) -> PruneResult:
    """Remove sessions not updated for `older_than_days`; sessions in use are skipped."""
    cutoff = (time.time() if now is None else now) - older_than_days * 86400.0
    names = [r["name"] for r in store.db.query(
        "select name from sessions where updated_at < ? order by updated_at", [cutoff])]
    if dry_run:
        return PruneResult(names, [], True)
    removed, in_use = [], []
    for name in names:
        try:
            rm(store, name)
            removed.append(name)
        except SessionInUse:
            in_use.append(name)
    return PruneResult(removed, in_use, False)


def _file_bytes(store: Store) -> int:
    paths = [store.path, store.path.with_name(store.path.name + "-wal")]
    return sum(p.stat().st_size for p in paths if p.exists())


_ORPHAN_KV = "from kv_chunks where key not in (select key from session_chunks)"
_ORPHAN_IMG = "from images where sha256 not in (select sha256 from session_images)"


def gc(store: Store, dry_run: bool = False) -> GcResult:
    """Delete chunk rows and images no session references, and shrink the file."""
    before = _file_bytes(store)
    with store._tx():
        kv = next(store.db.query(f"select count(*) n, coalesce(sum(length(blob)), 0) b {_ORPHAN_KV}"))
        img = next(store.db.query(f"select count(*) n, coalesce(sum(length(data)), 0) b {_ORPHAN_IMG}"))
        if not dry_run:
            store.conn.execute(f"delete {_ORPHAN_KV}")
            store.conn.execute(f"delete {_ORPHAN_IMG}")
    if not dry_run:
        store.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        store.conn.execute("PRAGMA incremental_vacuum")
        store.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return GcResult(kv["n"], kv["b"], img["n"], img["b"], before, _file_bytes(store), dry_run)


def verify(store: Store, name: str | None = None) -> list[VerifyResult]:
    """Check every session (or one): message bodies, the token log and where it ends, every
    chunk's chain hash, header and checksum, and every image's hash. One damaged session
    never stops the others being checked."""
    names = [name] if name else [i.name for i in store.list_sessions()]
    out = []
    for n in names:
        try:
            out.append(_verify_one(store, n))
        except StoreError as exc:
            if name:  # the one asked for: an unknown name stays an error
                raise
            out.append(VerifyResult(n, 0, 0, [str(exc)]))
    return out


def _verify_one(store: Store, name: str) -> VerifyResult:
    with store._read():
        found, chain, bad, first_bad, meta_ok, sid = _examine(store, name)
        problems = ([] if meta_ok else ["the session row's settings (meta) are not a JSON object"])
        problems += found.problems + _image_problems(store, sid)
        plan = integrity.plan(store, name, sid, found, chain, first_bad, meta_ok)
    return VerifyResult(name, len(chain), len(bad), bad + problems, None if plan.empty else plan)


def _examine(store: Store, name: str):
    """Scan a session's rows and its chunk chain against the tokens that read back."""
    row = store._row(name)
    sid = row["id"]
    found = integrity.scan(store, sid, row["n_tokens"], row["n_messages"])
    chain = store._chain(sid)
    bad: list[str] = []
    first_bad = None
    if chain:
        good, bad = store.check_chain(sid, found.tokens, store._spans(sid), row["fingerprint"],
                                      row["chunk_tokens"] or 1, stop_first=False)
        first_bad = len(good) if bad else None
    return found, chain, bad, first_bad, _meta_ok(row["meta"]), sid


def _meta_ok(raw: object) -> bool:
    return integrity.parse_meta(raw) is not None


def repair(store: Store, name: str, dry_run: bool = False) -> RepairPlan:
    """Cut a damaged session back to its last whole turn that reads back, and its KV chain
    back to before the first bad chunk; returns what was (or, dry, would be) dropped."""
    if dry_run:
        with store._read():
            found, chain, _, first_bad, meta_ok, sid = _examine(store, name)
            return integrity.plan(store, name, sid, found, chain, first_bad, meta_ok)
    with store.lock(name, store.lock_timeout), store._tx():
        found, chain, _, first_bad, meta_ok, sid = _examine(store, name)
        plan = integrity.plan(store, name, sid, found, chain, first_bad, meta_ok)
        if not plan.empty:
            integrity.apply(store, sid, plan, chain)
    return plan


def _image_problems(store: Store, sid: int) -> list[str]:
    rows = store.db.query(
        "select s.sha256, i.data from session_images s left join images i on i.sha256 = s.sha256"
        " where s.session_id = ?", [sid])
    out = []
    for r in rows:
        if r["data"] is None:
            out.append(f"image {r['sha256'][:12]}... is missing")
        elif hashlib.sha256(r["data"]).hexdigest() != r["sha256"]:
            out.append(f"image {r['sha256'][:12]}... fails its checksum")
    return out


def storage(store: Store) -> StorageReport:
    """Bytes per session and KV bytes per token, plus store-wide totals."""
    with store._read():
        per = [_session_storage(store, r) for r in store.db.query("select * from sessions order by updated_at desc")]
        kv = next(store.db.query("select coalesce(sum(stored_bytes), 0) s, coalesce(sum(raw_bytes), 0) r from kv_chunks"))
        orphan = next(store.db.query(f"select coalesce(sum(stored_bytes), 0) b {_ORPHAN_KV}"))
        img = next(store.db.query("select coalesce(sum(size), 0) b from images"))
    return StorageReport(per, _file_bytes(store), kv["s"], kv["r"], orphan["b"], img["b"])


def _one(store: Store, sql: str, sid: int) -> int:
    return next(iter(next(store.db.query(sql, [sid])).values())) or 0


def _session_storage(store: Store, row: dict) -> SessionStorage:
    sid = row["id"]
    kv = next(store.db.query(
        "select coalesce(sum(k.stored_bytes), 0) s, coalesce(sum(k.raw_bytes), 0) r from session_chunks c"
        " join kv_chunks k on k.key = c.key where c.session_id = ?", [sid]))
    kv_tokens = _one(store, "select max(end) from session_chunks where session_id = ?", sid)
    return SessionStorage(
        name=row["name"], n_tokens=row["n_tokens"], kv_tokens=kv_tokens,
        kv_bytes=kv["s"], kv_raw_bytes=kv["r"],
        kv_bytes_per_token=round(kv["s"] / kv_tokens, 2) if kv_tokens else 0.0,
        transcript_bytes=_one(store, "select sum(length(body)) from messages where session_id = ?", sid),
        token_log_bytes=_one(store, "select sum(length(ids)) from token_segments where session_id = ?", sid),
        image_bytes=_one(store, "select sum(i.size) from session_images s join images i"
                         " on i.sha256 = s.sha256 where s.session_id = ?", sid),
    )
