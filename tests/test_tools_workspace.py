"""Workspace confinement: `..`, absolute paths and symlinks that leave the root are refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tools import Workspace, WorkspaceError


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Workspace, Path]:
    """A workspace `root/` with a file and a subdirectory, next to an `outside/` tree."""
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("inside")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret")
    return Workspace(root), outside


def test_relative_paths_inside_resolve(layout: tuple[Workspace, Path]) -> None:
    ws, _ = layout
    assert ws.resolve("a.txt") == ws.root / "a.txt"
    assert ws.resolve("sub/../a.txt") == ws.root / "a.txt"
    assert ws.resolve(".") == ws.root
    assert ws.resolve("new/file.txt") == ws.root / "new" / "file.txt"  # need not exist yet
    assert ws.resolve(str(ws.root / "sub")) == ws.root / "sub"  # absolute but inside
    assert ws.relative(ws.resolve("sub")) == "sub" and ws.relative(ws.root) == "."


@pytest.mark.parametrize("path", ["..", "../outside/secret.txt", "sub/../../outside", "/etc/passwd", "/"])
def test_escapes_are_refused(layout: tuple[Workspace, Path], path: str) -> None:
    ws, _ = layout
    with pytest.raises(WorkspaceError, match="outside the workspace"):
        ws.resolve(path)


def test_prefix_sibling_is_not_inside(layout: tuple[Workspace, Path]) -> None:
    ws, _ = layout
    sibling = ws.root.parent / "root-evil"
    sibling.mkdir()
    with pytest.raises(WorkspaceError):
        ws.resolve(str(sibling))


def test_symlink_to_outside_file_is_refused(layout: tuple[Workspace, Path]) -> None:
    ws, outside = layout
    os.symlink(outside / "secret.txt", ws.root / "link.txt")
    with pytest.raises(WorkspaceError):
        ws.resolve("link.txt")


def test_symlink_to_outside_dir_is_refused(layout: tuple[Workspace, Path]) -> None:
    ws, outside = layout
    os.symlink(outside, ws.root / "out")
    for path in ("out", "out/secret.txt", "out/new.txt"):
        with pytest.raises(WorkspaceError):
            ws.resolve(path)


def test_dangling_symlink_to_outside_is_refused(layout: tuple[Workspace, Path]) -> None:
    ws, outside = layout
    os.symlink(outside / "not-yet.txt", ws.root / "dangling")
    with pytest.raises(WorkspaceError):
        ws.resolve("dangling")


def test_symlinks_inside_are_allowed(layout: tuple[Workspace, Path]) -> None:
    ws, _ = layout
    os.symlink(ws.root / "a.txt", ws.root / "sub" / "alias.txt")
    os.symlink("sub", ws.root / "subdir-link")
    assert ws.resolve("sub/alias.txt") == ws.root / "a.txt"
    assert ws.resolve("subdir-link/alias.txt") == ws.root / "a.txt"


def test_symlink_loop_is_an_error_not_a_crash(layout: tuple[Workspace, Path]) -> None:
    ws, _ = layout
    os.symlink(ws.root / "loop2", ws.root / "loop1")
    os.symlink(ws.root / "loop1", ws.root / "loop2")
    try:
        real = ws.resolve("loop1")
    except WorkspaceError:
        return
    assert real.is_relative_to(ws.root)  # some Python versions return the unresolved link


def test_root_via_symlink_still_confines(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "alias")
    ws = Workspace(tmp_path / "alias")
    assert ws.root == tmp_path / "real"
    with pytest.raises(WorkspaceError):
        ws.resolve("../real-other")


def test_bad_root_and_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(WorkspaceError, match="not a directory"):
        Workspace(tmp_path / "missing")
    ws = Workspace(tmp_path)
    for bad in ("", "a\x00b"):
        with pytest.raises(WorkspaceError, match="non-empty"):
            ws.resolve(bad)
