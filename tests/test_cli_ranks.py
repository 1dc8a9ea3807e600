"""``dsagent run --gpus N`` on the CPU (N processes over gloo, this one driving): the embedded
default answers as one process does, sessions move between one process and two with the same
tokens (resumed from stored KV; a new one reusing the stored system prompt), and ``--gpus 0``
is a usage error before anything loads."""
from __future__ import annotations

import json
import os
import subprocess
import sys


def _run(home, *args: str) -> dict:
    env = {**os.environ, "DSAGENT_HOME": str(home), "DSAGENT_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "dsagent", "run", "--yes", "--json", *args], capture_output=True,
                       text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _turn(result: dict) -> tuple:
    return result["text"], result["tool_calls"], result["usage"]["completion_tokens"]


def test_two_ranks_answer_and_their_session_resumes_in_one(tmp_path):
    """The same two turns: the first over two ranks then the second in one process, against
    both in one process (another session of the same store: the prefix cache is off, so each
    first turn prefills the whole prompt)."""
    home, first, second = tmp_path / "home", "What is 48 * 12?", "And what is 7 * 8?"
    split = _run(home, "--gpus", "2", "--no-prefix-cache", "--session", "split", first)
    alone = _run(home, "--no-prefix-cache", "--session", "alone", first)
    assert _turn(split) == _turn(alone) and "576" in split["text"]
    resumed = _run(home, "--session", "split", second)
    continued = _run(home, "--session", "alone", second)
    assert _turn(resumed) == _turn(continued)
    assert resumed["usage"]["cached_tokens"] == continued["usage"]["cached_tokens"] > 0  # its KV came from disk


def test_a_session_resumes_over_two_ranks_and_a_new_one_reuses_the_prefix(tmp_path):
    """Made in one process, resumed over two ranks (its stored KV imported on every rank);
    a new session over two ranks starts from the stored system prompt's chunks: each as in
    one process."""
    home, first, second = tmp_path / "home", "What is 48 * 12?", "And what is 7 * 8?"
    _run(home, "--session", "a", first)
    _run(home, "--session", "b", first)
    split = _run(home, "--gpus", "2", "--session", "a", second)
    alone = _run(home, "--session", "b", second)
    assert _turn(split) == _turn(alone) and split["usage"]["cached_tokens"] > 0
    fresh_split = _run(home, "--gpus", "2", "--session", "c", first)
    fresh_alone = _run(home, "--session", "d", first)
    assert _turn(fresh_split) == _turn(fresh_alone)
    assert fresh_split["usage"]["cached_tokens"] == fresh_alone["usage"]["cached_tokens"] > 0  # the shared prefix


def test_gpus_below_one_is_a_usage_error(tmp_path):
    env = {**os.environ, "DSAGENT_HOME": str(tmp_path / "home")}
    r = subprocess.run([sys.executable, "-m", "dsagent", "run", "--gpus", "0", "hi"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 2 and "--gpus" in r.stderr
    assert not (tmp_path / "home").exists()  # refused before the store was made
