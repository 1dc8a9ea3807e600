"""Every way stored KV can go bad: the KV from the first bad chunk on is dropped with
a warning, the transcript and token log always load. Plus files the store refuses."""

import json
import sqlite3
import struct

import pytest

from sessions import KVChunk, NotADatabase, SchemaTooNew, Store
from sessions import blob as blob_mod

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
