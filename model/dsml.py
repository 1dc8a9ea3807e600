"""Parsing V4.1 completions: reasoning, content and DSML tool calls.

Owns two readers of the same grammar:

- `parse_completion(text, thinking_mode)`: a finished completion to the reference's
  message dict (`role`, `content`, `reasoning_content`, `tool_calls` with
  `function.arguments` spliced into a JSON-looking string exactly as the official
  parser builds it). Malformed text raises `DSMLError`.
- `StreamParser`: the same grammar fed chunk by chunk (tags may be split at any
  character). It emits `TextDelta`, `ReasoningDelta`, `ToolCall` (typed arguments) and
  `ToolCallError` events and never raises on model output: malformed markup becomes a
  structured error the agent can send back to the model.

Only the V4.1 spelling is accepted (`<｜DSML｜ calls>`, `<｜DSML｜ invoke …>`,
`<｜DSML｜ parameter …>`, with a space after `｜DSML｜`); the V4 spelling is refused.

Does not own: rendering (`model/chat.py`), running tools (`tools`), or deciding what
to do with an error (the agent turn loop in `dsagent`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Union

from model.chat import (BOS, DSML, DSML_CALLS, DSML_CALLS_END, DSML_INVOKE_END, EOS,
                        THINK_END, THINK_START, THINKING_MODES, ChatFormatError, split_tool_name)

BLOCK_START = "\n\n" + DSML_CALLS[:-1]          # "\n\n<｜DSML｜ calls" (">" is checked after)
INVOKE_START = f"<{DSML} invoke"
INVOKE_END = DSML_INVOKE_END[:-1]                # "</｜DSML｜ invoke"
PARAM_START = f"<{DSML} parameter"
PARAM_END = f"/{DSML} parameter"                 # the value's "<" is matched by the regex
V4_CALLS_END = f"</{DSML}tool_calls>"
# The encoder writes a call without arguments as `name="f">` + "\n\n" + `</｜DSML｜ invoke>`; the
# official header pattern `^\s*name="(.*?)">\n$` takes that second newline through `$`.
_NAME_RE = re.compile(r'\s*name="(.*?)">\n\n?', re.DOTALL)
_PARAM_RE = re.compile(r' name="(.*?)" string="(true|false)">(.*?)<', re.DOTALL)


# A string="false" value may nest lists and objects this deep. json.loads recurses once a
# level, so a value nested ~1,000 deep would raise RecursionError; a fixed bound (far above
# what a tool's arguments need) refuses it the same way whatever the caller's stack depth.
MAX_VALUE_DEPTH = 100


class DSMLError(ValueError):
    """A completion that does not follow the V4.1 output grammar."""


# -- the tool-call block ----------------------------------------------------------------

@dataclass(frozen=True)
class RawCall:
    """One invoke as written: its name, (name, value, is_string) params and source text."""

    name: str
    params: tuple[tuple[str, str, bool], ...]
    raw: str


def _read_until(text: str, index: int, stops: list[str]) -> tuple[int, str, str | None]:
    """(index after the earliest stop, text before it, the stop) or (len, rest, None)."""
    best, found = len(text), None
    for stop in stops:
        pos = text.find(stop, index)
        if pos != -1 and pos < best:
            best, found = pos, stop
    if found is None:
        return len(text), text[index:], None
    return best + len(found), text[index:best], found


def _expect_gap(gap: str, where: str) -> None:
    if gap != ">\n":
        raise DSMLError(f"malformed tool call markup {where}: expected '>\\n' but got {gap[:80]!r}")


def _parse_params(text: str, index: int) -> tuple[int, str | None, list[tuple[str, str, bool]]]:
    """Parameters of one invoke, from just after `<｜DSML｜ parameter`."""
    params: list[tuple[str, str, bool]] = []
    stop: str | None = PARAM_START
    while stop == PARAM_START:
        index, body, _ = _read_until(text, index, [PARAM_END])
        match = _PARAM_RE.fullmatch(body)
        if match is None:
            raise DSMLError(f"malformed parameter tag: {body[:80]!r}")
        name, string, value = match.groups()
        if any(p[0] == name for p in params):
            raise DSMLError(f"duplicate parameter name: {name!r}")
        params.append((name, value, string == "true"))
        index, gap, stop = _read_until(text, index, [PARAM_START, INVOKE_END])
        _expect_gap(gap, f"after parameter {name!r}")
    return index, stop, params


def _parse_invoke(text: str, start: int, index: int) -> tuple[int, RawCall]:
    """One invoke; `start` is where `<｜DSML｜ invoke` began, `index` just after it."""
    index, head, stop = _read_until(text, index, [PARAM_START, INVOKE_END])
    match = _NAME_RE.fullmatch(head)
    if match is None:
        raise DSMLError(f"malformed invoke tag: {head[:80]!r}")
    params: list[tuple[str, str, bool]] = []
    if stop == PARAM_START:
        index, stop, params = _parse_params(text, index)
    if stop != INVOKE_END:
        raise DSMLError(f"invoke {match.group(1)!r} is not closed with {DSML_INVOKE_END!r}")
    return index, RawCall(match.group(1), tuple(params), text[start:index + 1])


def parse_tool_block(text: str, index: int) -> tuple[int, list[RawCall]]:
    """The calls of a block whose `\\n\\n<｜DSML｜ calls` ends at `index`; returns the index
    just after `</｜DSML｜ calls>`."""
    calls: list[RawCall] = []
    while True:
        index, gap, stop = _read_until(text, index, [INVOKE_START, DSML_CALLS_END])
        _expect_gap(gap, "between tool calls")
        if stop == DSML_CALLS_END:
            return index, calls
        if stop is None:
            raise DSMLError(f"tool call block is not closed with {DSML_CALLS_END!r}")
        index, call = _parse_invoke(text, index - len(INVOKE_START), index)
        calls.append(call)


def spliced_arguments(call: RawCall) -> str:
    """The reference's arguments string: string values JSON-quoted, others copied raw
    (so it is not necessarily valid JSON)."""
    dump = lambda s: json.dumps(s, ensure_ascii=False)  # noqa: E731
    return "{" + ", ".join(f"{dump(k)}: {dump(v) if s else v}" for k, v, s in call.params) + "}"


def typed_arguments(call: RawCall) -> dict[str, Any]:
    """Arguments with typed values: string="false" values are parsed as JSON."""
    args: dict[str, Any] = {}
    for name, value, is_string in call.params:
        args[name] = value if is_string else _json_value(name, value)
    return args


def _json_value(name: str, value: str) -> Any:
    if _too_deep(value):
        raise DSMLError(f"parameter {name!r} is nested too deeply (over {MAX_VALUE_DEPTH} levels); "
                        "pass a flatter value")
    try:
        return json.loads(value)
    except RecursionError:  # the bound above leaves room; this only guards a caller already deep
        raise DSMLError(f"parameter {name!r} is nested too deeply to read") from None
    except ValueError:
        raise DSMLError(f'parameter {name!r} has string="false" but its value is not JSON: {value[:80]!r}') from None


def _too_deep(text: str) -> bool:
    """Whether `[` and `{` nest more than MAX_VALUE_DEPTH deep in JSON text (brackets
    inside strings do not count)."""
    if text.count("[") + text.count("{") <= MAX_VALUE_DEPTH:  # cannot be: skip the scan
        return False
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if escaped:
            escaped = False
        elif in_string:
            escaped, in_string = ch == "\\", ch != '"'
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_VALUE_DEPTH:
                return True
        elif ch in "]}":
            depth -= 1
    return False


def _openai_call(call: RawCall) -> dict[str, Any]:
    try:
        namespace, name = split_tool_name(call.name)
    except ChatFormatError as exc:
        raise DSMLError(str(exc)) from None
    out: dict[str, Any] = {"type": "function"}
    if namespace is not None:
        out["namespace"] = namespace
    out["function"] = {"name": name, "arguments": spliced_arguments(call)}
    return out


# -- a finished completion ----------------------------------------------------------------

def _check_mode(thinking_mode: str) -> None:
    if thinking_mode not in THINKING_MODES:
        raise DSMLError(f"invalid thinking_mode {thinking_mode!r}: use 'chat' or 'thinking'")


def _check_no_markup(content: str, reasoning: str) -> None:
    for token in (BOS, EOS, THINK_START, THINK_END, DSML):
        if token in content or token in reasoning:
            raise DSMLError(f"unexpected special token {token!r} in the reply text "
                            f"(tool calls use the V4.1 spelling '\\n\\n{DSML_CALLS}')")


def parse_completion(text: str, thinking_mode: str) -> dict[str, Any]:
    """Parse a whole completion (what follows the generation header) into a message."""
    _check_mode(thinking_mode)
    index, reasoning, calls = 0, "", []
    if thinking_mode == "thinking":
        index, reasoning, stop = _read_until(text, 0, [THINK_END, BLOCK_START])
        if stop != THINK_END:
            raise DSMLError(f"invalid thinking format: missing {THINK_END}")
    index, content, stop = _read_until(text, index, [EOS, BLOCK_START])
    if stop == BLOCK_START:
        index, calls = parse_tool_block(text, index)
        index, rest, stop = _read_until(text, index, [EOS])
        if rest:
            raise DSMLError(f"unexpected text after the tool calls: {rest[:80]!r}")
    elif stop is None:
        raise DSMLError(f"invalid format: missing EOS token {EOS}")
    if index != len(text):
        raise DSMLError(f"unexpected content after the end: {text[index:index + 80]!r}")
    _check_no_markup(content, reasoning)
    return {"role": "assistant", "content": content, "reasoning_content": reasoning,
            "tool_calls": [_openai_call(c) for c in calls]}


# -- streaming -------------------------------------------------------------------------

@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCall:
    name: str                 # as written in the invoke tag, `ns::name` when namespaced
    arguments: dict[str, Any]
    raw: str


@dataclass(frozen=True)
class ToolCallError:
    message: str              # written for the model: what was wrong and how to fix it
    raw: str


Event = Union[TextDelta, ReasoningDelta, ToolCall, ToolCallError]

_V4_HINT = (f"the V4 DSML spelling is not accepted; write a blank line then {DSML_CALLS}, "
            f'<{DSML} invoke name="...">, <{DSML} parameter ...> (a space after {DSML})')
_STRAY_HINT = (f"DSML markup outside a tool call block; start tool calls with a blank line "
               f"then {DSML_CALLS}")
_REASONING_HINT = f"tool calls must come after {THINK_END}, not inside the reasoning"

_TEXT_MARKERS = [BLOCK_START, EOS, f"</{DSML}", f"<{DSML}", DSML]
_REASONING_MARKERS = [THINK_END, BLOCK_START, EOS]
_BLOCK_MARKERS = [DSML_CALLS_END, EOS]
_BAD_MARKERS = [DSML_CALLS_END, V4_CALLS_END, EOS]
_AFTER_MARKERS = [EOS]
_AFTER_HINT = (f"unexpected text after {DSML_CALLS_END} (a parameter value may contain a "
               f"closing tag); only the end of the reply may follow a tool call block")


def _earliest(buf: str, markers: list[str]) -> tuple[int, str] | None:
    """The earliest marker in `buf`; on a tie the longest one."""
    hits = [(pos, -len(m), m) for m in markers if (pos := buf.find(m)) != -1]
    if not hits:
        return None
    pos, _, marker = min(hits)
    return pos, marker


def _incomplete_from(buf: str, markers: list[str]) -> int | None:
    """The earliest index from which the rest of `buf` could still grow into a marker."""
    longest = max(len(m) for m in markers)
    for q in range(max(0, len(buf) - longest + 1), len(buf)):
        tail = buf[q:]
        if any(len(m) > len(tail) and m.startswith(tail) for m in markers):
            return q
    return None


class StreamParser:
    """Incremental reader of one completion; see the module docstring.

    A block's calls are emitted once the reply ends (EOS or close) right after it, so a
    value that smuggles in a closing tag cannot yield a wrong call: any text between
    the block and the end turns the whole block into one ToolCallError. Text after EOS
    is kept in `trailing` and not parsed.
    """

    def __init__(self, thinking_mode: str) -> None:
        _check_mode(thinking_mode)
        self._state = "reasoning" if thinking_mode == "thinking" else "text"
        self._buf = ""
        self._block = ""     # markup collected for the block being read
        self._hint = ""      # the error message of a malformed block
        self._final = False  # set by close(): no more input, partial markers are text
        self._pending: list[Event] = []  # events of a closed block, held until the end
        self._block_len = 0              # length of that block's markup in _block
        self.trailing = ""

    @property
    def done(self) -> bool:
        return self._state == "done"

    def feed(self, chunk: str) -> list[Event]:
        self._buf += chunk
        events: list[Event] = []
        while self._step(events):
            pass
        return events

    def close(self) -> list[Event]:
        """End of stream: flush held text; an open block becomes a ToolCallError."""
        self._final = True
        events: list[Event] = []
        while self._step(events):
            pass
        rest, self._buf = self._buf, ""
        if self._state == "reasoning" and rest:
            events.append(ReasoningDelta(rest))
        elif self._state == "text" and rest:
            events.append(TextDelta(rest))
        elif self._state == "after":
            events.extend(self._after_end(rest))
        elif self._state in ("block", "bad"):
            raw = self._block + rest
            hint = self._hint or (_bad_hint(raw) if self._state == "bad"
                                  else f"the tool call block is not closed with {DSML_CALLS_END}")
            events.append(ToolCallError(hint, raw))
        self._state = "done"
        return events

    # -- one state transition per call; False when waiting for more input --------------

    def _step(self, events: list[Event]) -> bool:
        if self._state == "done":
            self.trailing += self._buf
            self._buf = ""
            return False
        markers = {"reasoning": _REASONING_MARKERS, "text": _TEXT_MARKERS, "block": _BLOCK_MARKERS,
                   "bad": _BAD_MARKERS, "after": _AFTER_MARKERS}[self._state]
        hit = _earliest(self._buf, markers)
        wait = None if self._final else _incomplete_from(self._buf, markers)
        if hit is None or (wait is not None and wait <= hit[0]):
            self._emit_safe(events, len(self._buf) if wait is None else wait)
            return False
        pos, marker = hit
        before, self._buf = self._buf[:pos], self._buf[pos + len(marker):]
        {"reasoning": self._on_reasoning, "text": self._on_text, "block": self._on_block,
         "bad": self._on_bad, "after": self._on_after}[self._state](events, before, marker)
        return True

    def _emit_safe(self, events: list[Event], upto: int) -> None:
        safe, self._buf = self._buf[:upto], self._buf[upto:]
        if not safe:
            return
        if self._state == "reasoning":
            events.append(ReasoningDelta(safe))
        elif self._state == "text":
            events.append(TextDelta(safe))
        else:  # block, bad, after: markup is collected, never shown as text
            self._block += safe

    def _on_reasoning(self, events: list[Event], before: str, marker: str) -> None:
        if before:
            events.append(ReasoningDelta(before))
        if marker == THINK_END:
            self._state = "text"
        elif marker == EOS:
            self._state = "done"
        else:
            self._open_bad(marker, _REASONING_HINT)

    def _on_text(self, events: list[Event], before: str, marker: str) -> None:
        if before:
            events.append(TextDelta(before))
        if marker == EOS:
            self._state = "done"
        elif marker == BLOCK_START:
            self._state, self._block = "block", marker
        else:
            self._open_bad(marker, "")  # V4 spelling or stray markup: told apart at the end

    def _open_bad(self, marker: str, hint: str) -> None:
        self._state, self._block, self._hint = "bad", marker, hint

    def _on_block(self, events: list[Event], before: str, marker: str) -> None:
        raw = self._block + before + marker
        self._block = ""
        if marker == EOS:
            events.append(ToolCallError(f"the tool call block is not closed with {DSML_CALLS_END}", raw[:-len(EOS)]))
            self._state = "done"
            return
        self._pending, self._block, self._state = _block_events(raw), raw, "after"
        self._block_len = len(raw)

    def _on_after(self, events: list[Event], before: str, marker: str) -> None:
        events.extend(self._after_end(before))
        self._state = "done"

    def _after_end(self, rest: str) -> list[Event]:
        """The reply ended after a block: release its events, or refuse the block when
        any text came between it and the end."""
        raw = self._block + rest
        between = raw[self._block_len:]
        pending, self._pending, self._block = self._pending, [], ""
        return [ToolCallError(_AFTER_HINT, raw)] if between else pending

    def _on_bad(self, events: list[Event], before: str, marker: str) -> None:
        raw = self._block + before + ("" if marker == EOS else marker)
        events.append(ToolCallError(self._hint or _bad_hint(raw), raw))
        self._block, self._hint = "", ""
        self._state = "done" if marker == EOS else "text"


def _bad_hint(raw: str) -> str:
    v4 = any(f"{DSML}{tag}" in raw for tag in ("tool_calls", "invoke", "parameter"))
    return _V4_HINT if v4 else _STRAY_HINT


def _block_events(raw: str) -> list[Event]:
    """ToolCall events for a complete block, or one ToolCallError for the whole block."""
    try:
        _, calls = parse_tool_block(raw, len(BLOCK_START))
        return [ToolCall(c.name, typed_arguments(c), c.raw) for c in calls]
    except DSMLError as exc:
        return [ToolCallError(f"{exc}; the tool call block was not run", raw)]
