"""The built-in tools: files, a shell, a safe calculator and an image viewer.

Owns the tool functions themselves and `builtin_toolbox()`, which marks which of them
write (`write_file`, `edit_file`) or execute (`run_shell`) and so need approval under
the `ask` policy. Each is a plain typed function: its docstring is what the model
reads, its hints are the schema. Paths go through the workspace; `run_shell` enforces
its own timeout and output cap because it owns a process group.

Does not own approvals, the Python-level deadline or the final output cap
(runner.py), nor decoding images for the model (the model side does that).
"""

from __future__ import annotations

import ast
import itertools
import math
import operator
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import IO, Any, Callable

from tools.errors import CalculatorError, ToolArgumentError, ToolError, ToolTimeoutError
from tools.limits import ToolContext, ToolOutput, valid_text
from tools.registry import Toolbox, Tool

MAX_IMAGE_BYTES = 20 * 2**20  # the largest image file view_image hands to the model
_BINARY_SNIFF_BYTES = 8192  # a NUL byte in this prefix marks a file as binary
_NOTE_ROOM = 200  # chars kept free below the output cap for a tool's own notes and markers


# --- files --------------------------------------------------------------------------


def _existing(ctx: ToolContext, path: str, *, want_dir: bool) -> Path:
    """The resolved path, which must exist and be a directory (or not) as asked."""
    real = ctx.workspace.resolve(path)
    if not real.exists():
        raise ToolError(f"{path!r} does not exist in the workspace; list_dir shows what does")
    if real.is_dir() != want_dir:
        raise ToolError(f"{path!r} is {'not ' if want_dir else ''}a directory")
    return real


def _refuse_binary(file: Path, path: str) -> None:
    with file.open("rb") as f:
        if b"\x00" in f.read(_BINARY_SNIFF_BYTES):
            raise ToolError(f"{path!r} is a binary file; read_file reads text (view_image shows images)")


def read_file(ctx: ToolContext, path: str, start_line: int = 1, max_lines: int | None = None) -> str:
    """Read a text file of the workspace, whole or a range of its lines.

    Args:
        path: the file, relative to the workspace root
        start_line: the first line to return, counting from 1
        max_lines: how many lines to return at most; all the rest when omitted
    """
    if start_line < 1 or (max_lines is not None and max_lines < 1):
        raise ToolArgumentError("start_line and max_lines must be 1 or more")
    file = _existing(ctx, path, want_dir=False)
    _refuse_binary(file, path)
    stop = None if max_lines is None else start_line - 1 + max_lines
    with file.open(encoding="utf-8", errors="replace", newline="") as f:
        lines = itertools.islice(f, start_line - 1, stop)
        text, next_line = _take_within(lines, ctx.output_cap - _NOTE_ROOM, start_line)
    if next_line is not None:
        return f"{text}\n[... file continues at line {next_line}; pass start_line={next_line} to read on ...]"
    return text if text else f"(no text at or after line {start_line})"


def _take_within(lines: Any, budget: int, first: int) -> tuple[str, int | None]:
    """Join lines until `budget` chars; (text, number of the first line left out or None)."""
    taken: list[str] = []
    size = 0
    for number, line in enumerate(lines, start=first):
        if taken and size + len(line) > budget:
            return "".join(taken), number
        taken.append(line)
        size += len(line)
    return "".join(taken), None


def list_dir(ctx: ToolContext, path: str = ".") -> str:
    """List a directory of the workspace, one entry a line: directories end with '/',
    symlinks with '@', files show their size in bytes.

    Args:
        path: the directory, relative to the workspace root
    """
    directory = _existing(ctx, path, want_dir=True)
    lines = [_describe_entry(entry) for entry in sorted(directory.iterdir(), key=lambda p: p.name)]
    return "\n".join(lines) if lines else "(empty directory)"


def _describe_entry(entry: Path) -> str:
    name = valid_text(entry.name)  # a name that is not UTF-8 is shown with U+FFFD in place
    if entry.is_symlink():
        return f"{name}@"
    if entry.is_dir():
        return f"{name}/"
    return f"{name}  {entry.stat().st_size} bytes"


def write_file(ctx: ToolContext, path: str, content: str) -> str:
    """Create or overwrite a text file in the workspace (missing parent directories are made).

    Args:
        path: the file, relative to the workspace root
        content: the complete new text of the file
    """
    file = ctx.workspace.resolve(path)
    if file.is_dir():
        raise ToolError(f"{path!r} is a directory; give a file path")
    file.parent.mkdir(parents=True, exist_ok=True)
    data = content.encode("utf-8")
    file.write_bytes(data)
    return f"wrote {len(data)} bytes to {ctx.workspace.relative(file)}"


def edit_file(ctx: ToolContext, path: str, old: str, new: str) -> str:
    """Replace one exact piece of text in a file of the workspace. `old` must occur
    exactly once; include surrounding lines to make it unique.

    Args:
        path: the file, relative to the workspace root
        old: the exact text to replace, whitespace included
        new: the text to put in its place
    """
    if not old:
        raise ToolArgumentError("old must not be empty; use write_file to create a file")
    file = _existing(ctx, path, want_dir=False)
    try:
        text = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ToolError(f"{path!r} is not UTF-8 text; edit_file changes text files only") from exc
    count = text.count(old)
    if count != 1:
        hint = "check read_file's output for the exact text" if count == 0 else "include more context"
        raise ToolError(f"old text occurs {count} times in {path!r}, it must occur once; {hint}")
    file.write_bytes(text.replace(old, new).encode("utf-8"))
    line = text[: text.index(old)].count("\n") + 1
    return f"replaced 1 occurrence in {ctx.workspace.relative(file)} at line {line}"


# --- shell --------------------------------------------------------------------------


class _CappedPipe:
    """Drains a pipe on a thread, keeping only its first and last `cap // 2` bytes."""

    def __init__(self, pipe: IO[bytes], cap: int) -> None:
        self.half = max(cap // 2, 1)
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0
        self.thread = threading.Thread(target=self._drain, args=(pipe,), daemon=True)
        self.thread.start()

    def _drain(self, pipe: IO[bytes]) -> None:
        with pipe:
            for chunk in iter(lambda: os.read(pipe.fileno(), 65536), b""):
                self.total += len(chunk)
                room = self.half - len(self.head)
                self.head += chunk[: max(room, 0)]
                self.tail += chunk[max(room, 0):]
                del self.tail[: -self.half]

    def result(self) -> tuple[str, bool]:
        """(text, whether bytes were dropped) once the pipe is drained."""
        self.thread.join(timeout=5.0)
        dropped = self.total - len(self.head) - len(self.tail)
        if dropped <= 0:
            return (self.head + self.tail).decode("utf-8", "replace"), False
        head, tail = self.head.decode("utf-8", "replace"), self.tail.decode("utf-8", "replace")
        return f"{head}\n[... {dropped} bytes truncated ...]\n{tail}", True


def _kill_group(pgid: int) -> None:
    """Kill every process of the command's group: the shell and anything it started."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone


def run_shell(ctx: ToolContext, command: str) -> ToolOutput:
    """Run a shell command (/bin/sh -c) in the workspace root and return its exit code
    and output (stdout and stderr merged). There is no stdin. The command is killed,
    with everything it started, when it runs past the timeout.

    Args:
        command: the command line to run
    """
    proc = subprocess.Popen(["/bin/sh", "-c", command], cwd=ctx.workspace.root, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    assert proc.stdout is not None
    pipe = _CappedPipe(proc.stdout, ctx.output_cap - _NOTE_ROOM)  # so the runner need not cut again
    try:
        code = proc.wait(timeout=ctx.timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        _kill_group(proc.pid)  # also ends background jobs that would hold the pipe open
        proc.wait()
    output, truncated = pipe.result()
    if code is None:
        raise ToolTimeoutError(f"command timed out after {ctx.timeout_s:g} s and was killed; output so far:\n{output}")
    return ToolOutput(f"[exit code {code}]\n{output}", truncated=truncated)


# --- calculator ---------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 1000
MAX_INT_BITS = 10_000  # about 3000 decimal digits: big enough for arithmetic, small enough to stay fast


def _round(value: Any, digits: Any = 0) -> Any:
    """round(), refusing digit counts whose power of ten would be huge."""
    if not isinstance(digits, int) or abs(digits) > 100:
        raise CalculatorError("round's digits must be an integer between -100 and 100")
    return round(value, digits) if digits else round(value)


_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "sqrt": math.sqrt, "abs": abs, "round": _round, "min": min, "max": max, "floor": math.floor,
    "ceil": math.ceil, "exp": math.exp, "log": math.log, "log10": math.log10, "log2": math.log2,
    "sin": math.sin, "cos": math.cos, "tan": math.tan,
}
_CONSTANTS = {"pi": math.pi, "e": math.e}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with Python's number rules: numbers,
    + - * / // % **, parentheses, the constants pi and e, and the functions sqrt, abs,
    round, min, max, floor, ceil, exp, log, log10, log2, sin, cos, tan.

    Args:
        expression: the expression, e.g. "sqrt(2) * (3 + 4) ** 2"
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        return repr(_evaluate(tree.body))
    except SyntaxError as exc:
        raise CalculatorError(f"not a valid expression: {exc.msg}") from exc
    except (ArithmeticError, ValueError, TypeError, RecursionError) as exc:
        raise CalculatorError(f"cannot evaluate: {type(exc).__name__}: {exc}") from exc


def _evaluate(node: ast.AST) -> Any:
    """Walk the syntax tree, allowing only the nodes listed in calculator's docstring."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _checked(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS:
        if node.keywords:
            raise CalculatorError("keyword arguments are not supported")
        return _checked(_FUNCTIONS[node.func.id](*(_evaluate(arg) for arg in node.args)))
    raise CalculatorError(f"{_describe(node)} is not allowed; only numbers, arithmetic and math functions")


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return f"the name {node.id!r}"
    if isinstance(node, ast.Call):
        return "this function call"
    if isinstance(node, ast.Constant):
        return f"the constant {node.value!r:.40}"
    return f"{type(node).__name__} syntax"


def _check_power(base: Any, exponent: Any) -> None:
    """Refuse integer powers whose result would exceed MAX_INT_BITS before computing them."""
    if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1:
        if exponent > MAX_INT_BITS or base.bit_length() * exponent > MAX_INT_BITS:
            raise CalculatorError(f"the result of {base} ** {exponent} is too large (over {MAX_INT_BITS} bits)")


def _checked(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
        raise CalculatorError(f"an intermediate result is too large (over {MAX_INT_BITS} bits)")
    if isinstance(value, complex):
        raise CalculatorError("the result is a complex number; only real numbers are supported")
    return value


# --- images -------------------------------------------------------------------------


def _image_format(data: bytes) -> str | None:
    """The image format named by the file's magic bytes, or None."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


def view_image(ctx: ToolContext, path: str) -> ToolOutput:
    """Look at an image file of the workspace (PNG, JPEG, GIF or WEBP): the image itself
    is given back to you to see.

    Args:
        path: the image file, relative to the workspace root
    """
    file = _existing(ctx, path, want_dir=False)
    size = file.stat().st_size
    if size > MAX_IMAGE_BYTES:
        raise ToolError(f"{path!r} is {size} bytes; images over {MAX_IMAGE_BYTES} bytes are refused")
    data = file.read_bytes()
    kind = _image_format(data)
    if kind is None:
        raise ToolError(f"{path!r} is not a PNG, JPEG, GIF or WEBP image")
    return ToolOutput(f"image {ctx.workspace.relative(file)} ({kind}, {size} bytes) is attached", images=(data,))


# --- the toolbox --------------------------------------------------------------------


def builtin_toolbox() -> Toolbox:
    """Every built-in tool, with the writing and executing ones marked for approval."""
    return Toolbox([
        Tool.from_function(read_file),
        Tool.from_function(list_dir),
        Tool.from_function(write_file, writes=True),
        Tool.from_function(edit_file, writes=True),
        Tool.from_function(run_shell, executes=True),
        Tool.from_function(calculator),
        Tool.from_function(view_image),
    ])
