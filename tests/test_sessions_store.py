"""Session store: save/load round trips, the chunk chain, forks sharing rows, gc,
prune, storage figures, the home directory, and the import rule."""

import ast
import hashlib
from pathlib import Path

import pytest

from sessions import ImageSpan, KVChunk, SessionExists, SessionNotFound, Store, StoreError, default_home
from sessions.bench import fp4_records, store_throughput, v41_chunk, zstd_levels

FP = "fp-a"
C = 8


def kv(start: int, end: int, tag: int = 0) -> KVChunk:
    return KVChunk(start, end, {"layers.2.kv": bytes([tag, start % 256]) * (end - start) * 9,
                                "layers.2.index": bytes([start % 256]) * (end - start) * 2})


def save(store, name, n0, n, *, kv_from=None, tag=0, msgs=None):
    kv_from = n0 - n0 % C if kv_from is None else kv_from
    chunks = [kv(s, min(s + C, n0 + n), tag) for s in range(kv_from, n0 + n, C)]
    return store.save_point(name, messages=msgs or [{"role": "user", "content": f"at {n0}"}],
                            new_tokens=list(range(n0, n0 + n)), kv_chunks=chunks,
                            fingerprint=FP, chunk_tokens=C)


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("DSAGENT_HOME", str(tmp_path))
    with Store.open() as st:
        st.create_session("a", fingerprint=FP, meta={"model": "tiny"})
        yield st


def test_home_from_env(store, tmp_path):
    assert default_home() == tmp_path
    assert store.path == tmp_path / "sessions.db"


def test_round_trip_with_tail_replaced(store):
    save(store, "a", 0, 11)
    res = save(store, "a", 11, 10)
    assert (res.n_tokens, res.kv_tokens, res.next_chunk_start) == (21, 21, 16)
    loaded = store.load("a", fingerprint=FP, chunk_tokens=C)
    assert loaded.tokens == list(range(21)) and loaded.warnings == []
    assert [(c.start, c.end) for c in loaded.kv] == [(0, 8), (8, 16), (16, 21)]
    assert loaded.kv[2].blobs == kv(16, 21).blobs
    assert [m["content"] for m in loaded.messages] == ["at 0", "at 11"]
    assert store.db.execute("select count(*) from kv_chunks").fetchone()[0] == 6  # old tail gone


def test_kv_may_lag_the_token_log(store):
    save(store, "a", 0, 5, kv_from=0)
    store.save_point("a", new_tokens=[5, 6], fingerprint=FP, chunk_tokens=C)
    loaded = store.load("a", fingerprint=FP, chunk_tokens=C)
    assert (len(loaded.tokens), loaded.kv_tokens, loaded.next_chunk_start) == (7, 5, 0)


def test_bad_chunks_are_refused_and_nothing_is_written(store):
    save(store, "a", 0, 16)
    with pytest.raises(ValueError, match="multiple of"):
        store.save_point("a", new_tokens=[1] * 8, kv_chunks=[kv(24, 32)], fingerprint=FP, chunk_tokens=C)
    with pytest.raises(ValueError, match="beyond the token log"):
        store.save_point("a", kv_chunks=[kv(16, 24)], fingerprint=FP, chunk_tokens=C)
    with pytest.raises(ValueError, match="layers"):
        store.save_point("a", new_tokens=[1] * 8, kv_chunks=[KVChunk(16, 24, {"x": b"1"})],
                         fingerprint=FP, chunk_tokens=C)
    assert store.get_session("a").n_tokens == 16


def test_rewrite_from_an_earlier_chunk(store):
    save(store, "a", 0, 24)
    store.save_point("a", kv_chunks=[kv(8, 16, tag=7), kv(16, 24, tag=7)], fingerprint=FP, chunk_tokens=C)
    loaded = store.load("a", fingerprint=FP, chunk_tokens=C)
    assert loaded.kv[1].blobs == kv(8, 16, tag=7).blobs and loaded.kv_tokens == 24


def test_images_and_spans_change_the_chain(store):
    img = b"\x89PNG fake"
    sha = hashlib.sha256(img).hexdigest()
    store.save_point("a", new_tokens=list(range(10)), image_spans=[ImageSpan(2, 6, sha)], images={sha: img},
                     kv_chunks=[kv(0, 8), kv(8, 10)], fingerprint=FP, chunk_tokens=C)
    loaded = store.load("a", fingerprint=FP, chunk_tokens=C)
    assert loaded.image_spans == [ImageSpan(2, 6, sha)] and loaded.kv_tokens == 10
    store.create_session("b", fingerprint=FP)
    store.save_point("b", new_tokens=list(range(10)), kv_chunks=[kv(0, 8)], fingerprint=FP, chunk_tokens=C)
    keys = {r[0] for r in store.db.execute("select key from session_chunks where idx = 0")}
    assert len(keys) == 2  # same tokens, but one has an image inside
    with pytest.raises(ValueError, match="does not hash"):
        store.save_point("a", images={sha: b"other"}, fingerprint=FP, chunk_tokens=C)


def test_fork_shares_rows_and_diverges(store):
    save(store, "a", 0, 20)
    store.fork("a", "b")
    rows = store.db.execute("select count(*) from kv_chunks").fetchone()[0]
    assert store.get_session("b").parent == "a"
    save(store, "b", 20, 12)  # b replaces its tail; a still needs the old one
    assert store.load("a", fingerprint=FP, chunk_tokens=C).kv_tokens == 20
    assert store.load("b", fingerprint=FP, chunk_tokens=C).kv_tokens == 32
    assert store.db.execute("select count(*) from kv_chunks").fetchone()[0] == rows + 4
    with pytest.raises(SessionExists):
        store.fork("a", "b")


def test_rm_and_gc_keep_shared_rows(store):
    save(store, "a", 0, 20)
    store.fork("a", "b")
    save(store, "b", 20, 12)
    store.rm("b")
    assert store.gc(dry_run=True).kv_rows == 4
    assert store.db.execute("select count(*) from kv_chunks").fetchone()[0] == 10
    r = store.gc()
    assert r.kv_rows == 4 and store.gc().kv_rows == 0
    assert store.load("a", fingerprint=FP, chunk_tokens=C).kv_tokens == 20
    with pytest.raises(SessionNotFound):
        store.get_session("b")


def test_gc_removes_unreferenced_images(store):
    img = b"img"
    sha = hashlib.sha256(img).hexdigest()
    store.save_point("a", new_tokens=[1, 2], images={sha: img}, image_spans=[ImageSpan(0, 2, sha)],
                     fingerprint=FP, chunk_tokens=C)
    assert store.gc().images == 0
    store.rm("a")
    assert store.gc().images == 1


def test_prune(store):
    save(store, "a", 0, 4)
    assert store.prune(1.0).removed == []
    assert store.prune(0.0, dry_run=True).removed == ["a"]
    assert store.get_session("a")
    assert store.prune(-1.0).removed == ["a"] and store.list_sessions() == []


def test_sessions_listing(store):
    store.create_session("b", fingerprint=FP)
    assert store.latest_session().name == "b"
    assert [s.name for s in store.list_sessions()] == ["b", "a"]
    with pytest.raises(StoreError, match="invalid session name"):
        store.create_session("../x", fingerprint=FP)


def test_storage_and_export(store):
    save(store, "a", 0, 20, msgs=[{"role": "user", "content": "hello"},
                                  {"role": "assistant", "content": [{"type": "text", "text": "hi"}],
                                   "tool_calls": [{"name": "ls"}]}])
    rep = store.storage()
    (s,) = rep.sessions
    assert s.kv_tokens == 20 and s.kv_raw_bytes == 20 * 20 and s.kv_bytes == rep.kv_unique_bytes
    md = store.export("a", "markdown")
    assert "## user\n\nhello" in md and "## assistant\n\nhi" in md and '"name": "ls"' in md
    assert store.export("a", "jsonl").count("\n") == 2
    assert '"messages"' in store.export("a", "json")
    with pytest.raises(StoreError, match="unknown export format"):
        store.export("a", "html")


def test_replies_saved_without_a_stop_export_as_before(store):
    """Stores written before replies recorded why they stopped: no mark, the Markdown of old;
    a reply that ended normally (stop eos) has none either."""
    save(store, "a", 0, 4, msgs=[{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
                                 {"role": "user", "content": "and?"},
                                 {"role": "assistant", "content": "", "tool_calls": []}])
    before = "# Session a\n\n## user\n\nhello\n\n## assistant\n\nhi\n\n## user\n\nand?\n"
    assert store.export("a") == before
    save(store, "a", 4, 2, msgs=[{"role": "user", "content": "ok"}, {"role": "assistant", "content": "bye", "stop": "eos"}])
    assert store.export("a") == before + "\n## user\n\nok\n\n## assistant\n\nbye\n"


def test_stored_bytes_per_token_within_5_percent_of_formula():
    chunks = [v41_chunk(i * 256, (i + 1) * 256, seed=i) for i in range(4)]
    assert chunks[0].nbytes == 890 * 256
    r = store_throughput(chunks, list(range(1024)), chunk_tokens=256, zstd_level=1, formula_bytes_per_token=890)
    assert r["stored_vs_formula"] <= 1.05


def test_zstd_levels_report():
    rows = zstd_levels({"kv": fp4_records(64, 512, 16, "e4m3")}, levels=(1, 3), repeat=1)
    assert [r["level"] for r in rows] == [1, 3] and all(0 < r["ratio"] <= 1.01 for r in rows)


def test_sessions_imports_no_sibling_package():
    for path in Path(__file__).resolve().parents[1].joinpath("sessions").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            for n in names:
                assert n.split(".")[0] not in {"model", "tools", "dsagent", "torch", "pickle"}, (path, n)
