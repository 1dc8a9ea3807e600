"""How a command body ends when something goes wrong, without importing torch to say so.

Owns: `guarded()`, the context manager every command body of `dsagent.cli` runs in, and
`OutputClosed`, what a closed stdout (`dsagent run --jsonl | head -1`) becomes. A
`SettingError` (a bad flag, setting or argument, refused before anything loads) is
printed here with exit 2; a closed stdout ends the command quietly with exit 141 (128 +
SIGPIPE, what a shell reports for a writer whose reader left); everything else goes to
`dsagent.errors.handled`, the one table of exit codes. That module imports the model's
error classes and with them torch, so it is imported only when such an error happens:
`dsagent run --thinking maybe` says no in a fraction of the time.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

import typer

from dsagent.settings import SettingError

USAGE = 2
PIPE_CLOSED = 141  # 128 + SIGPIPE (13)


class OutputClosed(KeyboardInterrupt):
    """The reader of stdout went away (a broken pipe). A KeyboardInterrupt on purpose: the
    agent already stops a turn cleanly on one (the reply closed, the session saved), which
    is what should happen when nobody reads the rest."""


def silence_stdout() -> None:
    """Point stdout at /dev/null, so that nothing written later (and Python's flush at exit)
    raises BrokenPipeError again or prints "Exception ignored"."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # not a real file (a test's capture): nothing to silence
        pass


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    """Run a command body: usage errors exit 2, a closed stdout 141 quietly, the rest as
    `dsagent.errors.handled` decides."""
    try:
        yield
    except (typer.Exit, typer.Abort, SystemExit):
        raise
    except SettingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(USAGE) from None
    except (OutputClosed, BrokenPipeError):
        silence_stdout()
        raise typer.Exit(PIPE_CLOSED) from None
    except (Exception, KeyboardInterrupt) as exc:
        from dsagent.errors import handled

        with handled():
            raise exc
