"""`dsagent sessions ...` through typer's CliRunner, on a store in DSAGENT_HOME: every command,
a damaged session found and repaired, and store problems (a directory where the file should
be, a read-only store, an export into a missing folder) as messages and exit codes."""

import json

import pytest
from typer.testing import CliRunner

from dsagent.commands.sessions import app
from sessions import KVChunk, Store
from sessions import store as store_mod

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


def flat(text: str) -> str:
    """Output with rich's error box and its line wrapping taken out."""
    return " ".join(text.replace("│", " ").replace("╭", " ").replace("╰", " ").split())


def test_list_show_storage(home):
    r = run("list")
    assert r.exit_code == 0 and r.stdout.splitlines()[1].split()[:1] + r.stdout.splitlines()[1].split()[-4:-2] == [
        "a", "1", "12"]
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
    r = run("export", "a", "-f", "html")
    assert r.exit_code == 2 and "'html'" in r.stderr  # a usage error naming the value (the box wraps the rest)


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


def _damage_row(home, name, seq):
    with Store.open() as st:
        st.conn.execute("update messages set body = 'garbage' where seq = ? and session_id ="
                        " (select id from sessions where name = ?)", [seq, name])


def _turn(st, name, k):
    st.save_point(name, messages=[{"role": "user", "content": f"q{k}"}, {"role": "assistant", "content": f"a{k}"}],
                  new_tokens=list(range(12 + 5 * k, 17 + 5 * k)), fingerprint=FP, chunk_tokens=C)


def test_verify_names_a_damaged_row_and_repair_asks_then_cuts_back(home):
    with Store.open() as st:
        st.create_session("b", fingerprint=FP)
        for k in range(3):
            _turn(st, "a", k)
    _damage_row(home, "a", 4)
    r = run("verify")
    assert r.exit_code == 1 and "message row 4 is not JSON" in r.stdout
    assert "--repair would keep 3 message(s) and 17 token(s); drop 4 message(s), 10 token(s)" in r.stdout
    assert "b " in r.stdout and "ok" in r.stdout.split("b ", 1)[1].splitlines()[0]  # the other session is fine
    r = run("export", "a")
    assert r.exit_code == 1 and "session 'a': message row 4" in r.stderr and "Traceback" not in r.output
    assert run("export", "b").exit_code == 0
    r = run("verify", "--repair", "--dry-run")
    assert r.exit_code == 1 and "would repair a: keep 3 message(s)" in r.stdout
    r = run("verify", "a", "--repair", input="\n")
    assert r.exit_code == 1 and "aborted" in r.stderr
    assert json.loads(run("show", "a", "--json").stdout)["session"]["n_messages"] == 7  # nothing changed
    r = run("verify", "--repair", "--yes")
    assert r.exit_code == 0 and "repaired a: keep 3 message(s)" in r.stdout
    assert run("verify").exit_code == 0 and run("export", "a", "-f", "jsonl").stdout.count("\n") == 3


def test_verify_repair_flags_go_together(home):
    for flags in (["--yes"], ["--dry-run"]):
        r = run("verify", *flags)
        assert r.exit_code == 2 and "--repair" in r.output
    assert "nothing to repair" in run("verify", "--repair", "--yes").stdout


def test_export_into_a_missing_folder_is_refused_naming_the_flag(home, tmp_path):
    r = run("export", "a", "-o", str(tmp_path / "no" / "such" / "t.md"))
    assert r.exit_code == 2 and "--output" in flat(r.output) and "does not exist" in flat(r.output)
    r = run("export", "a", "-o", str(tmp_path))
    assert r.exit_code == 2 and "is a directory" in flat(r.output)


def test_a_store_file_that_is_a_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("DSAGENT_HOME", str(tmp_path))
    (tmp_path / "sessions.db").mkdir()
    for command in (["list"], ["verify"], ["show", "a"]):
        r = run(*command)
        assert r.exit_code == 1 and "is a directory, not the session store" in r.stderr, (command, r.output)


def test_a_read_only_store(home, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(store_mod, "_writable", lambda p: False)
        assert "a " in run("list").stdout and run("show", "a").exit_code == 0
        assert "hello there" in run("export", "a").stdout and run("storage").exit_code == 0
        assert run("verify").exit_code == 0 and "nothing to repair" in run("verify", "--repair").stdout
        for command in (["rm", "a", "--yes"], ["fork", "a", "b"], ["prune", "--older-than", "0", "--yes"], ["gc"]):
            r = run(*command)
            assert r.exit_code == 1 and f"the store is read-only: {home / 'sessions.db'}" in r.stderr, (command, r.output)
    assert [s["name"] for s in json.loads(run("list", "--json").stdout)] == ["a"]


def test_show_prints_a_dash_for_no_parent_and_metadata_as_lines(tmp_path, monkeypatch):
    monkeypatch.setenv("DSAGENT_HOME", str(tmp_path))
    with Store.open() as st:
        st.create_session("m", fingerprint=FP, meta={"model": "tiny", "seed": 3})
    out = run("show", "m").stdout
    assert "parent:              –" in out and "None" not in out
    assert "  model: tiny\n" in out and "  seed: 3\n" in out and "{" not in out


def test_list_has_a_header_and_a_clipped_preview(home, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    with Store.open() as st:
        st.create_session("long", fingerprint=FP)
        st.save_point("long", messages=[{"role": "system", "content": "be brief"},
                                        {"role": "user", "content": "word " * 40}], fingerprint=FP, chunk_tokens=C)
    lines = run("list").stdout.splitlines()
    assert lines[0].split() == ["NAME", "UPDATED", "MSGS", "TOKENS", "FIRST", "MESSAGE"]
    row = {line.split()[0]: line for line in lines[1:]}
    assert row["a"].endswith("hello there")
    assert row["long"].endswith("…") and len(row["long"]) == 80 and "be brief" not in row["long"]


def test_list_on_an_empty_store(tmp_path, monkeypatch):
    monkeypatch.setenv("DSAGENT_HOME", str(tmp_path))
    r = run("list")
    assert r.exit_code == 0 and r.stdout == "no sessions yet\n"


def test_markdown_export_shows_images_and_calls_readably(tmp_path, monkeypatch):
    import hashlib

    monkeypatch.setenv("DSAGENT_HOME", str(tmp_path))
    png = b"\x89PNG" + b"\0" * 96
    sha = hashlib.sha256(png).hexdigest()
    call = {"type": "function", "id": "call_0_0",
            "function": {"name": "calculator", "arguments": '{"expression": "48 * 12"}'}}
    messages = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"sha256:{sha}"}},
                                     {"type": "text", "text": "what is 48 * 12?"}]},
        {"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": [call]},
        {"role": "tool", "content": "576"},
        {"role": "assistant", "content": "", "tool_calls": []},  # nothing to show: no heading
    ]
    with Store.open() as st:
        st.create_session("img", fingerprint=FP)
        st.save_point("img", messages=messages, images={sha: png}, fingerprint=FP, chunk_tokens=C)
    out = run("export", "img").stdout
    assert f"![image](sha256:{sha[:12]}…) (100 bytes)\n" in out
    assert '→ calculator({"expression": "48 * 12"})\n' in out and '"id"' not in out
    assert out.count("## ") == 3 and "## assistant\n\n## " not in out and not out.rstrip().endswith("## assistant")
