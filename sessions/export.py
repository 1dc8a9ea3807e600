"""Transcript export: Markdown for people, JSON and JSONL for scripts.

Owns: rendering a session's messages as text. Does not own: the message schema
(whatever dict `dsagent` saved is exported as is) or writing files (the CLI does).
A reply saved with a `stop` other than `eos` (interrupted, cut short at the token limit,
its tool calls not run at the step limit) gets a line saying so in Markdown; messages
saved before replies recorded their stop have none and export as they always did.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

from .errors import StoreError

if TYPE_CHECKING:
    from .store import Store

FORMATS = ("markdown", "json", "jsonl")
STOP_MARKS = {
    "interrupted": "*(interrupted)*",
    "max_tokens": "*(cut short: the token limit of a reply)*",
    "max_steps": "*(stopped at the step limit: these tool calls were not run)*",
}


def export(store: Store, name: str, fmt: str = "markdown") -> str:
    if fmt not in FORMATS:
        raise StoreError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
    info = store.get_session(name)
    messages = store.messages(name)
    if fmt == "json":
        return json.dumps({"session": dataclasses.asdict(info), "messages": messages}, indent=2) + "\n"
    if fmt == "jsonl":
        return "".join(json.dumps(m) + "\n" for m in messages)
    return _markdown(store, info.name, messages)


def _markdown(store: Store, name: str, messages: list[dict]) -> str:
    """One `## role` section per message that has something to show (an empty one gets no heading)."""
    sizes = _image_sizes(store, messages)
    parts = [f"# Session {name}\n"]
    for m in messages:
        body = _content(m.get("content", ""), sizes) + "".join(_call(c) for c in m.get("tool_calls") or [])
        stop = m.get("stop")
        if isinstance(stop, str) and stop in STOP_MARKS:
            body += STOP_MARKS[stop] + "\n"
        if body.strip():
            parts.append(f"## {m.get('role', 'message')}\n")
            parts.append(body)
    return "\n".join(parts)


def _image_sha(part: Any) -> str | None:
    """The hash an image part names: `dsagent` saves `image_url` parts with a `sha256:` URL."""
    if not isinstance(part, dict):
        return None
    if part.get("type") == "image":
        return str(part.get("sha256", "")) or None
    if part.get("type") == "image_url":
        url = str((part.get("image_url") or {}).get("url", ""))
        return url.removeprefix("sha256:") if url.startswith("sha256:") else None
    return None


def _image_sizes(store: Store, messages: list[dict]) -> dict[str, int]:
    """Byte sizes of the images the transcript names, read from the store in one query."""
    shas = sorted({s for m in messages if isinstance(m.get("content"), list)
                   for s in map(_image_sha, m["content"]) if s})
    if not shas:
        return {}
    marks = ", ".join("?" * len(shas))
    with store._read():
        rows = store.db.query(f"select sha256, size from images where sha256 in ({marks})", shas)
        return {r["sha256"]: r["size"] for r in rows}


def _content(content: Any, sizes: dict[str, int]) -> str:
    if isinstance(content, str):
        return content.rstrip("\n") + "\n" if content.strip() else ""
    if isinstance(content, list):
        return "".join(_part(p, sizes) for p in content)
    if content is None:
        return ""
    return "```json\n" + json.dumps(content, indent=2) + "\n```\n"


def _part(part: Any, sizes: dict[str, int]) -> str:
    if isinstance(part, dict) and part.get("type") == "text":
        return _content(str(part.get("text", "")), sizes)
    sha = _image_sha(part)
    if sha is not None:
        size = f"{sizes[sha]} bytes" if sha in sizes else "not in the store"
        return f"![image](sha256:{sha[:12]}…) ({size})\n"
    return "```json\n" + json.dumps(part, indent=2) + "\n```\n"


def _call(call: Any) -> str:
    """A tool call as a reader would write it: `→ name({"arg": ...})`; the arguments string is
    shown as saved (the model's spelling is not always valid JSON)."""
    if not isinstance(call, dict) or "function" not in call:
        return "```json\n" + json.dumps(call, indent=2) + "\n```\n"
    fn = call["function"] or {}
    name = f"{call['namespace']}::{fn.get('name')}" if call.get("namespace") else str(fn.get("name"))
    args = fn.get("arguments", "")
    args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return f"→ {name}({args})\n"
