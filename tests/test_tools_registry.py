"""Tool schemas from typed functions, argument validation, toolboxes, import rules."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Literal, Optional

import pytest

from tools import (
    Tool,
    ToolArgumentError,
    Toolbox,
    ToolContext,
    ToolDefinitionError,
    UnknownToolError,
    builtin_toolbox,
)


def search(
    ctx: ToolContext,
    query: str,
    limit: int = 10,
    mode: Literal["fast", "exact"] = "fast",
    tags: list[str] | None = None,
    threshold: Optional[float] = None,
    verbose: bool = False,
) -> str:
    """Search the notes for a query.

    A second paragraph that is
    wrapped over two lines.

    Args:
        query: what to look for
        limit: how many hits at most;
            counted after filtering
        mode: how to match
    Returns:
        the hits
    """
    return f"{query}:{limit}:{mode}:{tags}:{threshold}:{verbose}"


def test_schema_from_signature_has_openai_shape() -> None:
    schema = Tool.from_function(search).schema()
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "search"
    assert fn["description"] == "Search the notes for a query.\n\nA second paragraph that is wrapped over two lines."
    params = fn["parameters"]
    assert params["type"] == "object"
    assert params["required"] == ["query"]
    props = params["properties"]
    assert list(props) == ["query", "limit", "mode", "tags", "threshold", "verbose"]  # ctx is hidden
    assert props["query"] == {"type": "string", "description": "what to look for"}
    assert props["limit"] == {"type": "integer", "description": "how many hits at most; counted after filtering",
                              "default": 10}
    assert props["mode"] == {"type": "string", "enum": ["fast", "exact"], "description": "how to match",
                             "default": "fast"}
    assert props["tags"] == {"type": "array", "items": {"type": "string"}}
    assert props["threshold"] == {"type": "number"}
    assert props["verbose"] == {"type": "boolean", "default": False}


def test_context_parameter_is_recorded() -> None:
    tool = Tool.from_function(search)
    assert tool.context_arg == "ctx"
    assert not tool.needs_approval


def test_bind_coerces_harmless_spellings() -> None:
    tool = Tool.from_function(search)
    bound = tool.bind({"query": "x", "limit": "5", "tags": '["a", "b"]', "threshold": 1, "verbose": "true"})
    assert bound == {"query": "x", "limit": 5, "tags": ["a", "b"], "threshold": 1, "verbose": True}
    assert tool.bind({"query": 7, "limit": 3.0})["query"] == "7"
    assert tool.bind({"query": "x", "threshold": None})["threshold"] is None


@pytest.mark.parametrize(
    "arguments, fragment",
    [
        ({}, "missing required argument 'query'"),
        ({"query": "x", "colour": 1}, "unknown argument 'colour'"),
        ({"query": "x", "limit": "five"}, "argument 'limit' must be an integer, got str 'five'"),
        ({"query": "x", "limit": 2.5}, "argument 'limit' must be an integer"),
        ({"query": "x", "limit": True}, "argument 'limit' must be an integer"),
        ({"query": "x", "mode": "slow"}, "must be one of ['fast', 'exact']"),
        ({"query": "x", "tags": [1, [2]]}, "argument 'tags[1]' must be a string"),
        ({"query": None}, "argument 'query' must be a string"),
    ],
)
def test_bind_explains_bad_arguments(arguments: dict, fragment: str) -> None:
    with pytest.raises(ToolArgumentError, match="accepted arguments: query, limit") as info:
        Tool.from_function(search).bind(arguments)
    assert fragment in str(info.value)


def test_bind_reports_every_problem_at_once() -> None:
    with pytest.raises(ToolArgumentError) as info:
        Tool.from_function(search).bind({"colour": 1, "limit": "x"})
    message = str(info.value)
    assert "unknown argument 'colour'" in message and "missing required argument 'query'" in message
    assert "'limit' must be an integer" in message


def test_invoke_passes_context_and_arguments(tmp_path: Path) -> None:
    from tools import Workspace

    tool = Tool.from_function(search)
    ctx = ToolContext(Workspace(tmp_path))
    assert tool.invoke(ctx, tool.bind({"query": "q"})) == "q:10:fast:None:None:False"


def undocumented(x: int) -> int:
    return x


def unhinted(x):  # type: ignore[no-untyped-def]
    """Has no hints."""
    return x


def variadic(*values: int) -> int:
    """Takes *args."""
    return sum(values)


def odd_type(x: set[int]) -> int:
    """Takes a set."""
    return len(x)


@pytest.mark.parametrize(
    "func, fragment",
    [(undocumented, "needs a docstring"), (unhinted, "needs a type hint"), (variadic, "*args"),
     (odd_type, "has no JSON schema")],
)
def test_functions_that_cannot_be_tools_are_refused(func, fragment: str) -> None:
    with pytest.raises(ToolDefinitionError, match=fragment.replace("*", r"\*")):
        Tool.from_function(func)


def test_bad_tool_name_is_refused() -> None:
    with pytest.raises(ToolDefinitionError, match="must match"):
        Tool.from_function(search, name="two words")


def test_toolbox_select_get_and_duplicates() -> None:
    box = builtin_toolbox()
    assert box.names() == ["read_file", "list_dir", "write_file", "edit_file", "run_shell", "calculator",
                           "view_image"]
    picked = box.select(["calculator", "read_file"])
    assert picked.names() == ["calculator", "read_file"]
    assert "run_shell" not in picked and len(picked) == 2
    with pytest.raises(UnknownToolError, match="available tools: read_file"):
        box.select(["nope"])
    with pytest.raises(ToolDefinitionError, match="already in the toolbox"):
        box.add(box.get("calculator"))


def test_toolbox_add_plain_function_with_flags() -> None:
    box = Toolbox()
    tool = box.add(search, writes=True)
    assert tool.writes and tool.needs_approval
    assert box.schemas() == [tool.schema()]


def test_builtin_flags() -> None:
    box = builtin_toolbox()
    assert {t.name for t in box if t.writes} == {"write_file", "edit_file"}
    assert {t.name for t in box if t.executes} == {"run_shell"}


def test_tools_package_imports_no_other_package() -> None:
    forbidden = {"model", "sessions", "dsagent"}
    package = Path(__file__).resolve().parent.parent / "tools"
    for source in package.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {(node.module or "").split(".")[0]}
            else:
                continue
            assert not roots & forbidden, f"{source.name} imports {roots & forbidden}"
