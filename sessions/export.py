"""Transcript export: Markdown for people, JSON and JSONL for scripts.

Owns: rendering a session's messages as text. Does not own: the message schema
(whatever dict `dsagent` saved is exported as is) or writing files (the CLI does).
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

from .errors import StoreError

if TYPE_CHECKING:
    from .store import Store

FORMATS = ("markdown", "json", "jsonl")


def export(store: Store, name: str, fmt: str = "markdown") -> str:
    if fmt not in FORMATS:
        raise StoreError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
    info = store.get_session(name)
    messages = store.messages(name)
    if fmt == "json":
        return json.dumps({"session": dataclasses.asdict(info), "messages": messages}, indent=2) + "\n"
    if fmt == "jsonl":
        return "".join(json.dumps(m) + "\n" for m in messages)
    return _markdown(info.name, messages)


def _markdown(name: str, messages: list[dict]) -> str:
    parts = [f"# Session {name}\n"]
    for m in messages:
        parts.append(f"## {m.get('role', 'message')}\n")
        parts.append(_content(m.get("content", "")))
        for call in m.get("tool_calls", []) or []:
            parts.append("```json\n" + json.dumps(call, indent=2) + "\n```\n")
    return "\n".join(parts)


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content.rstrip("\n") + "\n"
    if isinstance(content, list):
        return "".join(_part(p) for p in content)
    return "```json\n" + json.dumps(content, indent=2) + "\n```\n"


def _part(part: Any) -> str:
    if isinstance(part, dict) and part.get("type") == "text":
        return str(part.get("text", "")).rstrip("\n") + "\n"
    if isinstance(part, dict) and part.get("type") == "image":
        return f"![image](sha256:{part.get('sha256', '?')})\n"
    return "```json\n" + json.dumps(part, indent=2) + "\n```\n"
