"""Keys typed while a chat reply streams: kept for the next prompt, never echoed into the reply.

Owns: `TypeAhead`, which for the length of a reply turns the terminal's echo and line
editing off (so a key pressed mid-reply does not land inside the reply's text), then reads
what was typed and hands it back as text for the next prompt, where the person sees it
already typed and can edit or send it (readline's pre-input hook). Ctrl-C still
interrupts: signals stay on. Does nothing where stdin is not a terminal.

Only printable text is kept: a line typed and ended with Enter comes back as that text
(not sent by itself: the person sees it first), escape sequences (arrow keys) are dropped.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
from typing import Iterator

try:
    import termios
except ImportError:  # not a POSIX terminal: nothing to switch off
    termios = None

_ESCAPES = re.compile(r"\x1b(\[[0-9;?]*[ -/]*[@-~]|O.|.)?")
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def clean(typed: str) -> str:
    """Printable text of what was typed: escape sequences and controls dropped, Enter as a
    space, a backspace taking back the character before it."""
    text = _ESCAPES.sub("", typed).replace("\r", "\n")
    out: list[str] = []
    for ch in text:
        if ch == "\x7f" or ch == "\b":
            if out:
                out.pop()
        elif ch == "\n":
            out.append(" ")
        elif not _CONTROLS.match(ch):
            out.append(ch)
    return "".join(out).strip()


class TypeAhead:
    """`with TypeAhead(fd) as t: ...reply streams...`; afterwards `t.text` is what was typed."""

    def __init__(self, fd: int | None = None):
        self.fd = sys.stdin.fileno() if fd is None else fd
        self.text = ""
        self._saved = None

    def _tty(self) -> bool:
        try:
            return termios is not None and os.isatty(self.fd)
        except (OSError, ValueError):
            return False

    def __enter__(self) -> "TypeAhead":
        self.text = ""
        if self._tty():
            self._saved = termios.tcgetattr(self.fd)
            quiet = termios.tcgetattr(self.fd)
            quiet[3] &= ~(termios.ECHO | termios.ICANON)  # lflag: no echo, bytes readable at once
            quiet[6][termios.VMIN], quiet[6][termios.VTIME] = 0, 0  # a read never waits
            termios.tcsetattr(self.fd, termios.TCSANOW, quiet)
        return self

    def collect(self) -> None:
        """Take what has been typed so far (without waiting) into `text`."""
        if self._saved is None:
            return
        chunks = []
        while True:
            try:
                data = os.read(self.fd, 4096)
            except (BlockingIOError, InterruptedError):
                break
            if not data:
                break
            chunks.append(data)
        typed = clean(b"".join(chunks).decode("utf-8", errors="replace"))
        self.text = f"{self.text} {typed}".strip() if typed else self.text

    def __exit__(self, *exc) -> None:
        if self._saved is not None:
            self.collect()
            termios.tcsetattr(self.fd, termios.TCSANOW, self._saved)
            self._saved = None

    @contextlib.contextmanager
    def normal(self) -> Iterator[None]:
        """The terminal as it was, for a question asked mid-reply (an approval): what was
        typed before it is kept for the next prompt, not taken as the answer."""
        if self._saved is None:
            yield
            return
        self.collect()
        quiet = termios.tcgetattr(self.fd)
        termios.tcsetattr(self.fd, termios.TCSANOW, self._saved)
        try:
            yield
        finally:
            termios.tcsetattr(self.fd, termios.TCSANOW, quiet)


def prefill_next_input(text: str) -> bool:
    """Put ``text`` on the next `input()` line, editable, through readline; False where
    readline is missing (the caller then says what was typed)."""
    try:
        import readline
    except ImportError:
        return False

    def hook() -> None:
        readline.insert_text(text)
        readline.redisplay()
        readline.set_pre_input_hook(None)

    readline.set_pre_input_hook(hook)
    return True
