"""Exit codes of `dsagent`, and the one place where library errors become messages.

Owns: the exit-code table (documented in the README), `exit_code_for` (error -> code and
the line printed on stderr) and `handled()`, the context manager every command body runs
in. Does not own the errors themselves: `model`, `sessions` and `tools` raise typed
errors whose messages already say what to do; this file only decides the code.

    0   ok
    1   error (a bad checkpoint, a store problem, a failed verify, ...)
    2   usage (bad or conflicting flags or arguments, a setting its flag would refuse, an
        unknown tool, a missing input file or workspace)
    3   approval needed: a tool call was refused because the policy was `ask` and
        nobody could approve it (no terminal); rerun with --yes or --policy yes
    4   cache refused: the run finished, but the session's stored KV failed a check (or was
        made by another model) and was rebuilt from the token log; the warning says why
    130 interrupted (Ctrl-C)
"""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import typer

from dsagent.settings import SettingError
from model.args import ConfigError
from model.checkpoint import CheckpointError
from model.engine import ContextLimitError
from model.vision import ImageError
from sessions import StoreError
from tools import ToolConfigError, UnknownToolError, WorkspaceError

OK, ERROR, USAGE, APPROVAL_NEEDED, CACHE_REFUSED, INTERRUPTED = 0, 1, 2, 3, 4, 130


class UsageError(Exception):
    """A command was called with arguments that cannot work together (exit 2)."""


# Most specific first: ToolConfigError is also a ValueError, ImageError and SettingError too.
_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (UsageError, USAGE),
    (ToolConfigError, USAGE),
    (UnknownToolError, USAGE),
    (WorkspaceError, USAGE),
    (SettingError, USAGE),
    (FileNotFoundError, USAGE),
    (IsADirectoryError, USAGE),
    (ImageError, USAGE),
    (StoreError, ERROR),
    (CheckpointError, ERROR),
    (ConfigError, ERROR),
    (ContextLimitError, ERROR),
    (ValueError, ERROR),
    (OSError, ERROR),
)


def exit_code_for(exc: BaseException) -> tuple[int, str]:
    """(exit code, message) for an error a command let escape; unknown errors are bugs."""
    if isinstance(exc, KeyboardInterrupt):
        return INTERRUPTED, "interrupted"
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code, str(exc) or type(exc).__name__
    return ERROR, f"internal error: {type(exc).__name__}: {exc} (please report this)"


@contextlib.contextmanager
def handled() -> Iterator[None]:
    """Run a command body; a library error becomes `error: ...` on stderr and its exit code."""
    try:
        yield
    except (typer.Exit, typer.Abort, SystemExit):
        raise
    except (Exception, KeyboardInterrupt) as exc:
        code, message = exit_code_for(exc)
        print(f"error: {message}" if code != INTERRUPTED else message, file=sys.stderr)
        raise typer.Exit(code) from None
