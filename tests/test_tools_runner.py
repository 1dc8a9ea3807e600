"""The runner: approval policies, errors as results, deadlines, output caps, images."""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from tools import (
    Tool,
    Toolbox,
    ToolCallRequest,
    ToolConfigError,
    ToolRunner,
    Workspace,
    builtin_toolbox,
)


class RecordingApprover:
    """Test double: answers with a fixed decision and records what it was asked."""

    def __init__(self, decision: bool) -> None:
        self.decision = decision
        self.requests: list[ToolCallRequest] = []

    def __call__(self, request: ToolCallRequest) -> bool:
        self.requests.append(request)
        return self.decision


def boom(reason: str) -> str:
    """Always fails."""
    raise RuntimeError(f"kaboom: {reason}")


def slow(seconds: float) -> str:
    """Sleeps."""
    time.sleep(seconds)
    return "woke"


def chatty(n: int) -> str:
    """Returns n characters."""
    return "".join(chr(ord("a") + i % 26) for i in range(n))


def quits() -> str:
    """Calls sys.exit."""
    sys.exit(3)


def structured() -> dict:
    """Returns a dict."""
    return {"answer": 42}


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    return Workspace(tmp_path)


def runner(ws: Workspace, policy: str = "yes", approver=None, **limits) -> ToolRunner:  # type: ignore[no-untyped-def]
    box = builtin_toolbox()
    for func in (boom, slow, chatty, quits, structured):
        box.add(func)
    return ToolRunner(box, ws, policy=policy, approver=approver, **limits)  # type: ignore[arg-type]


# --- approval policies --------------------------------------------------------------


def test_ask_calls_the_approver_for_writes_and_shell_only(ws: Workspace) -> None:
    approver = RecordingApprover(True)
    r = runner(ws, "ask", approver)
    assert r.run("write_file", {"path": "a.txt", "content": "hi"}).ok
    assert r.run("run_shell", {"command": "echo hi"}).ok
    assert r.run("read_file", {"path": "a.txt"}).text == "hi"
    assert r.run("calculator", {"expression": "1+1"}).text == "2"
    assert [q.name for q in approver.requests] == ["write_file", "run_shell"]
    first = approver.requests[0]
    assert first.arguments == {"path": "a.txt", "content": "hi"} and first.writes and not first.executes
    assert approver.requests[1].summary() == "run_shell(command='echo hi')"


def test_ask_with_a_refusing_approver_denies(ws: Workspace) -> None:
    result = runner(ws, "ask", RecordingApprover(False)).run("write_file", {"path": "a.txt", "content": "x"})
    assert not result.ok and result.denied
    assert result.text == "error: the user did not approve this write_file call"
    assert not (ws.root / "a.txt").exists()


def test_ask_without_an_approver_says_to_pass_yes(ws: Workspace) -> None:
    result = runner(ws, "ask").run("run_shell", {"command": "touch made"})
    assert result.denied and "--yes" in result.text
    assert not (ws.root / "made").exists()


def test_yes_approves_everything_without_asking(ws: Workspace) -> None:
    approver = RecordingApprover(False)
    result = runner(ws, "yes", approver).run("run_shell", {"command": "touch made"})
    assert result.ok and (ws.root / "made").exists() and approver.requests == []


def test_deny_refuses_writes_and_shell_but_allows_reads(ws: Workspace) -> None:
    r = runner(ws, "deny", RecordingApprover(True))
    for name, args in (("write_file", {"path": "a", "content": "x"}), ("edit_file", {"path": "a", "old": "x",
                       "new": "y"}), ("run_shell", {"command": "true"})):
        result = r.run(name, args)
        assert result.denied and "policy is 'deny'" in result.text
    assert r.run("list_dir", {}).ok


def test_approver_sees_validated_arguments_and_bad_args_never_reach_it(ws: Workspace) -> None:
    approver = RecordingApprover(True)
    r = runner(ws, "ask", approver)
    assert not r.run("write_file", {"path": "a"}).ok
    assert approver.requests == []


def test_approver_exception_becomes_an_error_result(ws: Workspace) -> None:
    def broken(request: ToolCallRequest) -> bool:
        raise OSError("no terminal")

    result = runner(ws, "ask", broken).run("run_shell", {"command": "true"})
    assert not result.ok and "OSError: no terminal" in result.text


def test_bad_runner_settings_are_refused(ws: Workspace) -> None:
    with pytest.raises(ToolConfigError, match="choose one of ask, yes, deny"):
        ToolRunner(builtin_toolbox(), ws, policy="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ToolConfigError):
        ToolRunner(builtin_toolbox(), ws, timeout_s=0)


# --- failures become results --------------------------------------------------------


def test_exception_becomes_an_error_result(ws: Workspace) -> None:
    result = runner(ws).run("boom", {"reason": "testing"})
    assert not result.ok and not result.denied
    assert result.error == "RuntimeError: kaboom: testing"
    assert result.text == "error: RuntimeError: kaboom: testing"


def test_unknown_tool_and_bad_arguments_become_results(ws: Workspace) -> None:
    r = runner(ws)
    unknown = r.run("rm_rf", {})
    assert not unknown.ok and "no tool named 'rm_rf'; available tools: read_file" in unknown.text
    bad = r.run("read_file", {"path": "a", "start_line": "x", "colour": 1})
    assert not bad.ok and "unknown argument 'colour'" in bad.text and "'start_line' must be an integer" in bad.text
    assert not r.run("read_file", "{not json").ok
    assert not r.run("read_file", "[1]").ok


def test_arguments_as_json_text(ws: Workspace) -> None:
    (ws.root / "f.txt").write_text("body")
    assert runner(ws).run("read_file", '{"path": "f.txt"}').text == "body"
    assert runner(ws).run("list_dir", None).text == "f.txt  4 bytes"


def test_escape_attempt_becomes_an_error_result(ws: Workspace) -> None:
    result = runner(ws).run("read_file", {"path": "../../../etc/passwd"})
    assert not result.ok and "outside the workspace" in result.text


def test_system_exit_in_a_tool_does_not_end_the_agent(ws: Workspace) -> None:
    result = runner(ws).run("quits", {})
    assert not result.ok and "SystemExit" in result.text


def test_python_tool_timeout(ws: Workspace) -> None:
    r = runner(ws, timeout_s=0.2)
    start = time.monotonic()
    result = r.run("slow", {"seconds": 10})
    assert not result.ok and "did not finish within" in result.text
    assert time.monotonic() - start < 5 and result.elapsed_s < 5
    assert r.run("slow", {"seconds": 0}).text == "woke"


def test_shell_timeout_is_an_error_result(ws: Workspace) -> None:
    result = runner(ws, timeout_s=0.3).run("run_shell", {"command": "echo partial; sleep 20"})
    assert not result.ok and "timed out after 0.3 s" in result.text and "partial" in result.text


# --- output ------------------------------------------------------------------------


def test_output_cap_keeps_head_and_tail(ws: Workspace) -> None:
    full = chatty(5000)
    result = runner(ws, output_cap=1000).run("chatty", {"n": 5000})
    assert result.ok and result.truncated
    assert result.text.startswith(full[:500]) and result.text.endswith(full[-500:])
    assert "[... 4000 chars truncated ...]" in result.text
    assert not runner(ws, output_cap=1000).run("chatty", {"n": 1000}).truncated


def test_shell_truncation_is_reported(ws: Workspace) -> None:
    result = runner(ws, output_cap=500).run("run_shell", {"command": "yes | head -c 50000"})
    assert result.ok and result.truncated and "bytes truncated" in result.text


def escaped(text: str) -> str:
    """Returns text as given (a test passes lone surrogates, as undecodable bytes arrive)."""
    return text


def test_output_and_errors_are_valid_unicode(ws: Workspace) -> None:
    box = Toolbox([Tool.from_function(escaped), Tool.from_function(boom)])
    r = ToolRunner(box, ws, policy="yes")
    assert r.run("escaped", {"text": "caf\udce9 \udcff"}).text == "caf\ufffd \ufffd"
    failed = r.run("boom", {"reason": "\udce9"})
    assert failed.text == "error: RuntimeError: kaboom: \ufffd" and failed.error == "RuntimeError: kaboom: \ufffd"


def test_arguments_nested_too_deep_are_an_error_result(ws: Workspace) -> None:
    result = runner(ws).run("calculator", '{"expression": ' + "[" * 1000 + "]" * 1000 + "}")
    assert not result.ok and "nested too deeply" in result.text


def test_non_text_results_are_serialised(ws: Workspace) -> None:
    assert runner(ws).run("structured", {}).text == '{"answer": 42}'


def test_image_from_a_tool_comes_back_as_bytes(ws: Workspace) -> None:
    buffer = io.BytesIO()
    Image.new("L", (2, 2), 128).save(buffer, format="PNG")
    (ws.root / "g.png").write_bytes(buffer.getvalue())
    result = runner(ws).run("view_image", {"path": "g.png"})
    assert result.ok and result.images == [buffer.getvalue()]
    not_image = runner(ws).run("view_image", {"path": "missing.png"})
    assert not not_image.ok and not_image.images == []


def test_custom_toolbox_selection_limits_what_can_run(ws: Workspace) -> None:
    r = ToolRunner(builtin_toolbox().select(["calculator"]), ws, policy="yes")
    assert [s["function"]["name"] for s in r.schemas()] == ["calculator"]
    assert "no tool named 'run_shell'" in r.run("run_shell", {"command": "true"}).text


def test_tool_flags_survive_custom_registration(ws: Workspace) -> None:
    box = Toolbox([Tool.from_function(chatty, executes=True)])
    result = ToolRunner(box, ws, policy="deny").run("chatty", {"n": 3})
    assert result.denied and "runs programs" in result.text
