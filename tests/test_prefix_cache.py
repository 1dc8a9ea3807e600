"""A new session reusing the KV that other sessions stored for the same leading tokens.

The store's lookup (`Store.prefix_chunks`) and its linking save (`save_point(shared_tokens=)`)
on hand-made chunks; then the real embedded default (trained, so greedy tokens have margins):
one session stores the system prompt and tools, a new one with the prefix cache on answers
as one with it off, links the shared chunks instead of writing them, and resumes; a prompt
that differs in its first chunk, or a damaged stored chunk, reuses nothing and answers the
same. Last, the flag and the setting that turn it off.
"""
import hashlib
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

import dsagent.cli as cli
from dsagent.agent import Agent, AgentOptions
from dsagent.prompt import DEFAULT_SYSTEM
from model.engine import Sampling
from sessions import ImageSpan, KVChunk, Store
from tests.scripted_runtime import ScriptedRuntime

FP, C = "fp-a", 8


def kv(start: int, end: int) -> KVChunk:
    return KVChunk(start, end, {"layers.2.kv": bytes([start % 256]) * (end - start) * 9,
                                "layers.2.index": bytes([end % 256]) * (end - start) * 2})


def stored(store, name: str, tokens: list[int], spans=(), images=None) -> None:
    """A session whose whole token log has KV chunks (the last one a tail when it is short)."""
    store.create_session(name, fingerprint=FP)
    store.save_point(name, new_tokens=tokens, image_spans=spans, images=images, fingerprint=FP, chunk_tokens=C,
                     kv_chunks=[kv(s, min(s + C, len(tokens))) for s in range(0, len(tokens), C)])


@pytest.fixture
def store(tmp_path):
    with Store.open(tmp_path / "home") as st:
        yield st


def _kv_rows(store) -> tuple[int, int]:
    return store.db.execute("select count(*), sum(stored_bytes) from kv_chunks").fetchone()


# ---------------------------------------------------------------------------- the store
def test_the_lookup_takes_whole_chunks_of_the_same_prefix_and_leaves_a_token(store):
    stored(store, "a", list(range(30)))
    found = store.prefix_chunks(list(range(20)) + [99] * 10, [], fingerprint=FP, chunk_tokens=C)
    assert [(c.start, c.end) for c in found.kv] == [(0, 8), (8, 16)] and found.kv_tokens == 16
    assert found.kv[1].blobs == kv(8, 16).blobs and found.warnings == []
    assert store.prefix_chunks(list(range(24)), [], fingerprint=FP, chunk_tokens=C).kv_tokens == 16  # 24 is the end
    assert store.prefix_chunks(list(range(25)), [], fingerprint=FP, chunk_tokens=C).kv_tokens == 24
    assert store.prefix_chunks(list(range(40)), [], fingerprint=FP, chunk_tokens=C).kv_tokens == 24  # 24-30 a tail


def test_a_different_first_chunk_model_or_chunk_size_finds_nothing(store):
    stored(store, "a", list(range(30)))
    for tokens, fp, size in (([7] + list(range(1, 30)), FP, C), (list(range(30)), "fp-b", C),
                             (list(range(30)), FP, 16)):
        found = store.prefix_chunks(tokens, [], fingerprint=fp, chunk_tokens=size)
        assert found.kv == [] and found.kv_tokens == 0 and found.warnings == []


def test_an_image_in_the_prefix_is_part_of_the_key(store):
    a, b = b"\x89PNG one", b"\x89PNG two"
    sha_a, sha_b = (hashlib.sha256(x).hexdigest() for x in (a, b))
    stored(store, "a", list(range(30)), spans=[ImageSpan(10, 14, sha_a)], images={sha_a: a})
    same = store.prefix_chunks(list(range(30)), [ImageSpan(10, 14, sha_a)], fingerprint=FP, chunk_tokens=C)
    other = store.prefix_chunks(list(range(30)), [ImageSpan(10, 14, sha_b)], fingerprint=FP, chunk_tokens=C)
    assert same.kv_tokens == 24 and other.kv_tokens == 8  # the chunk holding another picture is not reused


def test_a_damaged_chunk_ends_the_prefix_with_a_warning(store):
    stored(store, "a", list(range(30)))
    key = store.db.execute("select key from session_chunks where idx = 1").fetchone()[0]
    blob = bytearray(store.db.execute("select blob from kv_chunks where key = ? and layer = 'layers.2.kv'",
                                      [key]).fetchone()[0])
    blob[-3] ^= 0xFF
    store.conn.execute("update kv_chunks set blob = ? where key = ? and layer = 'layers.2.kv'", [bytes(blob), key])
    found = store.prefix_chunks(list(range(30)), [], fingerprint=FP, chunk_tokens=C)
    assert found.kv_tokens == 8 and len(found.warnings) == 1 and "tokens 8-16" in found.warnings[0]
    store.conn.execute("update kv_chunks set fingerprint = 'fp-b' where key = ?", [key])
    assert "another model" in store.prefix_chunks(list(range(30)), [], fingerprint=FP, chunk_tokens=C).warnings[0]


def test_chunks_no_session_links_are_not_reused(store):
    stored(store, "a", list(range(30)))
    store.rm("a")  # its rows wait for gc
    assert store.prefix_chunks(list(range(30)), [], fingerprint=FP, chunk_tokens=C).kv_tokens == 0


def test_a_save_links_the_shared_chunks_instead_of_writing_them(store):
    stored(store, "a", list(range(30)))
    rows, size = _kv_rows(store)
    tokens = list(range(20)) + [99] * 6
    store.create_session("b", fingerprint=FP)
    res = store.save_point("b", new_tokens=tokens, kv_chunks=[kv(16, 24), kv(24, 26)], shared_tokens=16,
                           fingerprint=FP, chunk_tokens=C)
    assert res.kv_tokens == 26 and _kv_rows(store) == (rows + 4, size + res.kv_bytes_written)  # 2 new chunks
    chains = [[r[0] for r in store.db.execute("select key from session_chunks where session_id = "
                                              f"(select id from sessions where name = '{n}') order by idx")]
              for n in ("a", "b")]
    assert chains[1][:2] == chains[0][:2] and chains[1][2] != chains[0][2]
    loaded = store.load("b", fingerprint=FP, chunk_tokens=C)
    assert loaded.kv_tokens == 26 and loaded.warnings == [] and store.verify("b")[0].ok
    store.rm("a")
    assert store.gc().kv_rows == 4 and store.load("b", fingerprint=FP, chunk_tokens=C).kv_tokens == 26


def test_a_shared_chunk_collected_before_the_save_keeps_what_is_there(store):
    stored(store, "a", list(range(30)))
    store.create_session("b", fingerprint=FP)
    store.rm("a")
    store.gc()
    res = store.save_point("b", new_tokens=list(range(26)), kv_chunks=[kv(16, 24), kv(24, 26)], shared_tokens=16,
                           fingerprint=FP, chunk_tokens=C)
    assert (res.kv_tokens, res.next_chunk_start, res.n_tokens) == (0, 0, 26) and store.verify("b")[0].ok
    with pytest.raises(ValueError, match="whole chunks"):
        store.save_point("b", shared_tokens=5, fingerprint=FP, chunk_tokens=C)


# ---------------------------------------------------------------------------- the embedded default
QUESTION = "What is 48 * 12?"


@pytest.fixture(scope="module")
def runtime():
    from dsagent.runtime import Runtime, Settings

    return Runtime.load(Settings(threads=1))  # two threads on a CPU another process keeps busy run ~10x slower


def _turn(rt, home: Path, name: str, text: str, *, prefix_cache: bool = True, system: str = DEFAULT_SYSTEM,
          events: list | None = None) -> dict:
    opts = AgentOptions(session=name, workspace=home, policy="deny", speculative=False, system_prompt=system,
                        prefix_cache=prefix_cache, sampling=Sampling(max_new_tokens=12))
    with Store.open(home) as store, Agent(rt, store, opts, on_event=None if events is None else events.append) as agent:
        start = len(agent.log)
        result = agent.turn(text)
        return {"reply": agent.log[start:], "log": list(agent.log), "usage": vars(result.usage).copy(),
                "written": agent.last_save.kv_bytes_written, "refused": list(agent.kv_refused)}


@pytest.fixture(scope="module")
def reference(runtime, tmp_path_factory):
    """A store where one session stored the system prompt; and the question answered there
    with the prefix cache off (in a copy, so the store holds only the first session)."""
    home, plain_home = tmp_path_factory.mktemp("reference"), tmp_path_factory.mktemp("plain")
    _turn(runtime, home, "first", "Hello.")
    plain = _turn(runtime, _copy(home, plain_home), "q", QUESTION, prefix_cache=False)
    return home, plain, plain_home


def _copy(src: Path, dst: Path) -> Path:
    """A copy of the store at ``src`` (through SQLite's backup, so its WAL comes along)."""
    dst.mkdir(parents=True, exist_ok=True)
    a, b = sqlite3.connect(src / "sessions.db"), sqlite3.connect(dst / "sessions.db")
    a.backup(b)
    a.close(), b.close()
    return dst


@pytest.fixture(scope="module")
def reused(runtime, reference, tmp_path_factory):
    home = _copy(reference[0], tmp_path_factory.mktemp("reused"))
    with Store.open(home) as store:
        before = _kv_rows(store)
    return home, _turn(runtime, home, "q", QUESTION), before


def test_a_new_session_reuses_the_stored_prefix_and_answers_as_a_full_prefill(runtime, reference, reused):
    plain, (_, run, _) = reference[1], reused
    assert plain["usage"]["cached_tokens"] == 0 and plain["usage"]["prompt_tokens"] > 2048
    assert run["usage"]["cached_tokens"] == 2048 and run["usage"]["replayed_tokens"] == runtime.args.sliding_window
    assert run["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] - 2048
    assert run["reply"] == plain["reply"] and run["log"] == plain["log"] and run["refused"] == []


def test_the_reusing_session_links_the_shared_chunks_and_writes_only_its_own(reused, reference):
    home, run, (rows, size) = reused
    with Store.open(home) as store:
        keys = [[r[0] for r in store.db.execute("select key from session_chunks where session_id = "
                                                f"(select id from sessions where name = '{n}') order by idx")]
                for n in ("first", "q")]
        per_key = store.db.execute("select max(n) from (select count(*) n from kv_chunks group by key, layer)")
        after = _kv_rows(store)
        assert keys[1][:8] == keys[0][:8] and per_key.fetchone()[0] == 1 and store.verify("q")[0].ok
    assert after[1] - size == run["written"] < reference[1]["written"] / 5  # its tail only, no copy of the prefix
    assert after[0] > rows


def test_the_reusing_session_resumes_from_disk(runtime, reused, reference, tmp_path):
    again = _turn(runtime, _copy(reused[0], tmp_path / "reused"), "q", "And 4*5?")
    plain = _turn(runtime, _copy(reference[2], tmp_path / "plain"), "q", "And 4*5?")
    assert again["usage"]["cached_tokens"] > 2048 and again["refused"] == []
    assert again["reply"] == plain["reply"] and again["log"] == plain["log"]


def test_a_prompt_that_differs_in_its_first_chunk_reuses_nothing(runtime, reference, tmp_path):
    home = _copy(reference[0], tmp_path)
    run = _turn(runtime, home, "q", QUESTION, system="You are " + DEFAULT_SYSTEM.removeprefix("You are dsagent,"))
    assert run["usage"]["cached_tokens"] == 0 and run["usage"]["replayed_tokens"] == 0


def test_a_damaged_stored_chunk_is_refused_with_a_warning_and_the_answer_is_the_same(runtime, reference, tmp_path):
    home = _copy(reference[0], tmp_path)
    with sqlite3.connect(home / "sessions.db") as db:
        key, layer, blob = db.execute("select key, layer, blob from kv_chunks where start = 0 limit 1").fetchone()
        damaged = bytearray(blob)
        damaged[len(damaged) // 2] ^= 0xFF
        db.execute("update kv_chunks set blob = ? where key = ? and layer = ?", [bytes(damaged), key, layer])
    events = []
    run = _turn(runtime, home, "q", QUESTION, events=events)
    warnings = [e["message"] for e in events if e["event"] == "warning"]
    assert len(warnings) == 1 and "tokens 0-256" in warnings[0] and "not reused" in warnings[0]
    assert run["usage"]["cached_tokens"] == 0 and run["reply"] == reference[1]["reply"]
    assert run["refused"] == []  # the session's own KV was not refused: no exit 4
    with Store.open(home) as store:
        assert all(v.ok for v in store.verify())  # the save wrote that chunk afresh under its key


# ---------------------------------------------------------------------------- the flag and the setting
@pytest.fixture
def options_seen(tmp_path, monkeypatch):
    """The AgentOptions `run` and `chat` build, over a scripted test double (no model)."""
    monkeypatch.setenv("DSAGENT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DSAGENT_PREFIX_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)
    rt = ScriptedRuntime(["ok"] * 8)
    monkeypatch.setattr(cli, "load_runtime", lambda d, device, weights="plain", gpus=1, engram="device": rt)
    seen, build = [], cli.agent_options
    monkeypatch.setattr(cli, "agent_options", lambda *a, **kw: seen.append(build(*a, **kw)) or seen[-1])
    return seen


@pytest.mark.parametrize("env, flags, expected", [
    (None, [], True), (None, ["--no-prefix-cache"], False), ("0", [], False), ("false", [], False),
    ("0", ["--prefix-cache"], True), ("1", [], True),
])
def test_the_flag_and_the_setting_reach_the_agent(options_seen, monkeypatch, env, flags, expected):
    if env is not None:
        monkeypatch.setenv("DSAGENT_PREFIX_CACHE", env)
    for command in (["run", "hi", "--tool", "calculator"], ["chat", "--tool", "calculator"]):
        r = CliRunner().invoke(cli.app, command + flags, input="/exit\n")
        assert r.exit_code == 0, r.output
        assert options_seen[-1].prefix_cache is expected


def test_a_setting_that_is_not_a_boolean_is_a_usage_error(options_seen, monkeypatch, tmp_path):
    monkeypatch.setenv("DSAGENT_PREFIX_CACHE", "sometimes")
    r = CliRunner().invoke(cli.app, ["run", "hi"])
    assert r.exit_code == 2 and "DSAGENT_PREFIX_CACHE: prefix_cache = 'sometimes' is not a boolean" in r.output
    monkeypatch.delenv("DSAGENT_PREFIX_CACHE")
    (tmp_path / "home").mkdir(exist_ok=True)
    (tmp_path / "home" / "config.toml").write_text("prefix_cache = false\n")
    assert CliRunner().invoke(cli.app, ["run", "hi"]).exit_code == 0 and options_seen[-1].prefix_cache is False
