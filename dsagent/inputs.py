"""Text that enters the application from outside: argv and standard input.

Owns turning what Python hands over for undecodable bytes into valid Unicode. Python
decodes argv (and a POSIX-locale stdin) with surrogate escapes, so `dsagent run $'caf\\xe9'`
arrives as 'caf\\udce9', which the tokenizer, JSON output and SQLite all refuse; every
undecodable byte becomes U+FFFD here instead. Does not own tool output or file names
(`tools` cleans those where it reads them).
"""
from __future__ import annotations

import io
import sys

from tools import valid_text


def text_arg(value: str | None) -> str | None:
    """A typer callback for a text argument or option: surrogate escapes become U+FFFD."""
    return None if value is None else valid_text(value)


def tolerant_stdin() -> None:
    """Read undecodable bytes on stdin as surrogate escapes (then U+FFFD) instead of failing."""
    if isinstance(sys.stdin, io.TextIOWrapper):
        sys.stdin.reconfigure(errors="surrogateescape")
