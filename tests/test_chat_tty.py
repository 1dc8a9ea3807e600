"""`dsagent chat` in a real pseudo-terminal (pexpect), with the embedded default model.

Reads the screen: the banner, the prefill indicator, Ctrl-C stopping a reply without
losing the session, slash commands, keys typed during a reply, and a clean exit. Skipped
when pexpect is missing.
"""
import os
import signal
import sys

import pytest

from sessions import Store

pexpect = pytest.importorskip("pexpect")


LINE = "please read this carefully " * 120  # one line stays under the terminal's 4,096-byte line limit
LINES = 6  # continued with a trailing backslash: ~7K message tokens, a prefill of seconds on any CPU


def _send_long_prompt(child) -> None:
    """``LINES`` lines of ``LINE``, continued with a backslash: a prompt whose prefill takes seconds."""
    for _ in range(LINES - 1):
        child.sendline(LINE + "\\")
        child.expect("… ")
    child.sendline(LINE)


def _chat(home, *args: str, **options):
    """``dsagent chat *args`` in a 40 x 120 pseudo-terminal, its store in ``home``."""
    env = {**os.environ, "DSAGENT_HOME": str(home), "NO_COLOR": "1", "TERM": "xterm", "COLUMNS": "120"}
    return pexpect.spawn(sys.executable, ["-m", "dsagent", "chat", *args], env=env, encoding="utf-8", timeout=300,
                         dimensions=(40, 120), **options)


def _leave(child) -> None:
    """At the next prompt, /exit; the chat ends."""
    child.expect("› ")
    child.sendline("/exit")
    child.expect(pexpect.EOF)


def test_chat_in_a_terminal(tmp_path):
    home = tmp_path / "home"
    # every built-in tool (a long system prompt) and a long message: the prefill takes seconds,
    # so Ctrl-C lands inside it (with one line it took ~1 s, close to when the indicator shows)
    # started with SIGINT ignored, as a background job of a script would be: the chat takes
    # Ctrl-C back (without that, this test hung in a CI run launched in the background)
    child = _chat(home, "--session", "tty", "--max-new-tokens", "400",
                  preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        child.expect("/help for commands")
        child.expect("› ")
        _send_long_prompt(child)
        child.expect("prefilling")  # the prompt takes more than a second
        child.sendcontrol("c")
        child.expect("interrupted")
        child.expect("› ")
        child.sendline("/stats")
        child.expect("tokens in the log")
        _leave(child)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    with Store.open(home) as st:
        # the interrupted turn was kept (less the last line's trailing space: a message's outer whitespace goes)
        assert st.messages("tty")[1]["content"] == "\n".join([LINE] * LINES).strip()


def test_keys_typed_during_a_reply_wait_for_the_next_prompt(tmp_path):
    """Typed mid-turn, "abc" is not echoed into the reply; the next prompt holds it, editable,
    and Enter sends it."""
    home = tmp_path / "home"
    child = _chat(home, "--session", "keys", "--max-new-tokens", "24")
    try:
        child.expect("› ")
        _send_long_prompt(child)
        child.expect("prefilling")  # the turn has begun: keys from here on are held back
        child.send("abc")
        child.expect("› ")  # the reply ends at the next prompt
        assert "abc" not in child.before  # not echoed into the reply
        child.expect("abc")  # but put back on the prompt line
        child.sendline("")
        _leave(child)
    finally:
        child.close(force=True)
    with Store.open(home) as st:
        users = [m["content"] for m in st.messages("keys") if m["role"] == "user"]
    assert users[-1] == "abc"
