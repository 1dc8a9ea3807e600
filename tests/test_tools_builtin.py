"""Each built-in tool, called directly with a context (no runner, no approvals)."""

from __future__ import annotations

import io
import os
import re
import time
from pathlib import Path

import pytest
from PIL import Image

from tools import (
    CalculatorError,
    ToolArgumentError,
    ToolContext,
    ToolError,
    ToolOutput,
    ToolTimeoutError,
    Workspace,
    WorkspaceError,
    calculator,
    edit_file,
    list_dir,
    read_file,
    run_shell,
    view_image,
    write_file,
)


@pytest.fixture
def ctx(tmp_path: Path) -> ToolContext:
    root = tmp_path / "ws"
    root.mkdir()
    (root / "notes.txt").write_text("one\ntwo\nthree\nfour\n")
    return ToolContext(Workspace(root), timeout_s=5.0, output_cap=2000)


# --- read_file / list_dir -----------------------------------------------------------


def test_read_file_whole_and_ranges(ctx: ToolContext) -> None:
    assert read_file(ctx, "notes.txt") == "one\ntwo\nthree\nfour\n"
    assert read_file(ctx, "notes.txt", start_line=2, max_lines=2) == "two\nthree\n"
    assert read_file(ctx, "notes.txt", start_line=4) == "four\n"
    assert "no text at or after line 9" in read_file(ctx, "notes.txt", start_line=9)
    with pytest.raises(ToolArgumentError):
        read_file(ctx, "notes.txt", start_line=0)


def test_read_file_pages_long_files_instead_of_cutting_lines(ctx: ToolContext) -> None:
    (ctx.workspace.root / "long.txt").write_text("".join(f"line {i:04d}\n" for i in range(1, 1001)))
    text = read_file(ctx, "long.txt")
    assert len(text) < ctx.output_cap
    assert text.startswith("line 0001\n")
    next_line = int(re.search(r"pass start_line=(\d+) to read on", text)[1])
    assert f"line {next_line - 1:04d}\n" in text and f"line {next_line:04d}" not in text
    assert read_file(ctx, "long.txt", start_line=next_line, max_lines=1) == f"line {next_line:04d}\n"


def test_read_file_refuses_missing_binary_dirs_and_escapes(ctx: ToolContext) -> None:
    (ctx.workspace.root / "blob.bin").write_bytes(b"abc\x00def")
    with pytest.raises(ToolError, match="does not exist"):
        read_file(ctx, "missing.txt")
    with pytest.raises(ToolError, match="binary"):
        read_file(ctx, "blob.bin")
    with pytest.raises(ToolError, match="is not a directory|is a directory"):
        read_file(ctx, ".")
    with pytest.raises(WorkspaceError):
        read_file(ctx, "../../etc/passwd")


def test_list_dir(ctx: ToolContext) -> None:
    root = ctx.workspace.root
    (root / "sub").mkdir()
    (root / "sub" / "x.py").write_text("pass\n")
    os.symlink(root / "notes.txt", root / "link")
    assert list_dir(ctx) == "link@\nnotes.txt  19 bytes\nsub/"
    assert list_dir(ctx, "sub") == "x.py  5 bytes"
    (root / "empty").mkdir()
    assert list_dir(ctx, "empty") == "(empty directory)"
    with pytest.raises(ToolError, match="not a directory"):
        list_dir(ctx, "notes.txt")


def test_list_dir_shows_a_name_that_is_not_utf8_with_replacement(ctx: ToolContext) -> None:
    root = os.fsencode(ctx.workspace.root)
    try:
        with open(root + b"/caf\xe9.txt", "wb") as f:
            f.write(b"x")
    except OSError:
        pytest.skip("this file system refuses names that are not UTF-8")
    listing = list_dir(ctx)
    assert "caf\ufffd.txt  1 bytes" in listing
    listing.encode("utf-8")  # no surrogate escapes left


# --- write_file / edit_file ---------------------------------------------------------


def test_write_file_creates_parents(ctx: ToolContext) -> None:
    assert write_file(ctx, "a/b/c.txt", "héllo") == "wrote 6 bytes to a/b/c.txt"
    assert (ctx.workspace.root / "a/b/c.txt").read_text(encoding="utf-8") == "héllo"
    with pytest.raises(ToolError, match="is a directory"):
        write_file(ctx, "a", "x")


def test_write_through_symlink_to_outside_is_refused(ctx: ToolContext, tmp_path: Path) -> None:
    target = tmp_path / "outside.txt"
    target.write_text("keep")
    os.symlink(target, ctx.workspace.root / "link.txt")
    os.symlink(tmp_path, ctx.workspace.root / "updir")
    with pytest.raises(WorkspaceError):
        write_file(ctx, "link.txt", "overwritten")
    with pytest.raises(WorkspaceError):
        write_file(ctx, "updir/new.txt", "x")
    assert target.read_text() == "keep" and not (tmp_path / "new.txt").exists()


def test_edit_file_exact_unique_match(ctx: ToolContext) -> None:
    path = ctx.workspace.root / "notes.txt"
    assert edit_file(ctx, "notes.txt", "three\n", "THREE\n") == "replaced 1 occurrence in notes.txt at line 3"
    assert path.read_text() == "one\ntwo\nTHREE\nfour\n"
    path.write_text("x = 1\nx = 1\n")
    with pytest.raises(ToolError, match="occurs 2 times.*include more context"):
        edit_file(ctx, "notes.txt", "x = 1", "x = 2")
    with pytest.raises(ToolError, match="occurs 0 times"):
        edit_file(ctx, "notes.txt", "y", "z")
    with pytest.raises(ToolArgumentError):
        edit_file(ctx, "notes.txt", "", "z")


def test_edit_file_keeps_crlf_line_endings(ctx: ToolContext) -> None:
    path = ctx.workspace.root / "dos.txt"
    path.write_bytes(b"a\r\nb\r\n")
    edit_file(ctx, "dos.txt", "b", "c")
    assert path.read_bytes() == b"a\r\nc\r\n"


# --- run_shell ----------------------------------------------------------------------


def test_run_shell_runs_in_root_with_merged_output(ctx: ToolContext) -> None:
    out = run_shell(ctx, "pwd; echo err >&2; cat; exit 3")
    assert isinstance(out, ToolOutput)
    lines = out.text.splitlines()
    assert lines[0] == "[exit code 3]"
    assert Path(lines[1]).resolve() == ctx.workspace.root
    assert "err" in lines[2:] and not out.truncated


def test_run_shell_timeout_kills_the_process_group(ctx: ToolContext, tmp_path: Path) -> None:
    fast = ToolContext(ctx.workspace, timeout_s=0.5, output_cap=2000)
    start = time.monotonic()
    with pytest.raises(ToolTimeoutError, match="timed out after 0.5 s.*\nbefore"):
        run_shell(fast, "echo before; sleep 30 & echo $! > child.pid; wait")
    assert time.monotonic() - start < 10
    child = int((ctx.workspace.root / "child.pid").read_text())
    _assert_dead(child)


def _assert_dead(pid: int) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)  # the child may linger as a zombie until its parent is reaped
        if _is_zombie(pid):
            return
    pytest.fail(f"process {pid} is still running")


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def test_run_shell_background_job_does_not_hang_the_call(ctx: ToolContext) -> None:
    start = time.monotonic()
    out = run_shell(ctx, "sleep 30 & echo started")
    assert "started" in out.text and time.monotonic() - start < 5


def test_run_shell_caps_output_keeping_head_and_tail(ctx: ToolContext) -> None:
    out = run_shell(ctx, "echo FIRST; yes filler | head -c 100000; echo; echo LAST")
    assert out.truncated
    assert "FIRST" in out.text and out.text.rstrip().endswith("LAST")
    assert "bytes truncated ...]" in out.text
    assert len(out.text) < ctx.output_cap + 200


# --- calculator ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "expression, expected",
    [("1 + 2 * 3", "7"), ("(1 + 2) * 3", "9"), ("7 // 2", "3"), ("7 % 4", "3"), ("2 ** 10", "1024"),
     ("-3 + +1", "-2"), ("10 / 4", "2.5"), ("sqrt(16)", "4.0"), ("abs(-2)", "2"), ("round(2.567, 2)", "2.57"),
     ("min(3, 1, 2)", "1"), ("max(3, 1, 2)", "3"), ("floor(pi)", "3"), ("2 ** 0.5 * 2 ** 0.5 > 1.9", None)],
)
def test_calculator_arithmetic(expression: str, expected: str | None) -> None:
    if expected is None:
        with pytest.raises(CalculatorError):  # comparisons are not arithmetic
            calculator(expression)
    else:
        assert calculator(expression) == expected


@pytest.mark.parametrize(
    "expression, fragment",
    [
        ("__import__('os').system('true')", "not allowed"),
        ("'__import__'", "the constant"),
        ("().__class__", "not allowed"),
        ("(1).real", "Attribute"),
        ("x + 1", "the name 'x'"),
        ("os", "the name 'os'"),
        ("open('f')", "not allowed"),
        ("[1, 2]", "List"),
        ("lambda: 1", "Lambda"),
        ("True + 1", "the constant"),
        ("1j", "the constant"),
        ("9 ** 9 ** 9", "too large"),
        ("10 ** 100000", "too large"),
        ("(2 ** 9000) * (2 ** 9000)", "too large"),
        ("round(5, -10 ** 9)", "between -100 and 100"),
        ("1 / 0", "ZeroDivisionError"),
        ("sqrt(-1)", "cannot evaluate"),
        ("exp(1000)", "OverflowError"),
        ("sqrt(x=4)", "keyword"),
        ("1 +", "not a valid expression"),
        ("1" * 2000, "longer than"),
    ],
)
def test_calculator_refuses(expression: str, fragment: str) -> None:
    start = time.monotonic()
    with pytest.raises(CalculatorError, match=fragment.replace("(", r"\(")):
        calculator(expression)
    assert time.monotonic() - start < 1


# --- view_image ---------------------------------------------------------------------


def _png_bytes() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (4, 3), (255, 0, 0)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_view_image_returns_the_bytes(ctx: ToolContext) -> None:
    data = _png_bytes()
    (ctx.workspace.root / "red.png").write_bytes(data)
    out = view_image(ctx, "red.png")
    assert out.images == (data,)
    assert f"red.png (PNG, {len(data)} bytes)" in out.text
    assert Image.open(io.BytesIO(out.images[0])).size == (4, 3)


def test_view_image_refuses_non_images(ctx: ToolContext) -> None:
    (ctx.workspace.root / "fake.png").write_text("not really a png")
    with pytest.raises(ToolError, match="not a PNG, JPEG, GIF or WEBP image"):
        view_image(ctx, "fake.png")
    with pytest.raises(ToolError, match="does not exist"):
        view_image(ctx, "missing.png")
