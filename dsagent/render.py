"""Agent events on the terminal, and as JSON lines for scripts.

Owns: the two rich consoles (data on stdout, everything else on stderr; `NO_COLOR`
honoured), `StreamView` (streamed answer text, dim reasoning, tool calls and results,
warnings), `JsonlWriter` (one JSON object per event), the model-loading progress bar,
`Activity` (the one live status line on stderr: prefilling with tokens/s, generating
with a token count, calling a tool by name, waiting for approval), what is said when a
run stops at a limit, and what a closed stdout becomes (`OutputClosed`).
Does not own the turn loop (`dsagent.agent`) or what a command does with a result.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import IO, Callable, Iterator

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from dsagent.failures import OutputClosed, silence_stdout

STATUS_DELAY_S = 1.0  # work shorter than this shows no status line (no flicker on short steps)


class _DataConsole(Console):
    """The stdout console. rich ends the process with SystemExit(1) when a write finds the
    pipe closed; here that becomes `OutputClosed`, which stops the turn the way Ctrl-C does
    (the reply closed and the session saved) and ends the command quietly."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        silence_stdout()
        raise OutputClosed()


def consoles(stdout: IO | None = None, stderr: IO | None = None) -> tuple[Console, Console]:
    """(data console on stdout, message console on stderr)."""
    no_color = bool(os.environ.get("NO_COLOR"))
    out = _DataConsole(file=stdout or sys.stdout, no_color=no_color, highlight=False, soft_wrap=True)
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
    """One JSON object per line, flushed at once so a reader sees events live. `generating`
    (a running token count) is terminal progress, not data: it is not written."""

    QUIET = frozenset({"generating"})

    def __init__(self, stream: IO | None = None):
        self.stream = stream or sys.stdout

    def __call__(self, event: dict) -> None:
        if event["event"] in self.QUIET:
            return
        self.stream.write(json.dumps(event, ensure_ascii=False) + "\n")
        self.stream.flush()


def stop_note(stop: str, max_steps: int | None = None, max_new_tokens: int | None = None) -> str | None:
    """What to say on stderr when a turn ended at a limit rather than with an answer."""
    if stop == "max_steps":
        n = f" {max_steps}" if max_steps else ""
        return (f"stopped at --max-steps{n}: the model was still calling tools and gave no final answer; "
                "raise --max-steps to let it go on")
    if stop == "max_tokens":
        n = f" {max_new_tokens}" if max_new_tokens else ""
        return f"the reply was cut short at --max-new-tokens{n}; raise --max-new-tokens for a longer one"
    return None


@contextmanager
def load_progress(err: Console, what: str, unit: str = "tensors") -> Iterator:
    """A transient progress bar on stderr ("loading model 41/519 tensors"); yields the
    ``progress(done, total)`` callback. Not on a file or pipe: a log gets no bar (rich
    would leave an empty line there)."""
    if not err.is_terminal:
        yield lambda done, total: None
        return
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
               TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task(what, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


class Activity:
    """Wraps an event callback and keeps one live status line on stderr saying what the turn
    is doing: ``prefilling 1,024/2,204 tokens · 1,850 tokens/s``, ``generating · 37 tokens``,
    ``calling read_file``; `paused()` takes it down while the person is asked to approve.

    The line appears only on a terminal, and only after `STATUS_DELAY_S` of one activity.
    While the answer streams to the same terminal (stdout and stderr both a terminal), or
    reasoning streams on stderr, it stays down: a line redrawn under text being written
    would tear that text. ``show=False`` passes events through and shows nothing.

    A reader of stdout that went away (BrokenPipeError while an event is written) becomes
    `OutputClosed`, once; later events are not written (see `closed`)."""

    def __init__(self, err: Console, on_event: Callable[[dict], None], show: bool = True,
                 stdout_is_terminal: bool | None = None, clock: Callable[[], float] = time.monotonic):
        self.err, self.on_event, self.clock = err, on_event, clock
        self.show = show and err.is_terminal
        shared = sys.stdout.isatty() if stdout_is_terminal is None else stdout_is_terminal
        self._text_tears_line = shared  # the answer's text shares the terminal with the line
        self.closed = False
        self._lock = threading.Lock()
        self._live: Live | None = None
        self._timer: threading.Timer | None = None
        self._held = False  # text is streaming: no line until the next tool call
        self._since = clock()
        self._what = ""
        self._prefill, self._prefill_started = (0, None), clock()
        self._tokens: int | None = None

    # ------------------------------------------------------------------ what the line says
    def status(self) -> str:
        """The line's text now (also what tests read)."""
        now = self.clock()
        if self._what == "prefill":
            done, total = self._prefill
            rate = done / max(now - self._prefill_started, 1e-9) if done else None
            line = f"prefilling {done:,}/{total:,} tokens" if total else "prefilling"
            return line + (f" · {rate:,.0f} tokens/s" if rate else "")
        if self._what == "generate":
            if self._tokens is not None:
                return f"generating · {self._tokens:,} tokens"
            return f"generating · {now - self._since:.0f} s"
        if self._what.startswith("tool:"):
            return f"calling {self._what[5:]} · {now - self._since:.0f} s"
        return self._what

    def _set(self, what: str) -> None:
        if what != self._what:
            self._what, self._since = what, self.clock()
        self._redraw()

    # ------------------------------------------------------------------ the live line
    def start(self) -> None:
        """A model call begins: its prompt is prefilled first."""
        with self._lock:
            self._held, self._tokens = False, None
            self._prefill, self._prefill_started = (0, None), self.clock()
            self._set("prefill")
            self._arm()

    def _arm(self) -> None:
        if self.show and self._timer is None and self._live is None:
            self._timer = threading.Timer(STATUS_DELAY_S, self._appear)
            self._timer.daemon = True
            self._timer.start()

    def _appear(self) -> None:
        with self._lock:
            self._timer = None
            if self.show and self._live is None and self._what and not self._held:
                self._live = Live(Text(self.status(), style="dim"), console=self.err, transient=True,
                                  refresh_per_second=4, get_renderable=lambda: Text(self.status(), style="dim"))
                self._live.start()

    def _redraw(self) -> None:
        if self._live is not None:
            self._live.refresh()

    def _down(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._live is not None:
            self._live.stop()
            self._live = None

    def stop(self) -> None:
        """The turn is over: take the line down."""
        with self._lock:
            self._what = ""
            self._down()

    @contextmanager
    def paused(self, note: str | None = None) -> Iterator[None]:
        """Take the line down while something else owns the terminal (an approval prompt);
        ``note`` is printed in its place."""
        with self._lock:
            self._down()
        if note:
            self.err.print(note, markup=False, style="bold yellow")
        try:
            yield
        finally:
            with self._lock:
                if self._what and not self._held:
                    self._arm()

    # ------------------------------------------------------------------ events
    def _track(self, event: dict) -> None:
        kind = event["event"]
        if kind == "prefill":
            self._prefill = (event["done"], event["total"])
            # the whole prompt is in: what follows is generation (its first tokens may be a
            # tool call, which shows nothing), not a prefill whose rate decays
            self._set("generate" if event["total"] and event["done"] >= event["total"] else "prefill")
        elif kind == "generating":
            self._tokens = event["tokens"]
            self._set("generate")
        elif kind in ("token", "reasoning"):
            if self._what != "generate":
                self._set("generate")
            if kind == "reasoning" or self._text_tears_line:
                self._held = True
                self._down()
        elif kind == "tool_call":
            self._held = False
            self._set("tool:" + event["name"])
            self._arm()
        elif kind == "tool_result":  # the results are prefilled next
            self._held, self._tokens = False, None
            self._prefill, self._prefill_started = (0, None), self.clock()
            self._set("prefill")
            self._arm()
        if kind in ("prefill", "generating") and not self._held:
            self._arm()

    def __call__(self, event: dict) -> None:
        with self._lock:
            self._track(event)
            live = self._live is not None
        if self.closed:
            return
        try:
            if live and event["event"] in ("tool_call", "tool_result", "warning", "tool_error"):
                with self.paused():  # a whole line printed above the status line, then it is back
                    self.on_event(event)
            else:
                self.on_event(event)
        except (BrokenPipeError, OutputClosed):
            self.closed = True
            silence_stdout()
            raise OutputClosed() from None
