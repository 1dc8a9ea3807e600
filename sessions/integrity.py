"""A session's own rows checked against each other, and the repair that cuts a damaged
session back to its last whole turn.

Owns: reading message bodies and the token log without trusting them (`parse_body`,
`scan`), the save points a session went through (recorded since migration m006,
inferred for older saves), what counts as a closed turn, the repair plan and applying
it inside the caller's transaction. Does not own: the KV chain checks
(`Store.check_chain`), image checks (`manage.verify`), transactions, locks,
confirmation prompts or printing.

A closed turn is what the caller says it is at each save point (`save_point(closed=...)`).
Saves from before the store recorded that are judged by their rows: a save whose newest
message is not the assistant's is unfinished, which is what a turn that failed midway
used to leave behind (the user's message and its tokens, no reply).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .blob import tokens_from_bytes

if TYPE_CHECKING:
    from .store import Store


@dataclass(frozen=True)
class SavePoint:
    """Where one save left a session: its token and message counts, and whether the turn was closed."""

    n_tokens: int
    n_messages: int
    closed: bool


@dataclass(frozen=True)
class RepairPlan:
    """What `sessions verify --repair` keeps and drops of one session."""

    name: str
    keep_messages: int
    keep_tokens: int
    drop_messages: int
    drop_tokens: int
    drop_chunks: int
    reset_meta: bool = False

    @property
    def empty(self) -> bool:
        return not (self.drop_messages or self.drop_tokens or self.drop_chunks or self.reset_meta)

    def describe(self) -> str:
        drops = [f"{n} {what}" for n, what in ((self.drop_messages, "message(s)"), (self.drop_tokens, "token(s)"),
                                                (self.drop_chunks, "KV chunk(s)")) if n]
        if self.reset_meta:
            drops.append("its unreadable settings (reset to none)")
        return (f"keep {self.keep_messages} message(s) and {self.keep_tokens} token(s); "
                f"drop {', '.join(drops) or 'nothing'}")


@dataclass
class Scan:
    """What a session's rows hold that can be read back, and where that stops."""

    message_rows: int  # rows present
    messages_ok: int  # rows [0, messages_ok) are numbered without a gap and parse
    tokens_ok: int  # tokens [0, tokens_ok) are contiguous and readable
    tokens: list[int]  # those tokens
    points: list[SavePoint]  # from (0, 0) on, in order
    problems: list[str] = field(default_factory=list)

    @property
    def keep(self) -> SavePoint:
        """The last closed save point inside the readable rows: what a repair cuts back to."""
        return next(p for p in reversed(self.points)
                    if p.closed and p.n_tokens <= self.tokens_ok and p.n_messages <= self.messages_ok)


def parse_body(raw: bytes | str) -> dict:
    """A stored message body as the dict it was saved from; ValueError says what is wrong."""
    if isinstance(raw, (bytes, bytearray, memoryview)):
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"is not UTF-8 text (byte {e.start})") from None
    if not isinstance(raw, str):
        raise ValueError("is empty")
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"is not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(body, dict):
        raise ValueError("is not a message (a JSON object)")
    return body


def parse_meta(raw: object) -> dict | None:
    """A session's settings, or None when its row's JSON cannot be read (verify reports it)."""
    try:
        meta = json.loads(raw) if isinstance(raw, (str, bytes)) else None
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None


def scan(store: Store, sid: int, n_tokens: int, n_messages: int) -> Scan:
    """Read a session's messages, token log and save points as far as they hold together."""
    problems: list[str] = []
    # bodies are read as bytes: a TEXT column holding bytes that are not UTF-8 would make
    # sqlite3 fail the whole query, and with it every message of the session
    rows = store.conn.execute(
        "select seq, cast(role as blob), cast(body as blob), created_at from messages"
        " where session_id = ? order by seq", [sid]).fetchall()
    messages_ok = 0
    for seq, _, body, _ in rows:
        if seq != messages_ok:
            problems.append(f"message row {messages_ok} is missing (the next row is {seq})")
            break
        try:
            parse_body(body)
        except ValueError as e:
            problems.append(f"message row {seq} {e}")
            break
        messages_ok += 1
    else:
        if len(rows) != n_messages:
            problems.append(f"transcript has {len(rows)} messages, session row says {n_messages}")

    segments = store.conn.execute(
        "select start, end, ids from token_segments where session_id = ? order by start", [sid]).fetchall()
    tokens: list[int] = []
    ends: list[int] = []
    for start, end, ids in segments:
        pos = len(tokens)
        if start != pos:
            problems.append(f"token log has a gap at token {pos} (the next segment row starts at {start})"
                            if start > pos else f"token log segment rows overlap at token {start}")
            break
        if not isinstance(ids, bytes) or end <= start or len(ids) != 4 * (end - start):
            size = len(ids) if isinstance(ids, bytes) else 0
            problems.append(f"token log segment row {start}-{end} is damaged ({size} bytes for {end - start} tokens)")
            break
        tokens += tokens_from_bytes(ids)
        ends.append(end)
    else:
        if len(tokens) != n_tokens:
            problems.append(f"token log has {len(tokens)} tokens, session row says {n_tokens}")

    roles = [bytes(r or b"").decode("utf-8", "replace") for _, r, _, _ in rows]
    times = [t for _, _, _, t in rows]
    points = _save_points(store, sid, ends, roles, times, n_tokens, n_messages)
    out = Scan(len(rows), messages_ok, len(tokens), tokens, points, problems)
    last = points[-1]
    if not problems and (last.n_tokens, last.n_messages) != (n_tokens, n_messages):
        problems.append(f"the last save point ends at token {last.n_tokens} and message {last.n_messages}, "
                        f"the session row at {n_tokens} and {n_messages}")
    elif not problems and not last.closed:
        newest = f"message row {last.n_messages - 1} is a {roles[last.n_messages - 1] or '?'} message"
        problems.append(f"the session ends in an unfinished turn ({newest} with no reply)")
    return out


def _recorded(store: Store, sid: int) -> list[SavePoint]:
    if "save_points" not in store.db.table_names():  # a read-only store not yet migrated
        return []
    rows = store.conn.execute("select n_tokens, n_messages, closed from save_points where session_id = ?"
                              " order by n_tokens, n_messages", [sid])
    return [SavePoint(t, m, bool(c)) for t, m, c in rows]


def _save_points(store: Store, sid: int, ends: list[int], roles: list[str], times: list[float],
                 n_tokens: int, n_messages: int) -> list[SavePoint]:
    """(0, 0), the saves inferred before the first recorded one, then the recorded ones.

    Before save points were recorded, each save wrote one token segment and its messages
    with one timestamp; when the two counts agree, segment ends and timestamp groups pair
    up into save points. When they do not, only the session's end is known."""
    recorded = _recorded(store, sid)
    limit = recorded[0] if recorded else SavePoint(n_tokens, n_messages, False)
    seg_ends = [e for e in ends if e <= limit.n_tokens]
    group_ends = [i + 1 for i in range(min(limit.n_messages, len(times)))
                  if i + 1 == min(limit.n_messages, len(times)) or times[i + 1] != times[i]]

    def closed(m: int) -> bool:
        return m == 0 or (m <= len(roles) and roles[m - 1] == "assistant")

    paired = (seg_ends[-1], group_ends[-1]) == (limit.n_tokens, limit.n_messages) if seg_ends and group_ends else False
    if len(seg_ends) == len(group_ends) and paired:
        inferred = [SavePoint(t, m, closed(m)) for t, m in zip(seg_ends, group_ends)]
    elif not recorded and (n_tokens or n_messages):
        inferred = [SavePoint(n_tokens, n_messages, closed(n_messages))]
    else:
        inferred = []
    points = [SavePoint(0, 0, True)]
    for p in inferred + recorded:  # keep the chain monotone: a later point never goes back
        if (p.n_tokens, p.n_messages) == (points[-1].n_tokens, points[-1].n_messages):
            points[-1] = p
        elif p.n_tokens >= points[-1].n_tokens and p.n_messages >= points[-1].n_messages:
            points.append(p)
    return points


def plan(store: Store, name: str, sid: int, found: Scan, chain: list[dict], first_bad_link: int | None,
         meta_ok: bool) -> RepairPlan:
    """What a repair would keep: the last whole turn that reads back, and the KV before the first bad chunk."""
    keep = found.keep
    stored = store.conn.execute(
        "select coalesce(sum(end - max(start, ?)), 0) from token_segments where session_id = ? and end > ?",
        [keep.n_tokens, sid, keep.n_tokens]).fetchone()[0]
    return RepairPlan(name, keep.n_messages, keep.n_tokens,
                      drop_messages=max(0, found.message_rows - keep.n_messages), drop_tokens=stored,
                      drop_chunks=len(chain) - _chain_cut(chain, keep.n_tokens, first_bad_link),
                      reset_meta=not meta_ok)


def _chain_cut(chain: list[dict], keep_tokens: int, first_bad_link: int | None) -> int:
    """Index of the first chunk link a repair drops: a bad one, or one reaching past the kept tokens."""
    for i, link in enumerate(chain):
        if (first_bad_link is not None and i >= first_bad_link) or link["end"] > keep_tokens:
            return i
    return len(chain)


def apply(store: Store, sid: int, p: RepairPlan, chain: list[dict]) -> None:
    """Cut the session back to ``p`` (inside the caller's write transaction)."""
    T, M, conn = p.keep_tokens, p.keep_messages, store.conn
    conn.execute("delete from messages where session_id = ? and seq >= ?", [sid, M])
    straddling = conn.execute("select start, ids from token_segments where session_id = ? and start < ? and end > ?",
                              [sid, T, T]).fetchall()
    for start, ids in straddling:
        conn.execute("update token_segments set end = ?, ids = ? where session_id = ? and start = ?",
                     [T, bytes(ids)[: 4 * (T - start)], sid, start])
    conn.execute("delete from token_segments where session_id = ? and start >= ?", [sid, T])
    dropped_images = {r[0] for r in conn.execute(
        "select sha256 from image_spans where session_id = ? and end > ?", [sid, T])}
    conn.execute("delete from image_spans where session_id = ? and end > ?", [sid, T])
    still = {r[0] for r in conn.execute("select sha256 from image_spans where session_id = ?", [sid])}
    for sha in dropped_images - still:  # the image rows themselves go at the next gc
        conn.execute("delete from session_images where session_id = ? and sha256 = ?", [sid, sha])
    cut = len(chain) - p.drop_chunks
    if cut < len(chain):
        store._truncate_chain(sid, chain, chain[cut]["start"])
    if "save_points" in store.db.table_names():
        conn.execute("delete from save_points where session_id = ? and (n_tokens > ? or n_messages > ?)", [sid, T, M])
        conn.execute("insert or replace into save_points values (?, ?, ?, 1, ?)", [sid, T, M, time.time()])
    conn.execute("update sessions set n_tokens = ?, n_messages = ?, updated_at = ? where id = ?",
                 [T, M, time.time(), sid])
    if p.reset_meta:
        conn.execute("update sessions set meta = '{}' where id = ?", [sid])
