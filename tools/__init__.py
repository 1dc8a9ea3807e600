"""Agent tools: plain typed functions, the workspace they are confined to, and their runner.

The public API of the package; see registry.py (tools and toolboxes), workspace.py
(path confinement), limits.py (context, output and deadlines), builtin.py (the
built-in tools) and runner.py (approval and results). Knows no tokens and imports
none of `model`, `sessions` or `dsagent`.
"""

from tools.builtin import (
    builtin_toolbox,
    calculator,
    edit_file,
    list_dir,
    read_file,
    run_shell,
    view_image,
    write_file,
)
from tools.errors import (
    ApprovalDenied,
    CalculatorError,
    ToolArgumentError,
    ToolConfigError,
    ToolDefinitionError,
    ToolError,
    ToolTimeoutError,
    UnknownToolError,
    WorkspaceError,
)
from tools.limits import ToolContext, ToolOutput, cap_text, valid_text
from tools.registry import Param, Tool, Toolbox
from tools.runner import POLICIES, Approver, Policy, ToolCallRequest, ToolResult, ToolRunner
from tools.workspace import Workspace

__all__ = [
    "ApprovalDenied", "Approver", "CalculatorError", "POLICIES", "Param", "Policy", "Tool",
    "ToolArgumentError", "ToolCallRequest", "ToolConfigError", "ToolContext", "ToolDefinitionError",
    "ToolError", "ToolOutput", "ToolResult", "ToolRunner", "ToolTimeoutError", "Toolbox",
    "UnknownToolError", "Workspace", "WorkspaceError", "builtin_toolbox", "calculator", "cap_text",
    "edit_file", "list_dir", "read_file", "run_shell", "valid_text", "view_image", "write_file",
]
