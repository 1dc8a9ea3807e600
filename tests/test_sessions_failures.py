"""Every way stored KV can go bad: the KV from the first bad chunk on is dropped with
a warning, the transcript and token log always load. Then a session's own rows going bad
(a message body, a gap in the token log, an unfinished turn): named by session and row,
other sessions untouched, repaired back to the last whole turn. Plus files the store
refuses, a read-only store, and a disk that fills during a save."""

import errno
import json
import sqlite3
import struct

import pytest

from sessions import KVChunk, NotADatabase, SchemaTooNew, SessionDamaged, Store, StoreFull, StoreReadOnly
from sessions import blob as blob_mod
from sessions import store as store_mod

FP = "fp-a"
C = 8
N = 36  # chunks 0-8, 8-16, 16-24, 24-32 and a tail 32-36


def kv(start, end):
    return KVChunk(start, end, {"layers.2.kv": bytes(range(256))[: (end - start) * 20],
                                "layers.20.kv": bytes([start]) * (end - start) * 30})


@pytest.fixture
def store(tmp_path):
    with Store.open(tmp_path) as st:
        st.create_session("a", fingerprint=FP)
        st.save_point("a", messages=[{"role": "user", "content": "keep me"}], new_tokens=list(range(N)),
                      kv_chunks=[kv(s, min(s + C, N)) for s in range(0, N, C)], fingerprint=FP, chunk_tokens=C)
        yield st


def blob_of(store, idx, layer="layers.2.kv"):
    key = store.db.execute("select key from session_chunks where idx = ?", [idx]).fetchone()[0]
    return key, store.db.execute("select blob from kv_chunks where key = ? and layer = ?", [key, layer]).fetchone()[0]


def put_blob(store, key, data, layer="layers.2.kv"):
    store.conn.execute("update kv_chunks set blob = ? where key = ? and layer = ?", [data, key, layer])


def loads_prefix(store, kv_tokens, reason, fingerprint=FP, chunk_tokens=C):
    loaded = store.load("a", fingerprint=fingerprint, chunk_tokens=chunk_tokens)
    assert loaded.kv_tokens == kv_tokens and len(loaded.kv) == kv_tokens // C
    assert loaded.tokens == list(range(N)) and loaded.messages == [{"role": "user", "content": "keep me"}]
    assert len(loaded.warnings) == 1 and reason in loaded.warnings[0], loaded.warnings
    assert f"from token {kv_tokens} on" in loaded.warnings[0]
    return loaded


@pytest.mark.parametrize("where", [0, 10, 40, 60, -1])
def test_flipped_byte(store, where):
    key, data = blob_of(store, 2)
    data = bytearray(data)
    data[where] ^= 0x10
    put_blob(store, key, bytes(data))
    loads_prefix(store, 16, "KV chunk 2 (tokens 16-24)")
    assert not store.verify("a")[0].ok


def test_truncated_zstd_frame(store):
    key, data = blob_of(store, 1)
    put_blob(store, key, data[:-5])
    loads_prefix(store, 8, "truncated")


def test_corrupt_frame_with_consistent_sizes(store):
    key, data = blob_of(store, 1)
    put_blob(store, key, data[:-6] + b"\xff" * 6)
    loaded = loads_prefix(store, 8, "KV chunk 1")
    assert "zstd" in loaded.warnings[0] or "checksum" in loaded.warnings[0]


def test_missing_chunk_rows(store):
    key, _ = blob_of(store, 3)
    store.conn.execute("delete from kv_chunks where key = ? and layer = 'layers.20.kv'", [key])
    loads_prefix(store, 24, "missing layer(s) layers.20.kv")


def test_missing_link_in_the_chain(store):
    store.conn.execute("delete from session_chunks where idx = 1")
    loads_prefix(store, 8, "a chunk is missing")


def test_format_version_mismatch(store):
    key, data = blob_of(store, 0)
    put_blob(store, key, data[:4] + struct.pack("<H", blob_mod.FORMAT_VERSION + 1) + data[6:])
    loads_prefix(store, 0, f"format version {blob_mod.FORMAT_VERSION + 1}")


def test_fingerprint_mismatch(store):
    loads_prefix(store, 0, "another model", fingerprint="fp-b")
    loads_prefix(store, 0, "chunks of 8 tokens, now 16", chunk_tokens=16)


def test_chunk_row_from_another_model(store):
    key, _ = blob_of(store, 2)
    store.conn.execute("update kv_chunks set fingerprint = 'zzz' where key = ?", [key])
    loads_prefix(store, 16, "made by another model")


def test_changed_token_log_breaks_the_chain(store):
    seg = store.db.execute("select ids from token_segments").fetchone()[0]
    store.conn.execute("update token_segments set ids = ?", [seg[:40] + b"\x07\x00\x00\x00" + seg[44:]])
    loaded = store.load("a", fingerprint=FP, chunk_tokens=C)
    assert loaded.kv_tokens == 8 and "chain hash differs" in loaded.warnings[0]


def test_rebuild_after_damage(store):
    key, data = blob_of(store, 1)
    put_blob(store, key, data[:-1])
    loaded = store.load("a", fingerprint=FP, chunk_tokens=C)
    assert loaded.next_chunk_start == 8
    store.save_point("a", kv_chunks=[kv(s, min(s + C, N)) for s in range(8, N, C)], fingerprint=FP, chunk_tokens=C)
    again = store.load("a", fingerprint=FP, chunk_tokens=C)
    assert again.warnings == [] and again.kv_tokens == N


def test_newer_schema_is_refused_untouched(tmp_path):
    with Store.open(tmp_path) as st:
        st.create_session("a", fingerprint=FP)
        st.conn.execute("insert into _migrations values ('m999_from_the_future', 0)")
    before = (tmp_path / "sessions.db").read_bytes()
    with pytest.raises(SchemaTooNew, match="m999_from_the_future.*upgrade dsagent"):
        Store.open(tmp_path)
    assert (tmp_path / "sessions.db").read_bytes() == before


def test_not_sqlite_is_refused(tmp_path):
    (tmp_path / "sessions.db").write_text("these are my notes, not a database\n" * 10)
    with pytest.raises(NotADatabase, match="not an SQLite database"):
        Store.open(tmp_path)


def test_damaged_sqlite_is_refused(tmp_path):
    with Store.open(tmp_path) as st:
        st.create_session("a", fingerprint=FP)
        st.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    path = tmp_path / "sessions.db"
    data = bytearray(path.read_bytes())
    data[16:100] = b"\xff" * 84  # page size and header fields
    path.write_bytes(bytes(data))
    with pytest.raises(NotADatabase):
        Store.open(tmp_path)


def test_migrations_are_recorded_in_order(tmp_path):
    with Store.open(tmp_path) as st:
        names = [r[0] for r in st.conn.execute("select name from _migrations order by rowid")]
    from sessions.schema import MIGRATIONS
    assert names == [m.__name__ for m in MIGRATIONS]
    assert sqlite3.connect(tmp_path / "sessions.db").execute("pragma journal_mode").fetchone()[0] == "wal"
    json.dumps(names)


# ---------------------------------------------------------------------------- a session's own rows
def turns(store, name, n, *, start=0, closed_last=True):
    """``n`` whole turns (a user message and the reply, 10 tokens) after ``start`` of them."""
    for k in range(start, start + n):
        last = k == start + n - 1
        store.save_point(name, messages=[{"role": "user", "content": f"q{k}"}, {"role": "assistant", "content": f"a{k}"}],
                         new_tokens=list(range(10 * k, 10 * k + 10)), fingerprint=FP, chunk_tokens=C,
                         kv_chunks=[kv(s, min(s + C, 10 * k + 10)) for s in range(10 * k - (10 * k) % C, 10 * k + 10, C)],
                         closed=closed_last or not last)


@pytest.fixture
def two(tmp_path):
    """Sessions x and y of three whole turns each."""
    with Store.open(tmp_path) as st:
        for name in ("x", "y"):
            st.create_session(name, fingerprint=FP)
            turns(st, name, 3)
        yield st


def sid(store, name):
    return store.conn.execute("select id from sessions where name = ?", [name]).fetchone()[0]


def repaired_to(store, name, n_turns):
    """Repair cut ``name`` back to its first ``n_turns`` turns, which load and verify clean."""
    plan = store.repair(name)
    assert (plan.keep_messages, plan.keep_tokens) == (2 * n_turns, 10 * n_turns), plan
    loaded = store.load(name, fingerprint=FP, chunk_tokens=C)
    assert loaded.tokens == list(range(10 * n_turns)) and len(loaded.messages) == 2 * n_turns
    assert loaded.warnings == [] and 10 * n_turns - C < loaded.kv_tokens <= 10 * n_turns  # whole chunks, or the last save's tail
    assert store.verify(name)[0].ok and store.repair(name).empty
    return plan


@pytest.mark.parametrize("body, why", [("not json", "is not JSON"), ("[1, 2]", "is not a message"),
                                       (b"{\"role\": \"\xff\"}", "is not UTF-8")], ids=["json", "list", "utf8"])
def test_a_corrupt_message_row_names_session_and_row_and_repairs_to_the_turn_before(two, body, why):
    two.conn.execute("update messages set body = ? where session_id = ? and seq = 3", [body, sid(two, "x")])
    with pytest.raises(SessionDamaged, match=rf"session 'x': message row 3 {why}.*verify x --repair"):
        two.load("x", fingerprint=FP, chunk_tokens=C)
    assert len(two.load("y", fingerprint=FP, chunk_tokens=C).messages) == 6  # the others are untouched
    x, y = sorted(two.verify(), key=lambda r: r.name)
    assert y.ok and not x.ok and any(p.startswith(f"message row 3 {why}") for p in x.problems)
    assert x.repair is not None and x.repair.drop_messages == 4
    assert two.repair("x", dry_run=True) == x.repair and len(two.messages("y")) == 6
    assert two.db.execute("select count(*) from messages where session_id = ?", [sid(two, "x")]).fetchone()[0] == 6
    repaired_to(two, "x", 1)
    assert two.verify("y")[0].ok and len(two.messages("y")) == 6


def test_a_gap_in_the_token_log_is_named_and_repaired(two):
    two.conn.execute("delete from token_segments where session_id = ? and start = 10", [sid(two, "x")])
    with pytest.raises(SessionDamaged, match="session 'x': the token log has a gap at token 10"):
        two.load("x", fingerprint=FP, chunk_tokens=C)
    x = two.verify("x")[0]
    assert "token log has a gap at token 10 (the next segment row starts at 20)" in x.problems
    repaired_to(two, "x", 1)


def test_a_damaged_token_segment_is_named(two):
    two.conn.execute("update token_segments set ids = x'0102' where session_id = ? and start = 20", [sid(two, "x")])
    assert "token log segment row 20-30 is damaged (2 bytes for 10 tokens)" in two.verify("x")[0].problems
    repaired_to(two, "x", 2)


def test_a_session_that_ends_in_an_unfinished_turn(two):
    two.save_point("x", messages=[{"role": "user", "content": "q3"}], new_tokens=list(range(30, 36)),
                   fingerprint=FP, chunk_tokens=C, closed=False)
    x = two.verify("x")[0]
    assert x.problems == ["the session ends in an unfinished turn (message row 6 is a user message with no reply)"]
    assert x.repair.drop_messages == 1 and x.repair.drop_tokens == 6
    repaired_to(two, "x", 3)


def test_sessions_saved_before_save_points_were_recorded(two):
    """What a failed turn used to leave: the user's message and its tokens, no reply. With no
    save points recorded, they are inferred from the rows (one segment and one timestamp a save)."""
    two.save_point("x", messages=[{"role": "user", "content": "q3"}], new_tokens=list(range(30, 36)),
                   fingerprint=FP, chunk_tokens=C)
    two.conn.execute("delete from save_points")
    x = two.verify("x")[0]
    assert x.problems == ["the session ends in an unfinished turn (message row 6 is a user message with no reply)"]
    assert two.verify("y")[0].ok
    repaired_to(two, "x", 3)
    two.conn.execute("delete from save_points")
    two.conn.execute("update messages set body = '{' where session_id = ? and seq = 2", [sid(two, "x")])
    repaired_to(two, "x", 1)


def test_unreadable_settings_do_not_hide_the_session(two):
    two.conn.execute("update sessions set meta = 'oops' where name = 'x'")
    assert [s.name for s in two.list_sessions()] == ["y", "x"] and two.get_session("x").meta == {}
    x = two.verify("x")[0]
    assert "the session row's settings (meta) are not a JSON object" in x.problems and x.repair.reset_meta
    two.repair("x")
    assert two.verify("x")[0].ok


# ---------------------------------------------------------------------------- the store's file and device
def test_a_store_path_that_is_a_directory(tmp_path):
    (tmp_path / "sessions.db").mkdir()
    with pytest.raises(NotADatabase, match="sessions.db is a directory, not the session store.*DSAGENT_HOME"):
        Store.open(tmp_path)


@pytest.mark.parametrize("fault", [sqlite3.OperationalError("database or disk is full"),
                                   OSError(errno.ENOSPC, "No space left on device")], ids=["sqlite-full", "enospc"])
def test_a_full_disk_during_a_save_writes_nothing_and_keeps_the_previous_turn(store, monkeypatch, fault):
    before = store.load("a", fingerprint=FP, chunk_tokens=C)

    def full(*a, **kw):  # after the messages and tokens of the save are written
        raise fault

    monkeypatch.setattr(Store, "_write_kv", full)
    with pytest.raises(StoreFull, match=rf"no space left on the device holding the store \({store.path}\)"):
        store.save_point("a", messages=[{"role": "user", "content": "lost"}], new_tokens=[1, 2, 3],
                         kv_chunks=[kv(32, 39)], fingerprint=FP, chunk_tokens=C)
    assert not store.conn.in_transaction
    after = store.load("a", fingerprint=FP, chunk_tokens=C)
    assert (after.messages, after.tokens, after.kv_tokens) == (before.messages, before.tokens, before.kv_tokens)
    assert store.verify("a")[0].ok


def test_a_read_only_store_reads_and_refuses_writes_by_name(store, monkeypatch):
    path = store.path
    store.close()
    monkeypatch.setattr(store_mod, "_writable", lambda p: False)
    with Store.open(path.parent) as ro:
        assert ro.read_only and [s.name for s in ro.list_sessions()] == ["a"]
        assert ro.load("a", fingerprint=FP, chunk_tokens=C).kv_tokens == N
        assert "keep me" in ro.export("a") and ro.verify("a")[0].chunks == 5 and ro.storage().file_bytes
        assert ro.repair("a", dry_run=True).keep_tokens == N
        for write in (lambda: ro.create_session("b", fingerprint=FP), lambda: ro.fork("a", "b"),
                      lambda: ro.rm("a"), lambda: ro.gc(), lambda: ro.repair("a"),
                      lambda: ro.save_point("a", new_tokens=[1], fingerprint=FP, chunk_tokens=C)):
            with pytest.raises(StoreReadOnly, match=f"the store is read-only: {path}"):
                write()
        with pytest.raises(sqlite3.OperationalError, match="readonly"):  # SQLite itself holds to it too
            ro.conn.execute("delete from messages")


def test_a_read_only_store_not_yet_migrated_still_reads(store, monkeypatch):
    store.conn.execute("drop table save_points")
    store.conn.execute("delete from _migrations where name = 'm006_save_points'")
    path = store.path
    store.close()
    monkeypatch.setattr(store_mod, "_writable", lambda p: False)
    unfinished = ["the session ends in an unfinished turn (message row 0 is a user message with no reply)"]
    with Store.open(path.parent) as ro:
        assert ro.messages("a") and ro.verify("a")[0].problems == unfinished  # judged by its rows
    monkeypatch.undo()
    with Store.open(path.parent) as rw:  # writable again: migrated on open
        assert "save_points" in rw.db.table_names() and rw.verify("a")[0].problems == unfinished
