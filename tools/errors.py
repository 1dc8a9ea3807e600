"""Typed failures of the tools package.

Owns the error hierarchy only. Every error a tool call raises becomes an error result
that the model reads (see runner.py); the two that reach a caller directly are
`ToolDefinitionError` (a function cannot become a tool: a programming mistake, raised
at registration) and `ToolConfigError` (bad runner settings: a usage mistake).
"""


class ToolError(Exception):
    """Base of every failure the tools package raises on purpose."""


class ToolDefinitionError(ToolError):
    """A Python function cannot be turned into a tool (missing hints or docstring)."""


class ToolConfigError(ToolError, ValueError):
    """The runner was given an unknown policy, a bad timeout or a bad output cap."""


class UnknownToolError(ToolError):
    """The model (or the user) named a tool that is not in the toolbox."""


class ToolArgumentError(ToolError):
    """Arguments are missing, unknown, or of the wrong type for the tool's schema."""


class ApprovalDenied(ToolError):
    """The approval policy or the approver refused a writing or executing tool."""


class ToolTimeoutError(ToolError):
    """A tool ran past its deadline."""


class WorkspaceError(ToolError):
    """A path is outside the workspace, or the workspace root itself is unusable."""


class CalculatorError(ToolError):
    """An expression uses something the safe calculator refuses, or overflows its caps."""
