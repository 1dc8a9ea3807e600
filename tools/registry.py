"""Tools built from plain typed Python functions, and toolboxes of them.

Owns `Tool` (a function plus its name, description, JSON schema and the flags that
decide approval), argument validation and coercion against that schema, and `Toolbox`
(a named set of tools). The docstring is the description (an `Args:` section gives
per-parameter descriptions) and the type hints are the schema. A parameter annotated
`ToolContext` receives the workspace and limits and is not shown to the model.

Does not own running tools, approvals or limits (runner.py, limits.py), nor the
built-in tools (builtin.py), nor how schemas become tokens (the chat encoder renders
`Tool.schema()`, which has the OpenAI function shape).
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Literal, Mapping, Union

from tools.errors import ToolArgumentError, ToolDefinitionError, UnknownToolError
from tools.limits import ToolContext

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")
_PRIMITIVES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}
_JSON_TYPE_OF_VALUE: dict[type, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


# --- schema from type hints -------------------------------------------------------


def _schema_for(hint: Any, where: str) -> dict[str, Any]:
    """JSON schema of one type hint (None already stripped from unions)."""
    origin = typing.get_origin(hint)
    if hint in _PRIMITIVES:
        return {"type": _PRIMITIVES[hint]}
    if origin is Literal:
        values = list(typing.get_args(hint))
        kinds = {_JSON_TYPE_OF_VALUE.get(type(v)) for v in values}
        if None in kinds or len(kinds) != 1:
            raise ToolDefinitionError(f"{where}: Literal values must be of one of str/int/float/bool")
        return {"type": kinds.pop(), "enum": values}
    if hint is list or origin is list:
        args = typing.get_args(hint)
        return {"type": "array", "items": _schema_for(args[0], where)} if args else {"type": "array"}
    if hint is dict or origin is dict:
        return {"type": "object"}
    if origin in (Union, types.UnionType):
        return {"anyOf": [_schema_for(arg, where) for arg in typing.get_args(hint)]}
    raise ToolDefinitionError(f"{where}: type {hint!r} has no JSON schema; use str, int, float, "
                              "bool, Literal, list[...], dict or Optional of those")


def _strip_none(hint: Any) -> tuple[Any, bool]:
    """(hint without None, whether None was allowed) for `X | None` / `Optional[X]`."""
    if typing.get_origin(hint) not in (Union, types.UnionType):
        return hint, False
    args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    if len(args) == len(typing.get_args(hint)):
        return hint, False
    return (args[0] if len(args) == 1 else Union[tuple(args)]), True


def _split_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) from a docstring with an `Args:` section."""
    head, _, args = doc.partition("\nArgs:\n")
    described: dict[str, str] = {}
    name, indent = None, None
    for line in args.splitlines():
        if line and not line[0].isspace():
            break  # the next section (Returns:, Raises:) starts
        match = re.match(r"^(\s*)(\w+)\s*(?:\([^)]*\))?:\s*(.*)$", line)
        if match and indent in (None, len(match[1])):
            indent, name = len(match[1]), match[2]
            described[name] = match[3].strip()
        elif name and line.strip():
            described[name] += " " + line.strip()
    paragraphs = re.split(r"\n\s*\n", head.strip())  # hard wraps inside a paragraph are undone
    return "\n\n".join(" ".join(p.split()) for p in paragraphs), described


# --- parameters and argument coercion -----------------------------------------------


@dataclass(frozen=True)
class Param:
    """One model-visible parameter of a tool."""

    name: str
    schema: dict[str, Any]  # JSON schema of the value, without the description
    required: bool
    default: Any
    nullable: bool  # None is accepted (the hint was Optional)
    description: str = ""

    def property_schema(self) -> dict[str, Any]:
        prop = dict(self.schema)
        if self.description:
            prop["description"] = self.description
        if not self.required and self.default is not None:
            prop["default"] = self.default
        return prop


def _type_error(where: str, expected: str, value: Any) -> ToolArgumentError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return ToolArgumentError(f"argument {where!r} must be {expected}, got {type(value).__name__} {shown}")


def _coerce_scalar(value: Any, kind: str, where: str) -> Any:
    """Accept the value if it is of `kind`, or a lossless spelling of one (e.g. "3")."""
    if kind == "string" and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    if kind == "boolean":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    if kind in ("integer", "number") and not isinstance(value, bool):
        number = _as_number(value)
        if kind == "number" and number is not None:
            return number
        if kind == "integer" and number is not None and float(number).is_integer():
            return int(number)
    raise _type_error(where, {"integer": "an integer", "number": "a number",
                              "boolean": "true or false"}.get(kind, f"a {kind}"), value)


def _as_number(value: Any) -> int | float | None:
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        for parse in (int, float):
            try:
                return parse(value.strip())
            except ValueError:
                continue
    return None


def _coerce(value: Any, schema: Mapping[str, Any], where: str) -> Any:
    """Validate `value` against `schema`, converting harmless spellings; raise otherwise."""
    if "anyOf" in schema:
        return _coerce_any_of(value, schema["anyOf"], where)
    kind = schema["type"]
    if kind == "array":
        items = _decode_json(value, list)
        if not isinstance(items, list):
            raise _type_error(where, "a list", value)
        item_schema = schema.get("items")
        return [_coerce(v, item_schema, f"{where}[{i}]") for i, v in enumerate(items)] if item_schema else items
    if kind == "object":
        obj = _decode_json(value, dict)
        if not isinstance(obj, dict):
            raise _type_error(where, "an object", value)
        return obj
    result = _coerce_scalar(value, kind, where)
    if "enum" in schema and result not in schema["enum"]:
        raise ToolArgumentError(f"argument {where!r} must be one of {schema['enum']}, got {value!r}")
    return result


def _coerce_any_of(value: Any, options: list[dict[str, Any]], where: str) -> Any:
    for option in options:
        try:
            return _coerce(value, option, where)
        except ToolArgumentError:
            continue
    raise _type_error(where, " or ".join(str(o.get("type", "?")) for o in options), value)


def _decode_json(value: Any, want: type) -> Any:
    """A list or dict that arrived as JSON text is decoded; anything else is returned."""
    if isinstance(value, str):
        try:
            decoded = json.loads(value)
        except ValueError:
            return value
        return decoded if isinstance(decoded, want) else value
    return value


# --- tools --------------------------------------------------------------------------


@dataclass(frozen=True)
class Tool:
    """A plain Python function the model may call, with what the model is told about it."""

    name: str
    description: str
    func: Callable[..., Any]
    params: tuple[Param, ...]
    context_arg: str | None = None  # the parameter that receives the ToolContext
    writes: bool = False  # changes files: needs approval under the `ask` policy
    executes: bool = False  # runs programs: needs approval under the `ask` policy

    @classmethod
    def from_function(
        cls, func: Callable[..., Any], *, name: str | None = None, writes: bool = False, executes: bool = False
    ) -> Tool:
        """Build a tool from a typed function with a docstring."""
        tool_name = name or func.__name__
        if not _NAME.match(tool_name):
            raise ToolDefinitionError(f"tool name {tool_name!r} must match {_NAME.pattern}")
        doc = inspect.getdoc(func)
        if not doc:
            raise ToolDefinitionError(f"tool {tool_name!r} needs a docstring: it is the description the model reads")
        description, arg_docs = _split_docstring(doc)
        params, context_arg = _params_of(func, tool_name, arg_docs)
        return cls(tool_name, description, func, params, context_arg, writes, executes)

    @property
    def needs_approval(self) -> bool:
        return self.writes or self.executes

    @property
    def parameters(self) -> dict[str, Any]:
        """The JSON schema of the arguments object."""
        return {
            "type": "object",
            "properties": {p.name: p.property_schema() for p in self.params},
            "required": [p.name for p in self.params if p.required],
        }

    def schema(self) -> dict[str, Any]:
        """The OpenAI function shape that the chat encoder renders into the system prompt."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def bind(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """Validated, coerced keyword arguments; raise `ToolArgumentError` with all problems."""
        known = {p.name: p for p in self.params}
        problems = [f"unknown argument {k!r}" for k in arguments if k not in known]
        problems += [f"missing required argument {p.name!r}" for p in self.params
                     if p.required and p.name not in arguments]
        bound: dict[str, Any] = {}
        for key, value in arguments.items():
            if key in known:
                try:
                    bound[key] = self._coerce_param(known[key], value)
                except ToolArgumentError as exc:
                    problems.append(str(exc))
        if problems:
            accepted = ", ".join(p.name for p in self.params) or "none"
            raise ToolArgumentError(f"{self.name}: {'; '.join(problems)} (accepted arguments: {accepted})")
        return bound

    def invoke(self, context: ToolContext, arguments: Mapping[str, Any]) -> Any:
        """Call the function with already-bound arguments and the context it asked for."""
        kwargs = dict(arguments)
        if self.context_arg:
            kwargs[self.context_arg] = context
        return self.func(**kwargs)

    @staticmethod
    def _coerce_param(param: Param, value: Any) -> Any:
        if value is None and param.nullable:
            return None
        if value is None and not param.required:
            return param.default
        return _coerce(value, param.schema, param.name)


def _params_of(func: Callable[..., Any], tool: str, docs: dict[str, str]) -> tuple[tuple[Param, ...], str | None]:
    """The model-visible parameters of `func`, and the name of its ToolContext parameter."""
    try:
        hints = typing.get_type_hints(func)
    except Exception as exc:
        raise ToolDefinitionError(f"tool {tool!r}: cannot read its type hints ({exc})") from exc
    params: list[Param] = []
    context_arg = None
    for p in inspect.signature(func).parameters.values():
        where = f"tool {tool!r}, parameter {p.name!r}"
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            raise ToolDefinitionError(f"{where}: *args, **kwargs and positional-only parameters are not supported")
        if p.name not in hints:
            raise ToolDefinitionError(f"{where}: needs a type hint; hints are the schema the model reads")
        if hints[p.name] is ToolContext:
            context_arg = p.name
            continue
        params.append(_param(p, hints[p.name], where, docs.get(p.name, "")))
    return tuple(params), context_arg


def _param(p: inspect.Parameter, hint: Any, where: str, description: str) -> Param:
    inner, nullable = _strip_none(hint)
    required = p.default is inspect.Parameter.empty
    default = None if required else p.default
    return Param(p.name, _schema_for(inner, where), required, default, nullable, description)


# --- toolboxes ----------------------------------------------------------------------


class Toolbox:
    """A named set of tools, in the order they were added."""

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            self.add(tool)

    def add(self, tool: Tool | Callable[..., Any], *, writes: bool = False, executes: bool = False) -> Tool:
        """Add a tool (or a plain function, turned into one); names must be unique."""
        if not isinstance(tool, Tool):
            tool = Tool.from_function(tool, writes=writes, executes=executes)
        if tool.name in self._tools:
            raise ToolDefinitionError(f"a tool named {tool.name!r} is already in the toolbox")
        self._tools[tool.name] = tool
        return tool

    def get(self, name: str) -> Tool:
        if name not in self._tools:
            raise UnknownToolError(f"no tool named {name!r}; available tools: {', '.join(self._tools) or 'none'}")
        return self._tools[name]

    def select(self, names: Iterable[str]) -> Toolbox:
        """A toolbox with only the named tools (in the order given)."""
        return Toolbox(self.get(name) for name in names)

    def names(self) -> list[str]:
        return list(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        return [tool.schema() for tool in self._tools.values()]

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    def __repr__(self) -> str:
        return f"Toolbox({self.names()})"
