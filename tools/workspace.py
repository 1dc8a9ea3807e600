"""The workspace: the one directory tree every tool may touch.

Owns turning a path the model wrote into a real path inside the root, refusing
absolute paths outside it, `..` escapes and symlinks (file or directory, existing or
dangling) whose target leaves it. Does not own what a tool does with the path, nor
limits such as timeouts and output caps (limits.py).

The check resolves every symlink first and tests containment afterwards, so a link is
judged by where it really points. It is a check at call time, not an OS sandbox: a
process that swaps a directory for a symlink between the check and the use can still
race it, and `run_shell` commands are confined only by their working directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from tools.errors import WorkspaceError


class Workspace:
    """A root directory; `resolve` maps model-written paths to real paths inside it."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        path = Path(root).expanduser()
        if not path.is_dir():
            raise WorkspaceError(
                f"workspace root {str(path)!r} is not a directory; create it or choose another root"
            )
        self.root = path.resolve()

    def __repr__(self) -> str:
        return f"Workspace({str(self.root)!r})"

    def resolve(self, path: str | os.PathLike[str]) -> Path:
        """The real path of `path` (relative to the root, or absolute inside it)."""
        text = os.fspath(path)
        if not text or "\x00" in text:
            raise WorkspaceError("a path must be a non-empty string without NUL bytes")
        candidate = Path(text) if os.path.isabs(text) else self.root / text
        try:
            real = candidate.resolve()
        except (OSError, RuntimeError) as exc:  # symlink loops end up here
            raise WorkspaceError(f"cannot resolve path {text!r}: {exc}") from exc
        if not real.is_relative_to(self.root):
            raise WorkspaceError(
                f"path {text!r} leads outside the workspace; use a path inside {str(self.root)!r}"
            )
        return real

    def relative(self, path: Path) -> str:
        """How a resolved path is shown to the model: relative to the root, '/'-separated."""
        rel = path.relative_to(self.root).as_posix()
        return rel if rel else "."
