"""The limits a tool call runs under, and what a tool hands back.

Owns `ToolContext` (the workspace, timeout and output cap passed to a tool that asks
for it), `ToolOutput` (text plus images a tool may return), head-and-tail output
capping, making text valid Unicode (`valid_text`), and running a Python function against
a deadline. Does not own approvals or turning failures into results (runner.py), nor
path rules (workspace.py).
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Any, Callable

from tools.errors import ToolError, ToolTimeoutError
from tools.workspace import Workspace


@dataclass(frozen=True)
class ToolContext:
    """What a tool may know about where and how it runs; injected, never in the schema."""

    workspace: Workspace
    timeout_s: float = 30.0  # wall-clock seconds one call may take
    output_cap: int = 16_000  # characters of text the model gets back from one call


@dataclass(frozen=True)
class ToolOutput:
    """A tool's answer when plain text is not enough: images, or a pre-truncated text."""

    text: str
    images: tuple[bytes, ...] = ()
    truncated: bool = False  # the tool already dropped part of its output


_SURROGATES = re.compile("[\ud800-\udfff]")


def valid_text(text: str) -> str:
    """`text` with each surrogate replaced by U+FFFD. Python carries an undecodable byte (of
    argv, a file name, a pipe read with surrogateescape) as a lone surrogate, which is not
    Unicode: the tokenizer, JSON output and SQLite all refuse it."""
    return _SURROGATES.sub("\ufffd", text)


def cap_text(text: str, cap: int) -> tuple[str, bool]:
    """Keep the head and the tail of `text` within about `cap` chars; say what was cut."""
    if len(text) <= cap:
        return text, False
    head = cap // 2
    tail = cap - head
    dropped = len(text) - head - tail
    return f"{text[:head]}\n[... {dropped} chars truncated ...]\n{text[len(text) - tail:]}", True


def call_with_deadline(fn: Callable[[], Any], timeout_s: float) -> Any:
    """Run `fn` on a worker thread; raise `ToolTimeoutError` if it misses the deadline.

    Python cannot kill a thread, so a late call is abandoned (a daemon thread that
    finishes on its own); tools that start processes enforce their own timeout.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except Exception as exc:
            box["error"] = exc
        except BaseException as exc:  # SystemExit from a tool must not end the agent
            box["error"] = ToolError(f"the tool raised {type(exc).__name__}")

    worker = threading.Thread(target=target, name="dsagent-tool", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise ToolTimeoutError(f"the tool did not finish within {timeout_s:g} s and was abandoned")
    if "error" in box:
        raise box["error"]
    return box.get("value")
