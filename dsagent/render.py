"""Agent events on the terminal, and as JSON lines for scripts.

Owns: the two rich consoles (data on stdout, everything else on stderr; `NO_COLOR`
honoured), `StreamView` (streamed answer text, dim reasoning, tool calls and results,
warnings), `JsonlWriter` (one JSON object per event), the model-loading progress bar
and the "prefilling" indicator shown when a turn is silent for more than a second.
Does not own the turn loop (`dsagent.agent`) or what a command does with a result.
"""
from __future__ import annotations

import json
import os
import sys
import threading
from contextlib import contextmanager
from typing import IO, Iterator

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

PREFILL_NOTICE_S = 1.0  # a turn silent for longer than this shows the prefill indicator


def consoles(stdout: IO | None = None, stderr: IO | None = None) -> tuple[Console, Console]:
    """(data console on stdout, message console on stderr)."""
    no_color = bool(os.environ.get("NO_COLOR"))
    out = Console(file=stdout or sys.stdout, no_color=no_color, highlight=False, soft_wrap=True)
    err = Console(file=stderr or sys.stderr, no_color=no_color, highlight=False, soft_wrap=True, stderr=True)
    return out, err


class StreamView:
    """Renders agent events as they come: text to ``out``, everything else to ``err``."""

    def __init__(self, out: Console, err: Console):
        self.out, self.err = out, err
        self.at_line_start = True
        self.in_reasoning = False

    def __call__(self, event: dict) -> None:
        kind = event["event"]
        getattr(self, f"_on_{kind}", lambda e: None)(event)

    def _write(self, console: Console, text: str, style: str | None = None) -> None:
        console.print(text, end="", style=style, markup=False, highlight=False)
        self.at_line_start = text.endswith("\n")

    def _on_token(self, e: dict) -> None:
        if self.in_reasoning:
            self.in_reasoning = False
            self.newline()
        self._write(self.out, e["text"])

    def _on_reasoning(self, e: dict) -> None:
        self.in_reasoning = True
        self._write(self.err, e["text"], style="dim italic")

    def _on_tool_call(self, e: dict) -> None:
        self.newline()
        self.err.print(f"[bold cyan]→ {escape(e['name'])}[/]({escape(_short(e['arguments']))})")

    def _on_tool_result(self, e: dict) -> None:
        mark = "[yellow]denied[/]" if e["denied"] else "[green]ok[/]" if e["ok"] else "[red]error[/]"
        self.err.print(f"  {mark} {escape(_short(e['result'], 300))}")

    def _on_tool_error(self, e: dict) -> None:
        self.newline()
        self.err.print(f"[red]tool call not understood:[/] {escape(e['message'])}")

    def _on_warning(self, e: dict) -> None:
        self.newline()
        self.err.print(f"[yellow]warning:[/] {escape(e['message'])}")

    def newline(self) -> None:
        if not self.at_line_start:
            self.out.print()
            self.at_line_start = True


def _short(value, width: int = 160) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def usage_line(usage: dict) -> str:
    return (f"{usage['prompt_tokens']} prompt, {usage['completion_tokens']} completion, "
            f"{usage['cached_tokens']} cached, {usage['replayed_tokens']} replayed tokens")


class JsonlWriter:
    """One JSON object per line, flushed at once so a reader sees events live."""

    def __init__(self, stream: IO | None = None):
        self.stream = stream or sys.stdout

    def __call__(self, event: dict) -> None:
        self.stream.write(json.dumps(event, ensure_ascii=False) + "\n")
        self.stream.flush()


@contextmanager
def load_progress(err: Console, what: str) -> Iterator:
    """A transient progress bar on stderr; yields the ``progress(done, total)`` callback."""
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task(what, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


class PrefillNotice:
    """Wraps an event callback: if no event arrives within a second of `start()`, a spinner
    on stderr says the prompt is being prefilled, until the first event (or `stop()`).
    ``show=False`` (machine-readable output) passes events through and shows nothing."""

    def __init__(self, err: Console, on_event, show: bool = True):
        self.err, self.on_event, self.show = err, on_event, show
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._status = None
        self._done = (0, None)

    def start(self) -> None:
        if self.show and self.err.is_terminal:
            self._timer = threading.Timer(PREFILL_NOTICE_S, self._show)
            self._timer.daemon = True
            self._timer.start()

    def _show(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._status = Progress(TextColumn("prefilling"), BarColumn(), MofNCompleteColumn(),
                                        TextColumn("tokens"), TimeElapsedColumn(), console=self.err,
                                        transient=True)
                self._task = self._status.add_task("prefill", total=self._done[1], completed=self._done[0])
                self._status.start()
                self._status.refresh()  # draw now: short prefills end before the first auto refresh

    def stop(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._status is not None:
                self._status.stop()
                self._status = None

    def _progress(self, event: dict) -> None:
        with self._lock:
            self._done = (event["done"], event["total"])
            if self._status is not None:
                self._status.update(self._task, completed=event["done"], total=event["total"])

    def __call__(self, event: dict) -> None:
        if event["event"] == "prefill":
            self._progress(event)
        elif event["event"] != "usage":
            self.stop()
        self.on_event(event)
        if event["event"] == "tool_result":  # the results are prefilled next
            self.start()
