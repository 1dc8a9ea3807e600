"""Session names.

Owns: the rule a session name must follow. A name becomes a file name (its lock,
`<home>/locks/<name>.lock`) and a command-line argument, so it is kept to letters,
digits, '.', '_' and '-'. Does not own: whether a session of that name exists (the
store decides).
"""

from __future__ import annotations

import re

from .errors import StoreError

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_name(name: str) -> str:
    if not _NAME_RE.match(name or ""):
        raise StoreError(
            f"invalid session name {name!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name
