"""End to end with the real model: the embedded default checkpoint, two processes.

Process 1: `dsagent chat --session S` takes two turns from piped input and exits.
Process 2: `dsagent run --session S --json` resumes from disk and takes a third turn; its
usage shows the stored KV was used (cached tokens) and the window replayed.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

from sessions import Store

ARGS = ["--tool", "calculator", "--max-new-tokens", "4"]


def dsagent(home, *args, input=None):
    env = {k: v for k, v in os.environ.items() if k not in ("DSAGENT_MODEL", "DSAGENT_PRESET")}  # the embedded default
    env.update(DSAGENT_HOME=str(home), NO_COLOR="1")
    stdin = None if input is not None else subprocess.DEVNULL  # run reads a stdin that is not a terminal
    return subprocess.run([sys.executable, "-m", "dsagent", *args], input=input, capture_output=True, text=True,
                          env=env, timeout=300, stdin=stdin)


def _env(home) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("DSAGENT_MODEL", "DSAGENT_PRESET")}
    env.update(DSAGENT_HOME=str(home), NO_COLOR="1")
    return env


def test_two_turns_exit_resume_third_turn(tmp_path):
    home = tmp_path / "home"
    first = dsagent(home, "chat", "--session", "S", *ARGS, input="What is 2+3?\nAnd 4*5?\n/exit\n")
    assert first.returncode == 0, first.stderr
    with Store.open(home) as st:
        assert [m["role"] for m in st.messages("S")] == ["system", "user", "assistant", "user", "assistant"]
        logged = st.get_session("S").n_tokens
    third = dsagent(home, "run", "Thanks!", "--session", "S", *ARGS, "--json")
    assert third.returncode == 0, third.stderr
    usage = json.loads(third.stdout)["usage"]
    assert usage["cached_tokens"] > 0 and usage["replayed_tokens"] > 0
    assert usage["cached_tokens"] <= logged and usage["prompt_tokens"] < logged  # no full re-prefill
    with Store.open(home) as st:
        assert st.get_session("S").n_messages == 7


def test_corrupt_stored_kv_is_refused_rebuilt_and_exit_4(tmp_path):
    import sqlite3

    home = tmp_path / "home"
    assert dsagent(home, "run", "What is 2+3?", "--session", "K", *ARGS).returncode == 0
    db = sqlite3.connect(home / "sessions.db")
    key, layer, blob = db.execute("select key, layer, blob from kv_chunks order by start limit 1").fetchone()
    flipped = bytearray(blob)
    flipped[len(flipped) // 2] ^= 0xFF
    db.execute("update kv_chunks set blob = ? where key = ? and layer = ?", (bytes(flipped), key, layer))
    db.commit()
    db.close()
    second = dsagent(home, "run", "And 4*5?", "--session", "K", *ARGS, "--json")
    assert second.returncode == 4, second.stderr  # documented: cache refused, rebuilt from the log
    assert "warning" in second.stderr.lower()
    assert json.loads(second.stdout)["usage"]["cached_tokens"] == 0
    third = dsagent(home, "run", "Thanks", "--session", "K", *ARGS, "--json")
    assert third.returncode == 0, third.stderr  # the rebuilt KV was stored again
    assert json.loads(third.stdout)["usage"]["cached_tokens"] > 0


def test_image_from_the_command_line_is_stored_once_and_spanned(tmp_path):
    from PIL import Image

    home, pic = tmp_path / "home", tmp_path / "red.png"
    Image.new("RGB", (300, 200), (200, 30, 30)).save(pic)
    args = ["--session", "I", "--tool", "calculator", "--max-new-tokens", "2", "--json"]
    first = dsagent(home, "run", "What colour is this?", "--image", str(pic), *args)
    assert first.returncode == 0, first.stderr
    broken = tmp_path / "broken.png"
    broken.write_bytes(pic.read_bytes()[:100])
    refused = dsagent(home, "run", "And this?", "--image", str(broken), *args)
    assert refused.returncode == 2 and "image" in refused.stderr.lower()  # a clear error, session intact
    again = dsagent(home, "run", "Same picture again", "--image", str(pic), *args)
    assert again.returncode == 0, again.stderr
    with Store.open(home) as st:
        loaded = st.load("I", fingerprint="-", chunk_tokens=256)
        assert len(loaded.image_spans) == 2 and loaded.image_spans[0].sha256 == loaded.image_spans[1].sha256
        assert all(s.end - s.start > 2 for s in loaded.image_spans)
        assert st.storage().image_unique_bytes == pic.stat().st_size  # stored once
        assert [m["role"] for m in loaded.messages].count("user") == 2


def test_the_readmes_main_job_answers_through_the_calculator(tmp_path):
    """The README's main job on the embedded default prints what the README says it prints:
    the calculator call and its result on stderr, the answer read back from it on stdout."""
    job = dsagent(tmp_path / "home", "run", "--yes", "What is 48 * 12?")
    assert job.returncode == 0, job.stderr
    call, result = 'calculator({"expression": "48 * 12"})', "ok 576"
    assert call in job.stderr and result in job.stderr
    answer = job.stdout.strip().splitlines()[0]
    assert answer == "48 * 12 = 576."
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    printed = readme.split("The main job prints", 1)[1].split("```", 2)[1]
    assert all(line in printed for line in (call, result, answer))


def test_jsonl_into_a_reader_that_leaves_ends_quietly(tmp_path):
    """`dsagent run --jsonl ... | head -1`: exit 0 or 141 (128 + SIGPIPE), no error line, and
    the turn kept as an interrupted one."""
    home = tmp_path / "home"
    p = subprocess.Popen([sys.executable, "-m", "dsagent", "run", "--yes", "--jsonl", "--session", "J",
                          "What is 48 * 12?"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=_env(home))
    first = json.loads(p.stdout.readline())
    p.stdout.close()  # the reader leaves after one line
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) in (0, 141), err
    assert first["event"] in ("prefill", "token", "tool_call") and err == "", err
    with Store.open(home) as st:
        assert st.get_session("J").n_messages >= 2
