"""Checks of `run` and `chat` arguments that come before anything loads or is stored.

Owns: refusing, with a `FlagError` (exit 2) that names the flag, a seed torch cannot take,
a bad session name, an unknown tool, a workspace that is not a directory, an image that
is not there, a device this torch cannot use, thinking mode on a checkpoint that never
learnt it, and an empty prompt; and reading a prompt piped on stdin. Each check runs before the model loads and
before the session store is opened, so a command that fails one leaves nothing behind.
Only `check_device` imports torch (it has to ask torch), and it runs last.

How a checkpoint declares its chat modes: ``"chat_modes": ["chat", "thinking"]`` at the
top level of its ``config.json`` or its ``TRAINING.json``. A checkpoint that declares none
learnt chat mode only (the embedded default: its corpus, ``dsagent/corpus.py``, is all
chat mode). Presets are random weights that learnt nothing: both modes are accepted, to
exercise the encoding.

Stdin follows the convention of simonw/llm: when it is not a terminal it is read, and its
text goes before the prompt argument, joined by one space (or is the whole prompt).
"""
from __future__ import annotations

import json
import os
import re
import select
import sys
from pathlib import Path
from typing import BinaryIO, Callable

from dsagent.settings import FlagError
from sessions import StoreError
from sessions.names import check_name
from tools import builtin_toolbox, valid_text

STDIN_CAP = 256 * 1024  # bytes of piped prompt text; past it the run is refused, never cut
STDIN_NOTICE_S = 2.0  # a terminal is told what it waits for after this long
CHAT_MODES_KEY = "chat_modes"
DEVICE = re.compile(r"(cpu|cuda)(:\d+)?")


def check_seed(seed: int | None) -> None:
    """The range torch's generator takes (checked here rather than by the option, whose
    range would fill a column of --help)."""
    if seed is not None and not -2**63 <= seed < 2**64:
        raise FlagError(f"--seed {seed} is outside the range a seed takes, -2**63 to 2**64 - 1")


def check_session(name: str | None) -> None:
    if name is None:
        return
    try:
        check_name(name)
    except StoreError as e:
        raise FlagError(f"--session: {e}") from None


def check_tools(tools: list[str] | None) -> None:
    known = builtin_toolbox().names()
    unknown = [t for t in tools or [] if t not in known]
    if unknown:
        raise FlagError(f"unknown tool {', '.join(map(repr, unknown))} (--tool); known tools: {', '.join(known)}")


def check_workspace(workspace: Path | None) -> None:
    if workspace is not None and not workspace.expanduser().is_dir():
        what = "is not a directory" if workspace.expanduser().exists() else "does not exist"
        raise FlagError(f"--workspace {workspace} {what}; give an existing directory")


def read_images(paths: list[Path] | None) -> list[bytes]:
    """The bytes of each --image; whether they are images the model can read is checked
    once it has loaded (`model.vision`), still before the store opens."""
    return [read_image(p) for p in paths or []]


def read_image(path: Path, asked_by: str = "--image") -> bytes:
    """The bytes of one image file named by ``asked_by`` (--image, or chat's /image); a path
    that is missing, a directory or unreadable is a FlagError that says which."""
    try:
        return path.expanduser().read_bytes()
    except FileNotFoundError:
        raise FlagError(f"no such image: {path}") from None
    except IsADirectoryError:
        raise FlagError(f"{asked_by} {path} is a directory, not an image file") from None
    except OSError as e:
        raise FlagError(f"cannot read image {path}: {e.strerror or e}") from None


def declared_chat_modes(checkpoint: Path) -> tuple[str, ...]:
    """The chat modes a checkpoint directory declares (config.json, then TRAINING.json);
    ("chat",) when it declares none."""
    for name in ("config.json", "TRAINING.json"):
        try:
            data = json.loads((checkpoint / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # a broken config.json is the loader's to report, with its own message
        modes = data.get(CHAT_MODES_KEY) if isinstance(data, dict) else None
        if isinstance(modes, list) and all(isinstance(m, str) for m in modes):
            return tuple(modes)
    return ("chat",)


def check_thinking(thinking: str, model: str | None, preset: str | None, default_source: str) -> None:
    """Refuse a chat mode the checkpoint does not declare (it would answer in a format it
    never saw: with the embedded default, pages of `<think>` that never closes)."""
    if preset is not None:
        return
    source = model or default_source
    if not Path(source).is_dir():
        return  # the default fell back to a preset, or a bad --model the loader reports
    modes = declared_chat_modes(Path(source))
    if thinking not in modes:
        raise FlagError(f"--thinking {thinking}: the model {source} did not learn {thinking} mode (it declares "
                        f"{', '.join(modes)}); use --thinking chat, or, if it did learn it, add "
                        f'"{CHAT_MODES_KEY}": ["chat", "{thinking}"] to its config.json')


def check_device(device: str) -> None:
    """cpu, cuda or cuda:N, and CUDA only where this torch has it and sees the device."""
    if not DEVICE.fullmatch(device):
        raise FlagError(f"--device {device!r} is not cpu, cuda or cuda:N")
    if device == "cpu":
        return
    import torch

    if not torch.backends.cuda.is_built():
        raise FlagError(f"--device {device}: this torch build has no CUDA (torch {torch.__version__}); "
                        "use --device cpu, or install a CUDA build of torch")
    count = torch.cuda.device_count()
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        seen = f"it sees {count} CUDA device(s)" if count else "it sees no CUDA device"
        raise FlagError(f"--device {device}: this torch build has CUDA but {seen}; use --device cpu")


def check_gpus(n: int, device: str) -> None:
    """``--gpus N``: at least 1, and on CUDA N devices from the one named (after
    :func:`check_device`); on the CPU, N processes over gloo."""
    if n < 1:
        raise FlagError(f"--gpus must be at least 1, not {n}")
    if n == 1 or not device.startswith("cuda"):
        return
    import torch

    first, count = int(device.partition(":")[2] or 0), torch.cuda.device_count()
    if first + n > count:
        raise FlagError(f"--gpus {n} from {device} needs {first + n} CUDA devices; this machine has {count}")


# ---------------------------------------------------------------------------- the prompt
def prompt_text(argument: str | None, stdin: BinaryIO | None = None, stdin_is_terminal: bool | None = None,
                notice: Callable[[str], None] | None = None) -> str:
    """The message of `dsagent run`: piped stdin (capped) before the argument, joined by one
    space (a line break where the piped text has lines of its own); the message's outer
    whitespace dropped — `echo`'s newline is not part of the question, and the model never saw
    a message end in one (the default answered `echo "What is 12 * 13?" | dsagent run` with
    arithmetic of its own and no tool call, where the same words as an argument called the
    calculator); refused when nothing but whitespace is left."""
    if stdin_is_terminal is None:
        stdin_is_terminal = sys.stdin is None or sys.stdin.isatty()
    piped = "" if stdin_is_terminal else _read_capped(stdin or sys.stdin.buffer, notice).strip()
    text = ("\n" if "\n" in piped else " ").join(part for part in (piped, (argument or "").strip()) if part)
    if not text:
        if argument is None and stdin_is_terminal:
            raise FlagError("no prompt: give the message as an argument (dsagent run \"...\") or pipe it on stdin")
        raise FlagError("the prompt is empty: give a message, or pipe text on stdin")
    return text


def _read_capped(stream: BinaryIO, notice: Callable[[str], None] | None) -> str:
    if notice is not None and not _ready(stream, STDIN_NOTICE_S):
        notice("reading the prompt from stdin (end it with Ctrl-D, or run with </dev/null to give none)")
    data = stream.read(STDIN_CAP + 1)
    if len(data) > STDIN_CAP:
        raise FlagError(f"stdin holds more than {STDIN_CAP:,} bytes, the cap on a piped prompt; "
                        f"pipe less (e.g. head -c {STDIN_CAP} FILE | dsagent run ...)")
    return valid_text(data.decode("utf-8", errors="surrogateescape"))


def _ready(stream: BinaryIO, timeout: float) -> bool:
    """Whether the stream has data (or its end) within ``timeout``; True when it cannot tell."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError, AttributeError):
        return True
    if os.name != "posix":
        return True
    ready, _, _ = select.select([fd], [], [], timeout)
    return bool(ready)
