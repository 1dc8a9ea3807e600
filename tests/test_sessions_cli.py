"""`dsagent sessions ...` through typer's CliRunner, on a store in DSAGENT_HOME."""

import json

import pytest
from typer.testing import CliRunner

from dsagent.commands.sessions import app
from sessions import KVChunk, Store

FP = "fp"
C = 8


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DSAGENT_HOME", str(tmp_path))
    with Store.open() as st:
        st.create_session("a", fingerprint=FP)
        st.save_point("a", messages=[{"role": "user", "content": "hello there"}], new_tokens=list(range(12)),
                      kv_chunks=[KVChunk(0, 8, {"l": b"x" * 80}), KVChunk(8, 12, {"l": b"y" * 40})],
                      fingerprint=FP, chunk_tokens=C)
    return tmp_path


def run(*args, input=None):
    return CliRunner().invoke(app, list(args), input=input)


def test_list_show_storage(home):
    r = run("list")
    assert r.exit_code == 0 and "a " in r.stdout and "12 tokens" in r.stdout
    assert json.loads(run("list", "--json").stdout)[0]["name"] == "a"
    assert json.loads(run("show", "a", "--json").stdout)["storage"]["kv_tokens"] == 12
    assert "n_tokens" in run("show", "a").stdout
    rep = json.loads(run("storage", "--json").stdout)
    assert rep["sessions"][0]["kv_bytes_per_token"] > 0 and rep["file_bytes"] > 0


def test_export_formats(home, tmp_path):
    assert "hello there" in run("export", "a").stdout
    assert json.loads(run("export", "a", "--format", "jsonl").stdout) == {"role": "user", "content": "hello there"}
    out = tmp_path / "t.json"
    assert run("export", "a", "-f", "json", "-o", str(out)).exit_code == 0
    assert json.loads(out.read_text())["session"]["name"] == "a"


def test_fork_rm_asks_default_no(home):
    assert run("fork", "a", "b").exit_code == 0
    r = run("rm", "b", input="\n")
    assert r.exit_code == 1 and "aborted" in r.stderr
    assert "would remove b" in run("rm", "b", "--dry-run").stdout
    assert run("rm", "b", "--yes").exit_code == 0
    assert [s["name"] for s in json.loads(run("list", "--json").stdout)] == ["a"]


def test_prune_dry_run_and_yes(home):
    assert "would remove a" in run("prune", "--older-than", "0", "--dry-run").stdout
    assert run("prune", "--older-than", "0", input="n\n").exit_code == 1
    assert "removed a" in run("prune", "--older-than", "0", "--yes").stdout
    assert run("list", "--json").stdout.strip() == "[]"


@pytest.mark.parametrize("days", ["-1", "nan", "inf"])
def test_prune_refuses_a_bad_age_before_touching_the_store(home, days):
    r = run("prune", "--older-than", days, "--yes")
    assert r.exit_code == 2 and "--older-than" in r.output
    assert [s["name"] for s in json.loads(run("list", "--json").stdout)] == ["a"]


def test_verify_and_gc(home):
    assert run("verify").exit_code == 0
    with Store.open() as st:
        st.conn.execute("update kv_chunks set blob = substr(blob, 1, length(blob) - 3) where start = 8")
    r = run("verify", "a", "--json")
    assert r.exit_code == 1 and json.loads(r.stdout)[0]["bad_chunks"] == 1
    assert json.loads(run("gc", "--dry-run", "--json").stdout)["kv_rows"] == 0
    assert "freed" in run("gc").stdout


def test_errors_go_to_stderr_with_exit_1(home):
    r = run("show", "nope")
    assert r.exit_code == 1 and "no session named 'nope'" in r.stderr and r.stdout == ""
    for command in ("show", "export", "verify", "rm"):  # a name with a byte that is not UTF-8
        r = run(command, "caf\udce9")
        assert r.exit_code == 1 and "no session named 'caf\ufffd'" in r.stderr, command
    (home / "sessions.db").unlink()
    for p in home.glob("sessions.db-*"):
        p.unlink()
    (home / "sessions.db").write_text("not a database")
    r = run("list")
    assert r.exit_code == 1 and "not an SQLite database" in r.stderr
