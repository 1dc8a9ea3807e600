"""Running one tool call: approval, deadline, output cap, and a result the model reads.

Owns `ToolRunner`, the approval policy (`ask`, `yes`, `deny`), `ToolCallRequest`
(what an approver is shown) and `ToolResult` (what goes back to the model). Every
failure of a call (an unknown tool, bad arguments, a refused approval, a timeout, an
exception inside the tool) becomes an error result, never an exception, so the turn
loop can feed it back and carry on.

Does not own parsing tool calls out of model output, rendering results as tokens, or
asking a person: the approver is a callable the application supplies (`dsagent`
prompts at the terminal). Knows no tokens.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

from tools.errors import ApprovalDenied, ToolArgumentError, ToolConfigError, ToolError
from tools.limits import ToolContext, ToolOutput, call_with_deadline, cap_text, valid_text
from tools.registry import Tool, Toolbox
from tools.workspace import Workspace

Policy = Literal["ask", "yes", "deny"]
POLICIES: tuple[str, ...] = ("ask", "yes", "deny")
DEADLINE_GRACE_S = 2.0  # lets tools that enforce their own timeout (run_shell) report it first


@dataclass(frozen=True)
class ToolCallRequest:
    """A validated call waiting for approval: what the approver decides on."""

    name: str
    arguments: dict[str, Any]
    writes: bool
    executes: bool

    def summary(self, width: int = 200) -> str:
        """One line for a prompt, e.g. `run_shell(command='make test')`."""
        shown = []
        for key, value in self.arguments.items():
            text = repr(value)
            shown.append(f"{key}={text if len(text) <= width else text[: width - 3] + '...'}")
        return f"{self.name}({', '.join(shown)})"


@dataclass
class ToolResult:
    """The outcome of one call. `text` is always what the model reads, errors included."""

    name: str
    ok: bool
    text: str
    images: list[bytes] = field(default_factory=list)
    error: str | None = None  # the failure, without the "error: " prefix `text` carries
    truncated: bool = False  # part of the output was cut to fit the cap
    elapsed_s: float = 0.0
    denied: bool = False  # refused by the approval policy or the approver


Approver = Callable[[ToolCallRequest], bool]


class ToolRunner:
    """Runs tool calls from a toolbox inside a workspace, under a policy and limits."""

    def __init__(
        self,
        toolbox: Toolbox,
        workspace: Workspace,
        policy: Policy = "ask",
        approver: Approver | None = None,
        timeout_s: float = 30.0,
        output_cap: int = 16_000,
    ) -> None:
        if policy not in POLICIES:
            raise ToolConfigError(f"unknown approval policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if not timeout_s > 0 or output_cap < 1:
            raise ToolConfigError("the tool timeout must be positive and the output cap at least 1 char")
        self.toolbox = toolbox
        self.policy = policy
        self.approver = approver
        self.context = ToolContext(workspace, float(timeout_s), int(output_cap))

    def schemas(self) -> list[dict[str, Any]]:
        """The tools' schemas, for the system prompt."""
        return self.toolbox.schemas()

    def run(self, name: str, arguments: Mapping[str, Any] | str | None) -> ToolResult:
        """Run one call; `arguments` may be a mapping or a JSON object in text."""
        start = time.monotonic()
        try:
            tool = self.toolbox.get(name)
            bound = tool.bind(_as_mapping(arguments))
            self._approve(tool, bound)
            output = call_with_deadline(lambda: tool.invoke(self.context, bound),
                                        self.context.timeout_s + DEADLINE_GRACE_S)
            return self._success(name, output, start)
        except Exception as exc:  # a tool's failure is a result for the model, not a crash
            return self._failure(name, exc, start)

    def _approve(self, tool: Tool, arguments: dict[str, Any]) -> None:
        """Return if the call may run; raise `ApprovalDenied` saying why otherwise."""
        if not tool.needs_approval or self.policy == "yes":
            return
        action = "writes files" if tool.writes else "runs programs"
        if self.policy == "deny":
            raise ApprovalDenied(f"{tool.name} {action} and the approval policy is 'deny'")
        if self.approver is None:
            raise ApprovalDenied(f"{tool.name} {action} and needs approval; nobody can approve it here "
                                 "(pass --yes or an approval policy of 'yes' to allow it)")
        request = ToolCallRequest(tool.name, dict(arguments), tool.writes, tool.executes)
        if not self.approver(request):
            raise ApprovalDenied(f"the user did not approve this {tool.name} call")

    def _success(self, name: str, output: Any, start: float) -> ToolResult:
        out = _as_output(output)
        text, cut = cap_text(valid_text(out.text), self.context.output_cap)
        return ToolResult(name, True, text, list(out.images), None, cut or out.truncated, time.monotonic() - start)

    def _failure(self, name: str, exc: Exception, start: float) -> ToolResult:
        message = valid_text(str(exc) if isinstance(exc, ToolError) else f"{type(exc).__name__}: {exc}")
        text, cut = cap_text(f"error: {message}", self.context.output_cap)
        return ToolResult(name, False, text, [], message, cut, time.monotonic() - start,
                          denied=isinstance(exc, ApprovalDenied))


def _as_mapping(arguments: Mapping[str, Any] | str | None) -> Mapping[str, Any]:
    if arguments is None:
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except RecursionError:  # json.loads recurses a level at a time: ~1,000 levels exhaust it
            raise ToolArgumentError("arguments are nested too deeply to read; pass a flatter value") from None
        except ValueError as exc:
            raise ToolArgumentError(f"arguments are not valid JSON: {exc}") from exc
    if not isinstance(arguments, Mapping):
        raise ToolArgumentError(f"arguments must be an object of name: value, got {type(arguments).__name__}")
    return arguments


def _as_output(value: Any) -> ToolOutput:
    """Whatever a tool returned, as text plus images."""
    if isinstance(value, ToolOutput):
        return value
    if isinstance(value, str):
        return ToolOutput(value)
    if value is None:
        return ToolOutput("(no output)")
    try:
        return ToolOutput(json.dumps(value, ensure_ascii=False))
    except (TypeError, ValueError):
        return ToolOutput(str(value))
