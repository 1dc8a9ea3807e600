"""The `dsagent` command line: `run`, `chat`, `doctor`, `eval`, and the `sessions`, `model`, `bench` groups.

Owns: flags and their defaults (config.toml < environment < flags, see `dsagent.settings`),
loading the model with a progress bar, wiring the agent to a renderer (terminal, one JSON
object, or JSON lines), and exit codes (the table is in `dsagent.errors`). Every command
body is a thin call into the library. Does not own the turn loop (`dsagent.agent`), the
interactive loop (`dsagent.chat`) or rendering (`dsagent.render`). Data goes to stdout;
progress, warnings and errors to stderr.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import List, Optional

import typer

from dsagent.agent import Agent, AgentOptions, TurnResult
from dsagent.chat import ChatShell, latest_session, terminal_approver
from dsagent.commands import bench as bench_cmd
from dsagent.commands import eval as eval_cmd
from dsagent.commands import model as model_cmd
from dsagent.commands import sessions as sessions_cmd
from dsagent.errors import APPROVAL_NEEDED, CACHE_REFUSED, INTERRUPTED, UsageError, handled
from dsagent.inputs import text_arg, tolerant_stdin
from dsagent.render import JsonlWriter, PrefillNotice, StreamView, consoles, load_progress, usage_line
from dsagent.runtime import EMBEDDED_MODEL, Runtime, Settings, default_source
from dsagent.settings import Defaults, config_path, resolve
from model.engine import Sampling
from sessions import Store, StoreError, default_home
from sessions.names import check_name
from tools import builtin_toolbox

app = typer.Typer(help="Local agent runtime for the DeepSeek-V4.1-Flash architecture.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
app.add_typer(sessions_cmd.app, name="sessions")
app.add_typer(bench_cmd.app, name="bench")
app.add_typer(model_cmd.app, name="model")
app.command("eval")(eval_cmd.eval_command)

PROJECT_ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dsagent", "model", "sessions", "tools")

# Options shared by `run` and `chat`.
SESSION = typer.Option(None, "--session", "-s", help="Session name: created if new, resumed if it exists.",
                       callback=text_arg)
MODEL = typer.Option(None, "--model", help="Checkpoint directory (default: the embedded model).")
PRESET = typer.Option(None, "--preset", help="Random weights of a preset (tiny, small, v41-flash) instead.")
TOOLS = typer.Option(None, "--tool", "-t", help="Enable only this tool (repeatable; default: all built-in tools).")
MAX_STEPS = typer.Option(8, "--max-steps", min=1, help="Most model calls per turn (tool loops end here).")
MAX_NEW = typer.Option(None, "--max-new-tokens", min=1, help="Most tokens per model call.")
SEED = typer.Option(None, "--seed", min=-2**63, max=2**64 - 1,  # the range torch's generator takes
                    help="Sampling seed (matters with --temperature > 0).")
TEMPERATURE = typer.Option(None, "--temperature", min=0.0, help="0 = greedy.")
POLICY = typer.Option(None, "--policy", help="Tool approval: ask, yes or deny.")
YES = typer.Option(False, "--yes", "-y", help="Approve every tool call (same as --policy yes).")
THINKING = typer.Option(None, "--thinking", help="chat or thinking.")
WORKSPACE = typer.Option(None, "--workspace", help="Root directory tools may touch (default: the current one).")
DEVICE = typer.Option("cpu", "--device", help="cpu or cuda.")
SPECULATIVE = typer.Option(True, "--speculative/--no-speculative",
                           help="DSpark speculative decoding (off by itself when the checkpoint has no draft stages).")


def load_runtime(d: Defaults, device: str) -> Runtime:
    """The model the defaults choose, with a progress bar on stderr while it loads."""
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    _, err = consoles()
    with load_progress(err, "loading model") as progress:
        return Runtime.load(Settings(model=d.model, preset=d.preset, device=device, dtype=dtype), progress=progress)


def agent_options(d: Defaults, session, tools, max_steps, seed, workspace, speculative=True) -> AgentOptions:
    sampling = Sampling(temperature=d.temperature, seed=seed, max_new_tokens=d.max_new_tokens)
    return AgentOptions(session=session, thinking_mode=d.thinking, tools=tools or None, policy=d.policy,
                        workspace=workspace or Path.cwd(), max_steps=max_steps, sampling=sampling,
                        speculative=speculative)


def _defaults(model, preset, policy, yes, thinking, max_new, temperature) -> Defaults:
    if model and preset:
        raise UsageError("pass --model or --preset, not both")
    if yes and policy not in (None, "yes"):
        raise UsageError(f"pass --yes or --policy {policy}, not both (--yes means --policy yes)")
    return resolve(model=model, preset=preset, policy="yes" if yes else policy, thinking=thinking,
                   max_new_tokens=max_new, temperature=temperature)


def _check_agent_flags(session: str | None, tools: list[str] | None, workspace: Path | None) -> None:
    """Refuse a bad session name, an unknown tool or a workspace that is not a directory
    before the model loads or the store is opened (the agent would refuse them only then)."""
    if session is not None:
        try:
            check_name(session)
        except StoreError as e:
            raise UsageError(f"--session: {e}") from None
    known = builtin_toolbox().names()
    unknown = [t for t in tools or [] if t not in known]
    if unknown:
        raise UsageError(f"unknown tool {', '.join(map(repr, unknown))} (--tool); known tools: {', '.join(known)}")
    if workspace is not None and not workspace.expanduser().is_dir():
        what = "is not a directory" if workspace.expanduser().exists() else "does not exist"
        raise UsageError(f"--workspace {workspace} {what}; give an existing directory")


@app.command()
def run(
    prompt: str = typer.Argument(..., help="The user message.", callback=text_arg),
    session: Optional[str] = SESSION, model: Optional[str] = MODEL, preset: Optional[str] = PRESET,
    tool: Optional[List[str]] = TOOLS,
    image: Optional[List[Path]] = typer.Option(None, "--image", "-i", help="Attach an image (repeatable)."),
    max_steps: int = MAX_STEPS, max_new_tokens: Optional[int] = MAX_NEW, seed: Optional[int] = SEED,
    temperature: Optional[float] = TEMPERATURE, policy: Optional[str] = POLICY, yes: bool = YES,
    thinking: Optional[str] = THINKING, workspace: Optional[Path] = WORKSPACE, device: str = DEVICE,
    speculative: bool = SPECULATIVE,
    as_json: bool = typer.Option(False, "--json", help="Print one result object on stdout."),
    jsonl: bool = typer.Option(False, "--jsonl", help="Print every event as a JSON line on stdout."),
) -> None:
    """Run one agent turn (tools included) and print the answer."""
    out, err = consoles()
    with handled():
        if as_json and jsonl:
            raise UsageError("pass --json or --jsonl, not both")
        d = _defaults(model, preset, policy, yes, thinking, max_new_tokens, temperature)
        _check_agent_flags(session, tool, workspace)
        images = [p.read_bytes() for p in image or []]
        rt = load_runtime(d, device)
        approver = terminal_approver(err) if d.policy == "ask" and sys.stdin.isatty() else None
        sink = _event_sink(as_json, jsonl, out, err)
        opts = agent_options(d, session, tool, max_steps, seed, workspace, speculative)
        with Store.open() as store, Agent(rt, store, opts, on_event=sink, approver=approver) as agent:
            sink.start()
            try:
                result = agent.turn(prompt, images)
            finally:
                sink.stop()
            refused = bool(agent.kv_refused)
    _finish(result, as_json, jsonl, out, err)
    raise typer.Exit(_exit_code(result, d.policy, approver, refused))


def _event_sink(as_json: bool, jsonl: bool, out, err):
    """--jsonl: every event on stdout; --json: only warnings (on stderr); else the terminal view."""
    if jsonl:
        return PrefillNotice(err, JsonlWriter(), show=False)
    view = StreamView(out, err)
    if as_json:
        return PrefillNotice(err, lambda e: e["event"] == "warning" and view(e), show=False)
    return PrefillNotice(err, view)


def _finish(result: TurnResult, as_json: bool, jsonl: bool, out, err) -> None:
    if as_json:
        typer.echo(json.dumps(result.to_json(), ensure_ascii=False))
    elif jsonl:
        JsonlWriter()({"event": "result", **result.to_json()})
    else:
        out.print()
        err.print(f"[dim]session {result.session}: {usage_line(result.to_json()['usage'])}; stop: {result.stop}[/]")


def _exit_code(result: TurnResult, policy: str, approver, cache_refused: bool) -> int:
    if result.stop == "interrupted":
        return INTERRUPTED
    if policy == "ask" and approver is None and any(c["denied"] for c in result.tool_calls):
        return APPROVAL_NEEDED
    return CACHE_REFUSED if cache_refused else 0


@app.command()
def chat(
    session: Optional[str] = SESSION,
    resume_latest: bool = typer.Option(False, "--continue", "-c", help="Resume the most recent session."),
    model: Optional[str] = MODEL, preset: Optional[str] = PRESET, tool: Optional[List[str]] = TOOLS,
    max_steps: int = MAX_STEPS, max_new_tokens: Optional[int] = MAX_NEW, seed: Optional[int] = SEED,
    temperature: Optional[float] = TEMPERATURE, policy: Optional[str] = POLICY, yes: bool = YES,
    thinking: Optional[str] = THINKING, workspace: Optional[Path] = WORKSPACE, device: str = DEVICE,
    speculative: bool = SPECULATIVE,
) -> None:
    """Chat interactively; /help lists the slash commands, Ctrl-C stops a reply, Ctrl-D leaves."""
    out, err = consoles()
    with handled():
        if session and resume_latest:
            raise UsageError("pass --session or --continue, not both")
        tolerant_stdin()
        d = _defaults(model, preset, policy, yes, thinking, max_new_tokens, temperature)
        _check_agent_flags(session, tool, workspace)
        rt = load_runtime(d, device)
        with Store.open() as store:
            name = latest_session(store) if resume_latest else session
            if resume_latest and name is None:
                err.print("[dim]no session to continue; starting a new one[/]")
            shell = ChatShell(rt, store, agent_options(d, None, tool, max_steps, seed, workspace, speculative), out, err)
            try:
                shell.open(name)
                shell.loop()
            finally:
                shell.close()


@app.command()
def doctor(as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout.")) -> None:
    """Check the installation: torch and CUDA, flash-attn, the store, the embedded model, the packages."""
    checks = _doctor_checks()
    if as_json:
        typer.echo(json.dumps(checks, indent=2))
    else:
        for name, c in checks.items():
            typer.echo(f"{'ok ' if c['ok'] else 'BAD'} {name:<16} {c['detail']}")
    raise typer.Exit(0 if all(c["ok"] for c in checks.values()) else 1)


def _doctor_checks() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    gpus = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) if cuda else "none"
    flash = importlib.util.find_spec("flash_attn") is not None
    return {
        "python": {"ok": sys.version_info >= (3, 10), "detail": sys.version.split()[0]},
        "torch": {"ok": True, "detail": f"{torch.__version__}; CUDA {'available: ' + gpus if cuda else 'not available'}"},
        "flash-attn": {"ok": True, "detail": "installed" if flash else "not installed (the reference attention runs)"},
        "store": {"ok": True, "detail": _store_detail()},
        "config": {"ok": True, "detail": f"{config_path()} ({'present' if config_path().is_file() else 'absent'})"},
        "embedded model": {"ok": True, "detail": _embedded_detail()},
        "packages": _packages_check(),
    }


def _store_detail() -> str:
    home = default_home()
    files = [f for f in home.glob("sessions.db*") if f.is_file()] if home.is_dir() else []
    size = sum(f.stat().st_size for f in files)
    return f"{home / 'sessions.db'} ({size / 2**20:.2f} MiB)" if files else f"{home / 'sessions.db'} (not created yet)"


def _embedded_detail() -> str:
    if default_source() != str(EMBEDDED_MODEL):
        return "missing; the tiny preset (random weights) is used instead (scripts/train_default.py trains it)"
    size = sum(f.stat().st_size for f in EMBEDDED_MODEL.rglob("*") if f.is_file())
    return f"{EMBEDDED_MODEL} ({size / 2**20:.1f} MiB)"


def _packages_check() -> dict:
    """The top-level names this project installs must resolve to its own files (`model` is a common name)."""
    where = {name: (importlib.util.find_spec(name).origin or "") for name in PACKAGES}
    foreign = [f"{n} -> {o}" for n, o in where.items() if not Path(o).resolve().is_relative_to(PROJECT_ROOT)]
    detail = f"{', '.join(PACKAGES)} from {PROJECT_ROOT}" if not foreign else "shadowed: " + "; ".join(foreign)
    return {"ok": not foreign, "detail": detail}


def main() -> None:
    app(prog_name="dsagent")


if __name__ == "__main__":
    main()
