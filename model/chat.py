"""The DeepSeek-V4.1 chat encoding (ARCHITECTURE.md §4.3), rendered append-only.

Owns: turning OpenAI-style messages into the exact V4.1 prompt text (BOS,
`<｜System｜>`, user/assistant turns, thinking and chat modes, reasoning effort, the
tools block, DSML tool calls, `<tool_result>` blocks in call order, image
placeholders, tasks, `latest_reminder`), and the `Conversation` helper that renders
only what is new so a turn's ids extend the previous turn's ids exactly.

The text matches the official `encoding/encoding.py` byte for byte (see the golden
vectors in `shared/golden/chat-v41`). On top of it every piece of text is tagged: a
`control` segment is markup this encoder wrote, a `content` segment came from a user,
a file, a tool or the model, an `image` segment is a placeholder the encoder put where
an image block was. `Rendered.tokenize` encodes content with added-token matching off,
so literal special tokens or DSML in data never become control ids.

Does not own: tokenization itself (`model/tokenizer.py`), parsing completions
(`model/dsml.py`), expanding image placeholders into image spans (the vision model),
or the transcript store (`sessions`).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from model.tokenizer import Tokenizer

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
THINK_START = "<think>"
THINK_END = "</think>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SYSTEM = "<｜System｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"
DSML = "｜DSML｜"
DSML_CALLS = f"<{DSML} calls>"
DSML_CALLS_END = f"</{DSML} calls>"
DSML_INVOKE_END = f"</{DSML} invoke>"
DSML_PARAMETER_END = f"</{DSML} parameter>"
TASK_TOKENS = {
    "action": "<｜action｜>", "query": "<｜query｜>", "authority": "<｜authority｜>",
    "domain": "<｜domain｜>", "title": "<｜title｜>", "read_url": "<｜read_url｜>",
}
EFFORT_ALIASES = {"low": 50, "high": 75, "max": 100}
DEFAULT_EFFORT = "high"
THINKING_MODES = ("chat", "thinking")
ROLES = ("system", "user", "assistant", "tool", "latest_reminder")
# Roles that survive drop_thinking before the last user turn (assistant is kept too,
# minus its reasoning); anything else there is removed, as in the reference.
DROP_KEEP_ROLES = {"user", "system", "tool", "latest_reminder", "direct_search_results"}

EFFORT_TEMPLATE = ("Reasoning Effort: {budget} (range 1-100, the higher the value, "
                   "the more thorough the reasoning)\n\n")
RESPONSE_FORMAT_PREFIX = ("## Response Format:\n\nYou MUST strictly adhere to the "
                          "following schema to reply:\n")
TOOLS_PREFIX = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "{DSML_CALLS}" block like the following:

{DSML_CALLS}
<{DSML} invoke name="$TOOL_NAME">
<{DSML} parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{DSML_PARAMETER_END}
...
{DSML_INVOKE_END}
<{DSML} invoke name="$TOOL_NAME2">
...
{DSML_INVOKE_END}
{DSML_CALLS_END}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

"""
TOOLS_SUFFIX = ("\n\nYou MUST strictly follow the above defined tool name and parameter "
                "schemas to invoke tool calls.\n")

CONTROL, CONTENT, IMAGE = "control", "content", "image"


class ChatFormatError(ValueError):
    """Messages or options the V4.1 encoding cannot render (the reference refuses them)."""


# -- rendered output -------------------------------------------------------------------

@dataclass(frozen=True)
class Segment:
    text: str
    kind: str  # CONTROL | CONTENT | IMAGE


@dataclass(frozen=True)
class Tokenized:
    ids: list[int]
    image_positions: list[int]  # index in `ids` of each image placeholder, prompt order


@dataclass
class Rendered:
    """A rendered prompt: tagged segments plus the image records in prompt order."""

    segments: list[Segment]
    images: list[dict[str, Any]]

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.segments)

    def tokenize(self, tokenizer: Tokenizer) -> Tokenized:
        ids: list[int] = []
        positions: list[int] = []
        for seg in self.segments:
            if seg.kind == IMAGE:
                positions.append(len(ids))
                ids.append(tokenizer.image_token_id)
            elif seg.kind == CONTROL:
                ids.extend(tokenizer.encode_control(seg.text))
            else:
                ids.extend(tokenizer.encode_content(seg.text))
        return Tokenized(ids, positions)

    def ids(self, tokenizer: Tokenizer) -> list[int]:
        return self.tokenize(tokenizer).ids


class _Out:
    """Segment builder for one message; merges neighbours of the same kind."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []

    def add(self, text: str, kind: str) -> None:
        if not text:
            return
        last = self.segments[-1] if self.segments else None
        if last is not None and last.kind == kind and kind != IMAGE:
            self.segments[-1] = Segment(last.text + text, kind)
        else:
            self.segments.append(Segment(text, kind))

    def control(self, text: str) -> None:
        self.add(text, CONTROL)

    def content(self, text: str) -> None:
        self.add(text, CONTENT)

    def parts(self, parts: list[tuple[str, str]]) -> None:
        """Content parts (kind, text) as produced by _normalize_content."""
        for kind, text in parts:
            self.add(text, kind)


# -- options ---------------------------------------------------------------------------

def effort_budget(effort: str | int | None) -> int:
    """The numeric reasoning budget; aliases low=50, high=75 (default), max=100."""
    if effort is None:
        effort = DEFAULT_EFFORT
    if type(effort) is int and 1 <= effort <= 100:
        return effort
    if isinstance(effort, str) and effort in EFFORT_ALIASES:
        return EFFORT_ALIASES[effort]
    raise ChatFormatError(
        f"invalid reasoning effort {effort!r}: use an int within [1, 100] "
        f"or one of {list(EFFORT_ALIASES)}"
    )


def _check_mode(thinking_mode: str) -> None:
    if thinking_mode not in THINKING_MODES:
        raise ChatFormatError(f"invalid thinking_mode {thinking_mode!r}: use 'chat' or 'thinking'")


# -- content normalisation (images, blocks) ----------------------------------------------

def _image_record(block: dict[str, Any]) -> dict[str, Any]:
    record: dict[str, Any] = {"type": "image"}
    if block.get("type") == "image_url":
        url = block.get("image_url")
        record["url"] = url if isinstance(url, str) else (url or {}).get("url", "")
    else:
        record.update({k: block[k] for k in ("source", "url", "data") if k in block})
    if not any(record.get(k) for k in ("source", "url", "data")):
        raise ChatFormatError("image block has no source: give image_url.url, url, source or data")
    return record


def _check_no_placeholder(text: Any, where: str, literal_ok: bool = False) -> None:
    if not literal_ok and isinstance(text, str) and IMAGE_PLACEHOLDER in text:
        raise ChatFormatError(
            f"{where} contains the image token {IMAGE_PLACEHOLDER!r}; "
            "give images as image content blocks instead"
        )


def _blocks(content: list[Any], images: list[dict[str, Any]], literal_ok: bool = False) -> list[dict[str, Any]]:
    """Validate content blocks; image blocks become {'type': 'image'} markers."""
    out = []
    for block in content:
        if not isinstance(block, dict):
            raise ChatFormatError(f"content block must be an object, got {type(block).__name__}")
        if block.get("type") in ("image", "image_url"):
            images.append(_image_record(block))
            out.append({"type": "image"})
            continue
        if block.get("type") == "text":
            _check_no_placeholder(block.get("text"), "a text block", literal_ok)
        out.append(block)
    return out


def _joined_parts(blocks: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Text and image blocks joined by blank lines (other block types are dropped)."""
    parts: list[tuple[str, str]] = []
    for block in blocks:
        if block["type"] not in ("text", "image"):
            continue
        if parts:
            parts.append((CONTROL, "\n\n"))
        parts.append((IMAGE, IMAGE_PLACEHOLDER) if block["type"] == "image"
                     else (CONTENT, block.get("text") or ""))
    return parts


def _normalize(msg: dict[str, Any], images: list[dict[str, Any]], literal_ok: bool = False) -> dict[str, Any]:
    """A deep copy with `parts` (the content as tagged parts) and, for list content,
    `blocks`; placeholders typed into text are refused."""
    if not isinstance(msg, dict):
        raise ChatFormatError(f"a message must be an object, got {type(msg).__name__}")
    try:
        msg = copy.deepcopy(msg)
    except RecursionError:  # deepcopy recurses a level at a time: ~300 levels exhaust it
        raise ChatFormatError("a message is nested too deeply to render") from None
    content = msg.get("content")
    _check_no_placeholder(content, "message content", literal_ok)
    _check_no_placeholder(msg.get("reasoning_content"), "reasoning_content", literal_ok)
    if isinstance(content, list):
        msg["blocks"] = _blocks(content, images, literal_ok)
        msg["parts"] = _joined_parts(msg["blocks"])
    elif content is None or isinstance(content, str):
        msg["parts"] = [(CONTENT, content)] if content else []
    else:
        raise ChatFormatError(f"content must be a string, a list of blocks or null, got {type(content).__name__}")
    return msg


# -- preprocessing: tool messages into user turns, results in call order -------------------

def _user_blocks(msg: dict[str, Any]) -> list[dict[str, Any]]:
    if "blocks" in msg:
        return msg["blocks"]
    return [{"type": "text", "text": msg.get("content") or ""}]


def _merge_tools(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool messages become `tool_result` blocks of a user turn; a user message right
    after user/tool content joins that turn (unless the turn carries a task)."""
    merged: list[dict[str, Any]] = []
    for msg in messages:
        prev = merged[-1] if merged and merged[-1].get("role") == "user" else None
        if msg.get("role") == "tool":
            block = {"type": "tool_result", "id": msg.get("tool_call_id", ""), "parts": msg["parts"],
                     "none": "content" in msg and msg["content"] is None}
            if prev is not None:
                prev["turn"].append(block)
            else:
                merged.append({"role": "user", "turn": [block]})
        elif msg.get("role") == "user":
            if prev is not None and prev.get("task") is None:
                prev["turn"].extend(_user_blocks(msg))
            else:
                merged.append({**msg, "turn": list(_user_blocks(msg))})
        else:
            merged.append(msg)
    return merged


def _call_id(call: dict[str, Any]) -> str:
    return call.get("id") or (call.get("function") or {}).get("id", "")


def _sort_tool_results(messages: list[dict[str, Any]]) -> None:
    """Stable-sort each turn's tool results into the call order of the latest tool calls
    (unknown ids sort as position 0), in place."""
    order: dict[str, int] = {}
    for msg in messages:
        if msg.get("role") == "assistant" and msg.get("tool_calls"):
            order = {cid: i for i, c in enumerate(msg["tool_calls"]) if (cid := _call_id(c))}
        elif msg.get("role") == "user" and "turn" in msg and order:
            results = [b for b in msg["turn"] if b.get("type") == "tool_result"]
            if len(results) > 1:
                ranked = iter(sorted(results, key=lambda b: order.get(b["id"], 0)))
                msg["turn"] = [next(ranked) if b.get("type") == "tool_result" else b for b in msg["turn"]]


def _last_user_index(messages: list[dict[str, Any]]) -> int:
    """The last user turn; a system message after index 0 counts as one."""
    for i in range(len(messages) - 1, -1, -1):
        role = messages[i].get("role")
        if role == "user" or (role == "system" and i > 0):
            return i
    return -1


def _drop_thinking(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    last_user = _last_user_index(messages)
    kept = []
    for i, msg in enumerate(messages):
        if msg.get("role") in DROP_KEEP_ROLES or i >= last_user:
            kept.append(msg)
        elif msg.get("role") == "assistant":
            kept.append({k: v for k, v in msg.items() if k != "reasoning_content"})
    return kept


# -- tool schemas and namespaces -----------------------------------------------------------

def _to_json(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as exc:  # RecursionError: nested ~1,000 deep
        raise ChatFormatError(f"value is not JSON-serialisable: {exc}") from exc


def split_tool_name(name: str, namespace: str | None = None) -> tuple[str | None, str]:
    """`ns::name` -> (ns, name), checked against an explicit namespace."""
    prefix, sep, bare = str(name).partition("::")
    if sep:
        if namespace is not None and namespace != prefix:
            raise ChatFormatError(f"Conflicting tool namespaces: {namespace} != {prefix}")
        namespace, name = prefix, bare
    if "::" in name:
        raise ChatFormatError(f"Tool name must not contain '::': {name}")
    if namespace is not None and "::" in namespace:
        raise ChatFormatError(f"Tool namespace must not contain '::': {namespace}")
    return namespace, name


def qualified_name(name: Any, namespace: Any = None) -> str:
    if isinstance(namespace, dict):
        namespace = namespace.get("name")
    ns, bare = split_tool_name(str(name), namespace)
    return bare if ns is None else f"{ns}::{bare}"


def _namespace_of(tool: dict[str, Any], function: dict[str, Any]) -> tuple[Any, str]:
    """(namespace name or None, namespace description) from the tool or its function."""
    outer, inner = tool.get("namespace"), function.get("namespace")
    names = [n.get("name") if isinstance(n, dict) else n for n in (outer, inner)]
    if None not in names and names[0] != names[1]:
        raise ChatFormatError(f"Conflicting tool namespaces: {names[0]} != {names[1]}")
    descs = [n.get("description") for n in (outer, inner) if isinstance(n, dict)]
    return (names[0] if names[0] is not None else names[1]), next((d for d in descs if d), "")


def tool_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The function object as rendered: qualified name, namespace description first,
    no `namespace` key, other keys in their order."""
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict):
        raise ChatFormatError("each tool must be an OpenAI tool object with a 'function' object")
    namespace, ns_desc = _namespace_of(tool, function)
    name = qualified_name(function.get("name"), namespace)
    out = {}
    for key, value in function.items():
        if key == "name":
            out["name"] = name
            if ns_desc and "description" not in function:
                out["description"] = ns_desc
        elif key == "description" and ns_desc:
            out["description"] = f"{ns_desc}\n{value}" if value else ns_desc
        elif key != "namespace":
            out[key] = value
    return out


def _render_tools(out: _Out, tools: list[dict[str, Any]]) -> None:
    out.control("\n\n" + TOOLS_PREFIX)
    for i, tool in enumerate(tools):
        if i:
            out.control("\n")
        out.content(_to_json(tool_schema(tool)))
    out.control(TOOLS_SUFFIX)


def _call_arguments(arguments: Any) -> dict[str, Any]:
    """A JSON object, a JSON string of one, or a double-encoded string; anything else is
    wrapped as {"arguments": original}."""
    value = arguments
    for _ in range(2):
        if not isinstance(value, str):
            break
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):  # not JSON, or nested too deep to read: kept as text
            break
    return value if isinstance(value, dict) else {"arguments": arguments}


def _render_tool_calls(out: _Out, calls: list[dict[str, Any]]) -> None:
    out.control(f"\n\n{DSML_CALLS}\n")
    for i, call in enumerate(calls):
        function = call.get("function") or {}
        namespace = call.get("namespace", function.get("namespace"))
        out.control(("\n" if i else "") + f'<{DSML} invoke name="')
        out.content(qualified_name(function.get("name"), namespace))
        out.control('">\n')
        for j, (key, value) in enumerate(_call_arguments(function.get("arguments")).items()):
            is_str = isinstance(value, str)
            out.control(("\n" if j else "") + f'<{DSML} parameter name="')
            out.content(str(key))
            out.control(f'" string="{"true" if is_str else "false"}">')
            out.content(value if is_str else _to_json(value))
            out.control(DSML_PARAMETER_END)
        out.control(f"\n{DSML_INVOKE_END}")
    out.control(f"\n{DSML_CALLS_END}")


# -- one message -------------------------------------------------------------------------

@dataclass
class _Ctx:
    """What rendering message `index` needs to know about the whole conversation."""

    messages: list[dict[str, Any]]
    thinking: bool
    drop_thinking: bool
    budget: int
    last_user: int = field(init=False)

    def __post_init__(self) -> None:
        self.last_user = _last_user_index(self.messages)


def _render_system(out: _Out, index: int, msg: dict[str, Any]) -> None:
    if index > 0:
        out.control(SYSTEM)
    out.parts(msg["parts"])
    if msg.get("tools"):
        _render_tools(out, msg["tools"])
    if msg.get("response_format"):
        out.control("\n\n" + RESPONSE_FORMAT_PREFIX)
        out.content(_to_json(msg["response_format"]))


def _render_tool_result(out: _Out, block: dict[str, Any]) -> None:
    out.control("<tool_result>")
    out.parts(block["parts"] if not block["none"] else [(CONTENT, "None")])
    out.control("</tool_result>")


def _render_user(out: _Out, msg: dict[str, Any]) -> None:
    out.control(USER)
    for i, block in enumerate(msg["turn"]):
        if i:
            out.control("\n\n")
        kind = block.get("type")
        if kind == "text":
            out.content(block.get("text") or "")
        elif kind == "image":
            out.add(IMAGE_PLACEHOLDER, IMAGE)
        elif kind == "tool_result":
            _render_tool_result(out, block)
        else:
            out.content(f"[Unsupported {kind}]")


def _render_assistant(out: _Out, index: int, msg: dict[str, Any], ctx: _Ctx) -> None:
    prev_task = index > 0 and ctx.messages[index - 1].get("task") is not None
    if ctx.thinking and not prev_task and (not ctx.drop_thinking or index > ctx.last_user):
        out.content(msg.get("reasoning_content") or "")
        out.control(THINK_END)
    out.parts(msg["parts"])
    if msg.get("tool_calls"):
        _render_tool_calls(out, msg["tool_calls"])
    if not msg.get("wo_eos", False):
        out.control(EOS)


def _render_header(out: _Out, index: int, ctx: _Ctx) -> None:
    """What follows a message when the next one is not an assistant/reminder: a task
    token, or the generation header for a user (or mid-conversation system) turn."""
    msgs = ctx.messages
    if index + 1 < len(msgs) and msgs[index + 1].get("role") not in ("assistant", "latest_reminder"):
        return
    role, task = msgs[index].get("role"), msgs[index].get("task")
    if task is not None:
        if task not in TASK_TOKENS:
            raise ChatFormatError(f"invalid task {task!r}: use one of {list(TASK_TOKENS)}")
        if task == "action":
            out.control(ASSISTANT + (THINK_START if ctx.thinking else THINK_END))
        out.control(TASK_TOKENS[task])
    elif role == "user" or (role == "system" and index > 0):
        opens = ctx.thinking and (not ctx.drop_thinking or index >= ctx.last_user)
        out.control(ASSISTANT + (THINK_START if opens else THINK_END))


def _render_message(index: int, ctx: _Ctx) -> list[Segment]:
    msg, out = ctx.messages[index], _Out()
    role = msg.get("role")
    effort = EFFORT_TEMPLATE.format(budget=ctx.budget) if index == 0 and ctx.thinking else ""
    if index == 0 and (effort or role == "system"):
        out.control(SYSTEM + effort)
    if role == "system":
        _render_system(out, index, msg)
    elif role == "user":
        _render_user(out, msg)
    elif role == "latest_reminder":
        out.control(LATEST_REMINDER)
        out.parts(msg["parts"] if msg.get("content") is not None else [(CONTENT, "None")])
    elif role == "assistant":
        _render_assistant(out, index, msg, ctx)
    else:
        raise ChatFormatError(f"unknown role {role!r}: use one of {list(ROLES)}")
    _render_header(out, index, ctx)
    return out.segments


# -- the encoder ---------------------------------------------------------------------------

def _prepare(messages: list[dict[str, Any]], context: list[dict[str, Any]], literal_ok: bool = False):
    """Normalise, merge tool messages and sort tool results. Returns (context, messages,
    images of `messages`). Context is merged apart from the new messages, as the
    reference does, so new tool results never join a cached user turn."""
    images: list[dict[str, Any]] = []
    ctx_norm = [_normalize(m, [], literal_ok) for m in context]
    new_norm = [_normalize(m, images, literal_ok) for m in messages]
    ctx_merged, new_merged = _merge_tools(ctx_norm), _merge_tools(new_norm)
    _sort_tool_results(ctx_norm + new_merged)  # calls in the context order new results
    _sort_tool_results(ctx_merged)
    return ctx_merged, new_merged, images


def encode_messages(
    messages: list[dict[str, Any]],
    *,
    thinking_mode: str,
    reasoning_effort: str | int | None = None,
    drop_thinking: bool = True,
    add_default_bos_token: bool = True,
    context: list[dict[str, Any]] | None = None,
    literal_placeholders: bool = False,
) -> Rendered:
    """Render `messages` as the V4.1 prompt; `context` is already in the cache: it is
    not rendered (and gets no BOS) but counts for indices, drop_thinking, tools and
    tool-result order. Raises ChatFormatError for what the reference refuses.

    `literal_placeholders=True` accepts a literal image placeholder inside text (a file or
    tool output quoting it) instead of refusing it as the reference does: the text is
    content, so its tokens never include the image id; only image blocks make images."""
    _check_mode(thinking_mode)
    budget = effort_budget(reasoning_effort)
    ctx_msgs, new_msgs, images = _prepare(messages, context or [], literal_placeholders)
    full = ctx_msgs + new_msgs
    drop = drop_thinking and not any(m.get("tools") for m in full)
    thinking = thinking_mode == "thinking"
    start = len(ctx_msgs)
    if thinking and drop:
        full = _drop_thinking(full)
        start = len(_drop_thinking(ctx_msgs))
    ctx = _Ctx(full, thinking, drop, budget)
    segments = [Segment(BOS, CONTROL)] if add_default_bos_token and not ctx_msgs else []
    for index in range(start, len(full)):
        segments.extend(_render_message(index, ctx))
    return Rendered(segments, images)


# -- append-only conversation ----------------------------------------------------------------

class Conversation:
    """The messages and token ids already in the token log, extended turn by turn.

    `append` renders only the new messages (the reference's `context` option), so the
    ids it returns extend `ids` exactly and the cached prefix stays valid. The model's
    own output goes in with `add_generated`: its ids are logged as generated, never
    re-rendered.
    """

    def __init__(self, tokenizer: Tokenizer, *, thinking_mode: str,
                 reasoning_effort: str | int | None = None, drop_thinking: bool = True,
                 add_default_bos_token: bool = True) -> None:
        _check_mode(thinking_mode)
        effort_budget(reasoning_effort)
        self.tokenizer = tokenizer
        self.options = dict(thinking_mode=thinking_mode, reasoning_effort=reasoning_effort,
                            drop_thinking=drop_thinking, add_default_bos_token=add_default_bos_token)
        self.messages: list[dict[str, Any]] = []
        self.ids: list[int] = []
        self.image_positions: list[int] = []
        self.images: list[dict[str, Any]] = []

    def render(self, new_messages: list[dict[str, Any]]) -> Rendered:
        """What `append` would add, without changing the conversation."""
        return encode_messages(new_messages, context=self.messages, **self.options)

    def append(self, new_messages: list[dict[str, Any]]) -> list[int]:
        """Render and log `new_messages`; returns the new ids only."""
        rendered = self.render(new_messages)
        tokens = rendered.tokenize(self.tokenizer)
        self.image_positions.extend(len(self.ids) + p for p in tokens.image_positions)
        self.ids.extend(tokens.ids)
        self.images.extend(rendered.images)
        self.messages.extend(copy.deepcopy(new_messages))
        return tokens.ids

    def add_generated(self, message: dict[str, Any], ids: list[int]) -> None:
        """Log the assistant message the model produced (e.g. from dsml.parse_completion)
        together with exactly the ids it generated, EOS included when it stopped on it."""
        if message.get("role") != "assistant":
            raise ChatFormatError("add_generated takes the assistant message the model produced")
        self.messages.append(copy.deepcopy(message))
        self.ids.extend(ids)
