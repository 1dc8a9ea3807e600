'''The interactive loop of `dsagent chat`: read input, run turns, slash commands.

Owns: reading multi-line input with plain `input()` (a line ending in `\\` continues; a
line `"""` opens a block that the next `"""` line closes), the slash commands, switching
sessions (`/session NAME`, `/fork NAME`, `/clear`), asking the person to approve tool
calls, and what Ctrl-C / Ctrl-D mean at the prompt (Ctrl-C clears the input, Ctrl-D
leaves; Ctrl-C during generation is caught by the agent and keeps the session). Keys
typed while a reply streams are not echoed into it: they come back, editable, at the
next prompt (`dsagent.typeahead`).
Does not own the turn loop (`dsagent.agent`), event rendering (`dsagent.render`) or
loading the model (`dsagent.cli`).
'''
from __future__ import annotations

import contextlib
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dsagent.agent import Agent, AgentOptions
from dsagent.errors import exit_code_for
from dsagent.preflight import read_image
from dsagent.render import Activity, StreamView, stop_note, usage_line
from dsagent.runtime import Runtime
from dsagent.typeahead import TypeAhead, prefill_next_input
from sessions import LocalStatePool, Store, StoreError
from tools import ToolCallRequest, valid_text

PROMPT, MORE = "› ", "… "
BLOCK = '"""'
HELP = """\
/image PATH     attach an image to your next message
/tools          the tools the model may call
/session [NAME] show this session, or switch to NAME (created if new)
/fork NAME      copy this session to NAME and continue there
/stats          tokens, KV bytes and cache state
/clear          start a new, empty session
/help           this list
/exit           leave (Ctrl-D works too)
End a line with \\ to continue it; wrap several lines in \"\"\" ... \"\"\"."""


def read_message(read=input) -> str | None:
    """One message from the person, or None at end of input (Ctrl-D); undecodable bytes
    (surrogate escapes) come back as U+FFFD."""
    message = _read_message(read)
    return None if message is None else valid_text(message)


def _read_message(read) -> str | None:
    try:
        line = read(PROMPT)
    except EOFError:
        return None
    if line.strip() == BLOCK:
        return _read_block(read)
    lines = [line]
    while lines[-1].endswith("\\"):
        lines[-1] = lines[-1][:-1]
        try:
            lines.append(read(MORE))
        except EOFError:
            break
    return "\n".join(lines)


def _read_block(read) -> str:
    lines = []
    while True:
        try:
            line = read(MORE)
        except EOFError:
            break
        if line.strip() == BLOCK:
            break
        lines.append(line)
    return "\n".join(lines)


def terminal_approver(err: Console, read=input, hold=None):
    """An approver that asks on the terminal; anything but y/yes refuses. ``hold(note)`` is a
    context manager that gives the terminal to the question (the live status line down,
    keys echoed again) and prints ``note`` in the status line's place."""
    def approve(request: ToolCallRequest) -> bool:
        action = "writes files" if request.writes else "runs a program"
        note = f"waiting for approval: {request.summary()} ({action})"
        with hold(note) if hold else _printed(err, note):
            try:
                return read("allow [y/N] ").strip().lower() in ("y", "yes")
            except (EOFError, KeyboardInterrupt):
                return False
    return approve


@contextlib.contextmanager
def _printed(err: Console, note: str):
    err.print(note, markup=False, style="bold yellow")
    yield


def new_session_name(store: Store) -> str:
    """A fresh `chat-<time>` name, suffixed when a session of that name exists already."""
    base = time.strftime("chat-%Y%m%d-%H%M%S")
    names = {s.name for s in store.list_sessions()}
    return next(n for n in (base if i == 0 else f"{base}-{i + 1}" for i in range(len(names) + 1)) if n not in names)


class ChatShell:
    """One interactive session at a time over a loaded runtime and an open store."""

    def __init__(self, runtime: Runtime, store: Store, options: AgentOptions, out: Console, err: Console,
                 read=input):
        self.rt, self.store, self.opts = runtime, store, options
        self.out, self.err, self.read = out, err, read
        self.pool = LocalStatePool(ttl_s=600, max_bytes=2**31)
        self.view = StreamView(out, err)
        self.notice = Activity(err, self.view, stdout_is_terminal=out.is_terminal)
        self.typeahead = TypeAhead() if _has_fileno() else None
        self.agent: Agent | None = None
        self.images: list[bytes] = []

    # ------------------------------------------------------------------ sessions
    def open(self, name: str | None) -> None:
        """Close the current session (its state stays in the RAM pool) and open ``name``."""
        name = name or new_session_name(self.store)
        if self.agent is not None and name == self.agent.name:
            return
        agent = Agent(self.rt, self.store, replace(self.opts, session=name), pool=self.pool,
                      on_event=self.notice, approver=terminal_approver(self.err, self.read, self._asking)).open()
        if self.agent is not None:  # only now: a session that fails to open leaves us where we were
            self.agent.close()
        self.agent, self.images = agent, []
        state = "resumed" if self.agent.log else "new"
        self.err.print(f"[dim]session [bold]{escape(name)}[/bold] ({state}, {len(self.agent.log)} tokens)[/]")

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None

    # ------------------------------------------------------------------ the loop
    def loop(self) -> None:
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            # started with Ctrl-C ignored (a script's background job inherits that): the chat
            # is interactive and Ctrl-C is how a reply is stopped, so take it back
            signal.signal(signal.SIGINT, signal.default_int_handler)
        self.err.print("[dim]dsagent chat — /help for commands, Ctrl-D to leave[/]")
        while True:
            try:
                text = read_message(self.read)
            except KeyboardInterrupt:
                self.err.print("\n[dim](input cleared; /exit or Ctrl-D leaves)[/]")
                continue
            if text is None or (text.startswith("/") and self.command(text.strip()) == "exit"):
                return
            if text.strip() and not text.startswith("/"):
                self.turn(text.strip())  # outer whitespace is no part of a message (``preflight.prompt_text``)

    def turn(self, text: str) -> None:
        images, self.images = self.images, []
        typed = self.typeahead or contextlib.nullcontext()
        self.notice.start()
        try:
            with typed:
                result = self.agent.turn(text, images)
        except Exception as e:
            self.error(e)
            return
        except KeyboardInterrupt:
            result = None
        finally:
            self.notice.stop()
            self.view.newline()
            self._keep_typed()
        if result is None or result.stop == "interrupted":
            self.err.print("[yellow]interrupted[/] [dim](the session is kept)[/]")
        else:
            note = stop_note(result.stop, self.opts.max_steps, self.opts.sampling.max_new_tokens)
            if note:
                self.err.print(f"[yellow]{escape(note)}[/]")

    @contextlib.contextmanager
    def _asking(self, note: str):
        """An approval mid-reply: the status line down, the terminal as it was."""
        normal = self.typeahead.normal() if self.typeahead else contextlib.nullcontext()
        with self.notice.paused(note), normal:
            yield

    def _keep_typed(self) -> None:
        """Keys typed during the reply go on the next prompt, editable."""
        text = self.typeahead.text if self.typeahead else ""
        if text and not prefill_next_input(text):
            self.err.print(f"[dim]typed during the reply (not sent): {escape(text)}[/]")

    def error(self, e: BaseException) -> None:
        self.err.print(f"[red]error:[/] {escape(exit_code_for(e)[1])}")

    # ------------------------------------------------------------------ slash commands
    def command(self, line: str) -> str | None:
        name, _, arg = line.partition(" ")
        handler = getattr(self, "cmd_" + name[1:], None)
        if handler is None:
            self.err.print(f"unknown command {escape(name)}; /help lists them")
            return None
        try:
            return handler(arg.strip())
        except (StoreError, OSError, ValueError) as e:
            self.error(e)
            return None

    def cmd_help(self, arg: str) -> None:
        self.err.print(HELP, markup=False)

    def cmd_exit(self, arg: str) -> str:
        return "exit"

    cmd_quit = cmd_exit

    def cmd_image(self, arg: str) -> None:
        if not arg:
            raise ValueError("usage: /image PATH")
        data = read_image(Path(arg), "/image")
        self.rt.image_span(data)  # refuses a bad image now rather than at the next turn
        self.images.append(data)
        self.err.print(f"[dim]image attached ({len(data)} bytes); it goes with your next message[/]")

    def cmd_tools(self, arg: str) -> None:
        tools = list(self.agent.runner.toolbox)
        if not tools:
            return self.out.print("no tools enabled")
        # a grid, so that a long description wraps on words under itself, not mid-word at the edge
        grid = Table.grid(padding=(0, 2))
        grid.add_column(no_wrap=True)
        grid.add_column(overflow="fold")
        for t in tools:
            flag = "\n[yellow](asks first)[/]" if t.needs_approval and self.opts.policy == "ask" else ""
            grid.add_row(f"[bold]{t.name}[/]{flag}", escape(t.description.splitlines()[0]))
        self.out.print(grid, soft_wrap=False)

    def cmd_session(self, arg: str) -> None:
        if arg:
            return self.open(arg)
        info = self.store.get_session(self.agent.name)
        self.out.print(f"{info.name}: {len(self.agent.log)} tokens, {len(self.agent.messages)} messages, "
                       f"model {info.meta.get('model', '?')}, parent {info.parent or '-'}")

    def cmd_fork(self, arg: str) -> None:
        if not arg:
            raise ValueError("usage: /fork NAME")
        self.agent.save()
        self.store.fork(self.agent.name, arg)
        self.open(arg)

    def cmd_clear(self, arg: str) -> None:
        self.open(None)

    def cmd_stats(self, arg: str) -> None:
        s = self.agent.stats()
        self.out.print(f"session {s['session']}: {s['tokens']} tokens in the log, {s['state_tokens']} in the model state")
        self.out.print(f"KV: {s['kv_global_bytes']:,} B global (stored), {s['local_state_bytes']:,} B local (RAM)")
        self.out.print(f"cache: {_cache_state(s['usage'])}; usage: {usage_line(s['usage'])}")


def _cache_state(usage: dict) -> str:
    if usage["cached_tokens"] and usage["replayed_tokens"]:
        return f"resumed from disk ({usage['cached_tokens']} tokens), window replayed ({usage['replayed_tokens']})"
    if usage["cached_tokens"]:
        return f"resumed from the RAM pool ({usage['cached_tokens']} tokens)"
    return "live (built in this process)"


def _has_fileno() -> bool:
    try:
        sys.stdin.fileno()
        return True
    except (OSError, ValueError, AttributeError):  # a test's captured input: no terminal to manage
        return False


def latest_session(store: Store) -> str | None:
    info = store.latest_session()
    return info.name if info else None
