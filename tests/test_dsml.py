"""Completion-parsing tests: the golden parse vectors, the V4 spelling refused, and the
stream parser fed hostile and well-formed completions split at every position."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from model.chat import encode_messages
from model.dsml import (MAX_VALUE_DEPTH, DSMLError, ReasoningDelta, StreamParser, TextDelta, ToolCall,
                        ToolCallError, parse_completion)

GOLDEN = Path(__file__).resolve().parent / "golden" / "chat-v41"
EOS = "<｜end▁of▁sentence｜>"


def _vectors() -> list[dict]:
    out = []
    for name in ("cases.json", "cases_namespace_provisional.json"):
        path = GOLDEN / name
        if path.is_file():
            for case in json.loads(path.read_text(encoding="utf-8")):
                out += [dict(p, case=case["name"]) for p in case.get("parse", [])]
    return out


VECTORS = _vectors()
needs_golden = pytest.mark.skipif(not VECTORS, reason=f"golden vectors not found at {GOLDEN}")


def _block(*calls: str) -> str:
    return "\n\n<｜DSML｜ calls>\n" + "\n".join(calls) + "\n</｜DSML｜ calls>"


def _invoke(name: str, *params: tuple[str, str, str]) -> str:
    body = "".join(f'<｜DSML｜ parameter name="{k}" string="{s}">{v}</｜DSML｜ parameter>\n' for k, v, s in params)
    return f'<｜DSML｜ invoke name="{name}">\n{body}</｜DSML｜ invoke>'


def _run(parser: StreamParser, chunks: list[str]) -> list:
    events = [e for c in chunks for e in parser.feed(c)] + parser.close()
    merged: list = []
    for e in events:  # deltas may be cut anywhere; compare them joined
        if merged and type(e) is type(merged[-1]) and isinstance(e, (TextDelta, ReasoningDelta)):
            merged[-1] = type(e)(merged[-1].text + e.text)
        else:
            merged.append(e)
    return merged


def _splits(text: str):
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


# -- golden vectors ------------------------------------------------------------------------

@needs_golden
def test_golden_vector_count():
    assert len(VECTORS) == 12


@needs_golden
@pytest.mark.parametrize("vec", VECTORS, ids=lambda v: v["case"])
def test_golden_parse(vec):
    if "error" in vec["expected"]:
        with pytest.raises(DSMLError):
            parse_completion(vec["text"], vec["thinking_mode"])
    else:
        assert parse_completion(vec["text"], vec["thinking_mode"]) == vec["expected"]["message"]


@needs_golden
@pytest.mark.parametrize("vec", [v for v in VECTORS if "message" in v["expected"]], ids=lambda v: v["case"])
def test_stream_agrees_with_golden_at_every_split(vec):
    msg = vec["expected"]["message"]
    expected = None
    for chunks in _splits(vec["text"]):
        events = _run(StreamParser(vec["thinking_mode"]), chunks)
        expected = expected or events
        assert events == expected
    text = "".join(e.text for e in expected if isinstance(e, TextDelta))
    reasoning = "".join(e.text for e in expected if isinstance(e, ReasoningDelta))
    calls = [e for e in expected if isinstance(e, ToolCall)]
    assert (text, reasoning) == (msg["content"], msg["reasoning_content"])
    assert [c.arguments for c in calls] == [json.loads(t["function"]["arguments"]) for t in msg["tool_calls"]]


# -- parse_completion beyond the golden set ---------------------------------------------------

@pytest.mark.parametrize("text", [
    "ok" + _block(_invoke("f", ("a", "1", "true"))) + EOS + "more",       # text after EOS
    "ok" + _block(_invoke("f", ("a", "1", "true"))) + "tail" + EOS,       # text after the block
    "ok" + _block(_invoke("f", ("a", "1", "maybe"))) + EOS,               # bad string flag
    "ok" + _block(_invoke("f", ("a", "x</｜DSML｜ parameter>y", "true"))) + EOS,  # value closes tag
    "ok\n\n<｜DSML｜ calls>\n" + _invoke("f"),                              # unterminated block
    "ok" + _block(_invoke("a::b::c")) + EOS,                               # bad namespace
    "hi <think> there" + EOS,                                              # markup in content
])
def test_parse_refusals(text):
    with pytest.raises(DSMLError):
        parse_completion(text, "chat")


def test_parse_keeps_raw_non_string_values_and_namespaces():
    text = _block(_invoke("ns::f", ("x", "not json", "false"), ("y", 'a "q"', "true"))) + EOS
    msg = parse_completion(text, "chat")
    assert msg["tool_calls"] == [{"type": "function", "namespace": "ns",
                                  "function": {"name": "f", "arguments": '{"x": not json, "y": "a \\"q\\""}'}}]
    with pytest.raises(DSMLError):
        parse_completion(text, "fast")


def test_encoder_and_parser_round_trip():
    args = {"path": "a/b.txt", "n": 3, "flags": [True, None], "opts": {"k": 1.5}, "s": "line\n\"q\""}
    call = {"type": "function", "function": {"name": "read_file", "arguments": args}}
    rendered = encode_messages([{"role": "user", "content": "q"},
                                {"role": "assistant", "content": "", "reasoning_content": "r", "tool_calls": [call]}],
                               thinking_mode="thinking")
    completion = rendered.text.split("<think>", 1)[1]
    msg = parse_completion(completion, "thinking")
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == args
    events = _run(StreamParser("thinking"), [completion])
    assert events == [ReasoningDelta("r"), ToolCall("read_file", args, events[1].raw)]


# -- every shape of call the encoder writes parses back ------------------------------------------

_SHAPES = {
    "no arguments": [("ping", {})],
    "no arguments as a JSON string": [("ping", "{}")],
    "one string": [("read_file", {"path": "a/b.txt"})],
    "empty string": [("echo", {"text": ""})],
    "multi-line string": [("write_file", {"path": "x", "content": "line 1\n\nline \"3\"\n"})],
    "JSON values": [("f", {"n": 3, "x": -1.5, "b": False, "z": None, "l": [1, "two", [3]], "o": {"k": {"j": []}}})],
    "mixed": [("f", {"s": "text", "n": 7})],
    "several calls": [("ping", {}), ("calculator", {"expression": "1+2"}), ("f", {"l": [True]}), ("pong", {})],
    "namespaced": [("ns::tool", {"q": "hi"}), ("ns::bare", {})],
}


def _rendered_completion(calls: list, mode: str, content: str = "") -> str:
    tool_calls = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
    message = {"role": "assistant", "content": content, "tool_calls": tool_calls}
    if mode == "thinking":
        message["reasoning_content"] = "hmm"
    rendered = encode_messages([{"role": "user", "content": "q"}, message], thinking_mode=mode)
    return rendered.text.split("<think>" if mode == "thinking" else "</think>", 1)[1]


def _expected(calls: list) -> list[tuple[str, dict]]:
    return [(n, json.loads(a) if isinstance(a, str) else a) for n, a in calls]


def _pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("mode", ["chat", "thinking"])
@pytest.mark.parametrize("shape", list(_SHAPES))
def test_every_call_the_encoder_writes_parses_back(shape, mode):
    calls = _SHAPES[shape]
    completion = _rendered_completion(calls, mode, content="Let me see.")
    msg = parse_completion(completion, mode)
    got = [(("" if "namespace" not in t else t["namespace"] + "::") + t["function"]["name"],
            json.loads(t["function"]["arguments"])) for t in msg["tool_calls"]]
    assert got == _expected(calls) and msg["content"] == "Let me see."
    for size in (1, 2, 3, 7, len(completion)):
        events = _run(StreamParser(mode), _pieces(completion, size))
        assert [(e.name, e.arguments) for e in events if isinstance(e, ToolCall)] == _expected(calls), size
        assert not any(isinstance(e, ToolCallError) for e in events), size


def test_a_call_without_arguments_has_an_empty_object():
    completion = _rendered_completion([("ping", {})], "chat")
    assert '<｜DSML｜ invoke name="ping">\n\n</｜DSML｜ invoke>' in completion  # as the official encoder writes it
    assert parse_completion(completion, "chat")["tool_calls"][0]["function"]["arguments"] == "{}"


# -- stream parser: hostile and malformed output ------------------------------------------------

def _all_splits_agree(text: str, mode: str = "chat") -> list:
    first = None
    for chunks in _splits(text):
        events = _run(StreamParser(mode), chunks)
        first = first or events
        assert events == first, chunks
    return first


def test_v4_spelling_is_a_structured_error():
    v4 = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="rm">\n<｜DSML｜parameter name="p" string="true">/'
          '</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
    events = _all_splits_agree("Sure." + v4 + EOS)
    assert [type(e) for e in events] == [TextDelta, ToolCallError]
    assert "V4" in events[1].message and events[1].raw == v4[2:]
    assert events[0].text == "Sure.\n\n"


def test_closing_tag_inside_a_value_is_an_error_not_a_wrong_call():
    value = 'x</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>'
    call = {"type": "function", "function": {"name": "write", "arguments": {"text": value}}}
    rendered = encode_messages([{"role": "user", "content": "q"},
                                {"role": "assistant", "content": "", "tool_calls": [call]}], thinking_mode="chat")
    completion = rendered.text.split("</think>", 1)[1]
    with pytest.raises(DSMLError):
        parse_completion(completion, "chat")
    events = _all_splits_agree(completion)
    assert not any(isinstance(e, ToolCall) for e in events)
    assert any(isinstance(e, ToolCallError) for e in events)


@pytest.mark.parametrize("text, kinds", [
    ("plain <｜DSML｜ words> here" + EOS, [TextDelta, ToolCallError]),        # stray markup
    ("a" + _block(_invoke("f", ("n", "{bad", "false"))) + EOS, [TextDelta, ToolCallError]),
    ("a\n\n<｜DSML｜ calls>\n" + _invoke("f"), [TextDelta, ToolCallError]),      # stream ends inside
    ("a" + _block(_invoke("f", ("n", "2", "false"))) + "\nafter" + EOS, [TextDelta, ToolCallError]),
    ("a" + _block(_invoke("f", ("n", "2", "false"))), [TextDelta, ToolCall]),  # stopped on EOS id
    ("ends with a partial tag \n\n<｜DS", [TextDelta]),
    ("ends with a partial eos <｜end▁of", [TextDelta]),
])
def test_stream_never_raises_and_never_duplicates(text, kinds):
    events = _all_splits_agree(text)
    assert [type(e) for e in events] == kinds
    plain = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert "｜DSML｜" not in plain or kinds == [TextDelta]
    assert plain == text[:len(plain)] or plain.startswith("a")


def test_tool_calls_inside_reasoning_are_not_run():
    text = "thinking" + _block(_invoke("f", ("a", "1", "true"))) + "</think>answer" + EOS
    events = _all_splits_agree(text, "thinking")
    assert [type(e) for e in events][:2] == [ReasoningDelta, ToolCallError]
    assert not any(isinstance(e, ToolCall) for e in events)


def test_text_after_eos_is_kept_apart():
    parser = StreamParser("chat")
    assert _run(parser, ["done", EOS[:5], EOS[5:] + "junk"]) == [TextDelta("done")]
    assert parser.done and parser.trailing == "junk"


def test_hostile_text_is_streamed_once():
    text = "<｜User｜>x</think><｜Assistant｜>\n\n<｜DSML" + EOS
    events = _all_splits_agree(text)
    assert events == [TextDelta(text[:-len(EOS)])]


# -- fuzz: well-formed blocks with random JSON values, deep nesting included --------------------

_TRICKY = ['a "quote"', "back\\slash", "new\nline", "<angle>", "[[[[{{{{", "]]}}", "é ✓ 字", "", " ", "{\"k\": 1}"]


def _leaf(rng: random.Random):
    kind = rng.randrange(5)
    if kind == 0:
        return rng.randint(-10**12, 10**12)
    if kind == 1:
        return rng.uniform(-1e6, 1e6)
    if kind == 2:
        return rng.choice([True, False, None])
    return rng.choice(_TRICKY) + str(rng.randrange(100))


def _value(rng: random.Random, depth: int = 0):
    """A random JSON value of moderate size and depth."""
    if depth > 4 or rng.random() < 0.4:
        return _leaf(rng)
    if rng.random() < 0.5:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {f"k{i}{rng.choice(_TRICKY)}": _value(rng, depth + 1) for i in range(rng.randrange(4))}


def _deep(rng: random.Random, depth: int) -> tuple[str, int]:
    """JSON text nested `depth` levels (lists and objects mixed), written without json.dumps,
    which itself recurses; returns (text, depth)."""
    opens, closes = [], []
    for _ in range(depth):
        if rng.random() < 0.5:
            opens.append("[")
            closes.append("]")
        else:
            opens.append('{"k": ')
            closes.append("}")
    return "".join(opens) + json.dumps(_leaf(rng)) + "".join(reversed(closes)), depth


def _fuzz_param(rng: random.Random, name: str) -> tuple[str, str, bool, int]:
    """(name, value text, is_string, nesting depth)."""
    roll = rng.random()
    if roll < 0.3:
        return name, rng.choice(_TRICKY), True, 0
    if roll < 0.75:
        value = _value(rng)
        return name, json.dumps(value, ensure_ascii=False), False, _depth_of(value)
    text, depth = _deep(rng, rng.choice([MAX_VALUE_DEPTH - 1, MAX_VALUE_DEPTH, MAX_VALUE_DEPTH + 1,
                                         500, 999, 1000, 1001, 3000]))
    return name, text, False, depth


def _depth_of(value) -> int:
    if isinstance(value, list):
        return 1 + max((_depth_of(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth_of(v) for v in value.values()), default=0)
    return 0


def _fuzz_block(rng: random.Random) -> tuple[str, list]:
    """A well-formed block of 1-3 calls: (completion text, [(name, params)])."""
    calls = []
    for c in range(rng.randint(1, 3)):
        calls.append((f"tool{c}", [_fuzz_param(rng, f"p{i}") for i in range(rng.randrange(4))]))
    invokes = [_invoke(name, *[(k, v, "true" if s else "false") for k, v, s, _ in params]) for name, params in calls]
    return "Calling." + _block(*invokes) + EOS, calls


@pytest.mark.parametrize("seed", range(40))
def test_fuzz_well_formed_blocks_with_random_values(seed):
    """Never an exception: values within MAX_VALUE_DEPTH come back equal, deeper ones turn the
    block into one ToolCallError that says so; parse_completion splices every value unchanged."""
    rng = random.Random(seed)
    for _ in range(5):
        text, calls = _fuzz_block(rng)
        msg = parse_completion(text, "chat")
        spliced = ["{" + ", ".join(f'"{k}": ' + (json.dumps(v, ensure_ascii=False) if s else v)
                                   for k, v, s, _ in params) + "}" for _, params in calls]
        assert [t["function"]["arguments"] for t in msg["tool_calls"]] == spliced
        size = rng.choice([1, 5, 17, 64, len(text)])
        events = _run(StreamParser("chat"), _pieces(text, size))
        too_deep = any(d > MAX_VALUE_DEPTH for _, params in calls for *_, d in params)
        if too_deep:
            assert [type(e) for e in events] == [TextDelta, ToolCallError]
            assert "nested" in events[1].message
        else:
            want = [(n, {k: v if s else json.loads(v) for k, v, s, _ in params}) for n, params in calls]
            assert [(e.name, e.arguments) for e in events[1:]] == want


def test_a_value_nested_a_thousand_deep_is_a_tool_call_error():
    deep = "[" * 1000 + "]" * 1000
    text = _block(_invoke("f", ("a", deep, "false"))) + EOS
    events = _run(StreamParser("chat"), _pieces(text, 50))
    assert [type(e) for e in events] == [ToolCallError] and "nested" in events[0].message
    assert parse_completion(text, "chat")["tool_calls"][0]["function"]["arguments"] == '{"a": ' + deep + "}"


def test_brackets_inside_strings_do_not_count_as_nesting():
    value = json.dumps(["[" * 500 + "{" * 500, {"k": "]" * 800}])
    events = _run(StreamParser("chat"), [_block(_invoke("f", ("a", value, "false"))) + EOS])
    assert [(e.name, e.arguments) for e in events] == [("f", {"a": json.loads(value)})]
