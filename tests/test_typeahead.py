"""Keys typed while a chat reply streams (`dsagent.typeahead`), on a real pseudo-terminal.

The test plays the person on the pty's master side: what it types during a reply must not
be echoed into the output, and must come back as text for the next prompt.
"""
import os
import select

import pytest

termios = pytest.importorskip("termios")

from dsagent.typeahead import TypeAhead, clean  # noqa: E402


def _echoed(master: int) -> bytes:
    out = b""
    while select.select([master], [], [], 0.2)[0]:
        out += os.read(master, 1024)
    return out


@pytest.fixture
def pty():
    master, slave = os.openpty()
    yield master, slave
    os.close(master)
    os.close(slave)


def test_keys_typed_during_a_reply_are_kept_and_not_echoed(pty):
    master, slave = pty
    with TypeAhead(slave) as typed:
        os.write(master, b"next que")
        os.write(master, b"stion\x7f\x7fon")
        assert _echoed(master) == b""  # nothing lands in the reply's text
    assert typed.text == "next question"
    attrs = termios.tcgetattr(slave)
    assert attrs[3] & termios.ECHO and attrs[3] & termios.ICANON  # the terminal is as it was
    os.write(master, b"x")
    assert _echoed(master) == b"x"  # echo is back


def test_an_approval_mid_reply_gets_a_normal_terminal_and_keeps_earlier_keys(pty):
    master, slave = pty
    with TypeAhead(slave) as typed:
        os.write(master, b"later")
        with typed.normal():
            assert termios.tcgetattr(slave)[3] & termios.ECHO
            os.write(master, b"y\n")
            assert os.read(slave, 100) == b"y\n"  # the answer, not what was typed before
        assert not termios.tcgetattr(slave)[3] & termios.ECHO
    assert typed.text == "later"


def test_no_terminal_no_change(tmp_path):
    with open(tmp_path / "f", "w") as f, TypeAhead(f.fileno()) as typed:
        pass
    assert typed.text == ""


@pytest.mark.parametrize("raw, text", [("abc\x1b[Adef", "abcdef"), ("line one\rline two\n", "line one line two"),
                                       ("ab\x7fc", "ac"), ("\x1bOPx\x03y", "xy"), ("  ", "")])
def test_clean_keeps_printable_text(raw, text):
    assert clean(raw) == text
