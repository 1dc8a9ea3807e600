"""Cross-process behaviour of the session store: a writer killed at random moments
of its saves, a writer killed inside its transaction, lock contention, and two
writers at once. The child process is tests/sessions_child.py."""

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sessions import SessionInUse, Store

CHILD = Path(__file__).with_name("sessions_child.py")
sys.path.insert(0, str(CHILD.parent))
import sessions_child as child  # noqa: E402


def spawn(*args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(CHILD), *args], stdout=subprocess.PIPE, text=True)
    first = proc.stdout.readline().strip()
    assert first in ("ready", "locked"), first
    return proc


def kill(proc: subprocess.Popen) -> list[str]:
    proc.send_signal(signal.SIGKILL)
    out = proc.stdout.read().split()
    proc.wait()
    return out


def check_consistent(home: Path, name: str, min_turns: int) -> int:
    """The store holds whole turns only, at least `min_turns` of them, all KV valid."""
    with Store.open(home) as store:
        loaded = store.load(name, fingerprint=child.FP, chunk_tokens=child.C)
        n = len(loaded.tokens)
        assert loaded.warnings == []
        assert n % child.TURN == 0 and n // child.TURN == len(loaded.messages) >= min_turns
        assert loaded.tokens == [child.token(p) for p in range(n)]
        assert [m["content"] for m in loaded.messages] == [f"turn {k}" for k in range(n // child.TURN)]
        assert loaded.kv_tokens == n
        assert all(r.ok for r in store.verify(name))
    return n // child.TURN


def test_kill_at_random_points_of_saves_leaves_previous_turn(tmp_path):
    rng = random.Random(1234)
    turns = 0
    for _ in range(24):
        proc = spawn("save", str(tmp_path), "s")
        time.sleep(rng.uniform(0.0, 0.1))
        out = kill(proc)
        reported = [int(v) for v in out if v.isdigit()]
        turns = check_consistent(tmp_path, "s", max(reported, default=-1) + 1)
    assert turns > 5  # the children did make progress between kills


def test_kill_inside_the_transaction(tmp_path):
    subprocess.run([sys.executable, str(CHILD), "save", str(tmp_path), "s", "2"], check=True, capture_output=True)
    proc = subprocess.run([sys.executable, str(CHILD), "die-in-tx", str(tmp_path), "s"], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL
    assert check_consistent(tmp_path, "s", 2) == 2


def test_second_process_gets_session_in_use(tmp_path):
    with Store.open(tmp_path) as store:
        store.create_session("s", fingerprint=child.FP)
    proc = spawn("hold", str(tmp_path), "s", "30")
    try:
        with Store.open(tmp_path) as store:
            with pytest.raises(SessionInUse, match=f"process {proc.pid}"):
                store.save_point("s", new_tokens=[1], fingerprint=child.FP, chunk_tokens=child.C)
            t0 = time.monotonic()
            with pytest.raises(SessionInUse):
                with store.lock("s", timeout=0.3):
                    pass
            assert time.monotonic() - t0 >= 0.3
    finally:
        kill(proc)
    with Store.open(tmp_path) as store:  # the dead holder's lock is reclaimed
        store.save_point("s", new_tokens=[1], fingerprint=child.FP, chunk_tokens=child.C)


def test_lock_waits_for_holder_within_timeout(tmp_path):
    proc = spawn("hold", str(tmp_path), "s", "0.4")
    with Store.open(tmp_path) as store:
        with store.lock("s", timeout=10):
            pass
    proc.wait()


def test_two_writers_on_different_sessions_do_not_interleave(tmp_path):
    proc = subprocess.Popen([sys.executable, str(CHILD), "save", str(tmp_path), "a", "15"], stdout=subprocess.PIPE)
    with Store.open(tmp_path, lock_timeout=5.0) as store:
        state = child.resume(store, "b")
        for _ in range(15):
            state = child.turn(store, "b", *state)
    assert proc.wait(timeout=60) == 0
    assert check_consistent(tmp_path, "a", 15) == 15
    assert check_consistent(tmp_path, "b", 15) == 15
