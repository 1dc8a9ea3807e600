"""`dsagent chat` in a real pseudo-terminal (pexpect), with the embedded default model.

Reads the screen: the banner, the prefill indicator, Ctrl-C stopping a reply without
losing the session, slash commands, and a clean exit. Skipped when pexpect is missing.
"""
import os
import sys

import pytest

from sessions import Store

pexpect = pytest.importorskip("pexpect")


MESSAGE = "please read this carefully " * 120


def test_chat_in_a_terminal(tmp_path):
    home = tmp_path / "home"
    env = {**os.environ, "DSAGENT_HOME": str(home), "NO_COLOR": "1", "TERM": "xterm", "COLUMNS": "120"}
    # every built-in tool (a long system prompt) and a long message: the prefill takes seconds
    child = pexpect.spawn(sys.executable, ["-m", "dsagent", "chat", "--session", "tty",
                                           "--max-new-tokens", "400"], env=env, encoding="utf-8", timeout=300,
                          dimensions=(40, 120))
    try:
        child.expect("/help for commands")
        child.expect("› ")
        child.sendline(MESSAGE)
        child.expect("prefilling")  # the prompt takes more than a second
        child.sendcontrol("c")
        child.expect("interrupted")
        child.expect("› ")
        child.sendline("/stats")
        child.expect("tokens in the log")
        child.expect("› ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    with Store.open(home) as st:
        assert st.messages("tty")[1]["content"] == MESSAGE  # the interrupted turn was kept
