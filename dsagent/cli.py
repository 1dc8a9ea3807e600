"""The `dsagent` command line: `run`, `chat`, `doctor`, `eval`, and the `sessions`, `model`, `bench` groups.

Owns: flags and their defaults (config.toml < environment < flags, see `dsagent.settings`),
the order of a command (check every flag and setting, `dsagent.preflight`; then load the
model with a progress bar; then open the store), wiring the agent to a renderer (terminal,
one JSON object, or JSON lines), and exit codes (the table is in `dsagent.errors`; usage
errors and a closed stdout end in `dsagent.failures`). Every command body is a thin call
into the library. Does not own the turn loop (`dsagent.agent`), the interactive loop
(`dsagent.chat`) or rendering (`dsagent.render`). Data goes to stdout; progress, warnings
and errors to stderr.

Start-up: this module imports neither torch nor the model. `dsagent --help`, `sessions
...` and every refused flag run without them; a command imports them when it runs one. Ctrl-C while this module is
still importing ends in exit 130 and one word on stderr, not a traceback.
"""
from __future__ import annotations

import sys


def _interrupted_while_starting() -> None:
    """Ctrl-C before any command has run: nothing to keep or report, so a word and exit 130
    (the code of an interrupted command) rather than a traceback from inside some import."""
    sys.stderr.write("interrupted\n")
    raise SystemExit(130)


try:  # the console script imports this module before any handler of ours can run
    import importlib.util
    import json
    from pathlib import Path
    from typing import List, Optional

    import typer

    from dsagent import preflight
    from dsagent.commands import bench as bench_cmd
    from dsagent.commands import eval as eval_cmd
    from dsagent.commands import model as model_cmd
    from dsagent.commands import sessions as sessions_cmd
    from dsagent.failures import PIPE_CLOSED, guarded
    from dsagent.inputs import text_arg, tolerant_stdin
    from dsagent.render import consoles, load_progress
    from dsagent.runtime import EMBEDDED_MODEL, Runtime, Settings, default_source
    from dsagent.settings import Defaults, FlagError, config_path, resolve
    from sessions import default_home
except KeyboardInterrupt:
    _interrupted_while_starting()


def _switches_take_no_value() -> None:
    """typer 0.2x prints every option's type in --help, a switch's too (`--yes <bool>`); a
    switch takes no value, so it gets none."""
    try:
        from typer.core import TyperOption
    except ImportError:
        return
    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "_no_bool", False):
        return

    def display_type_rich(self, ctx):
        return None if getattr(self, "is_flag", False) and self.metavar is None else shown(self, ctx)

    display_type_rich._no_bool = True
    TyperOption.display_type_rich = display_type_rich


_switches_take_no_value()

app = typer.Typer(help="Local agent runtime for the DeepSeek-V4.1-Flash architecture.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
app.add_typer(sessions_cmd.app, name="sessions")
app.add_typer(bench_cmd.app, name="bench")
app.add_typer(model_cmd.app, name="model")
app.command("eval")(eval_cmd.eval_command)

PROJECT_ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dsagent", "model", "sessions", "tools")

# Options shared by `run` and `chat`. Those left None take their default from config.toml or
# DSAGENT_<KEY>, so the help states the built-in default itself.
SESSION = typer.Option(None, "--session", "-s", metavar="NAME", callback=text_arg,
                       help="Session name: created if new, resumed if it exists.")
MODEL = typer.Option(None, "--model", metavar="DIR", help="Checkpoint directory (default: the embedded model).")
PRESET = typer.Option(None, "--preset", metavar="P",
                      help="Random weights of a preset (tiny, small, v41-flash) instead.")
TOOLS = typer.Option(None, "--tool", "-t", metavar="T",
                     help="Enable only this tool (repeatable; default: all built-in tools).")
MAX_STEPS = typer.Option(8, "--max-steps", min=1, metavar="N", help="Most model calls per turn (tool loops end here).")
MAX_NEW = typer.Option(None, "--max-new-tokens", min=1, metavar="N",
                      help="Most tokens per model call. \\[default: 256]")
SEED = typer.Option(None, "--seed", metavar="N", help="Sampling seed (matters with --temperature > 0).")
TEMPERATURE = typer.Option(None, "--temperature", min=0.0, metavar="T", help="0 = greedy. \\[default: 0]")
POLICY = typer.Option(None, "--policy", metavar="ask|yes|deny",
                      help="Tool approval: ask first before writing or running, approve all, refuse. \\[default: ask]")
YES = typer.Option(False, "--yes", "-y", help="Approve every tool call (same as --policy yes).")
THINKING = typer.Option(None, "--thinking", metavar="chat|thinking",
                        help="Chat mode, or thinking mode (only on a model that learnt it). \\[default: chat]")
WORKSPACE = typer.Option(None, "--workspace", metavar="DIR",
                         help="Root directory tools may touch (default: the current one).")
DEVICE = typer.Option("cpu", "--device", metavar="cpu|cuda[:N]", help="Where the model runs.")


def _one_of(*choices: str):
    """A callback that refuses a value not among ``choices`` as a usage error."""
    def check(value: str) -> str:
        if value not in choices:
            raise typer.BadParameter(f"{value!r} is not {' or '.join(choices)}")
        return value
    return check


WEIGHTS = typer.Option("plain", "--weights", metavar="plain|packed", callback=_one_of("plain", "packed"),
                       help="packed: the checkpoint's FP8 / FP4 weights held as stored (a fraction of the memory; "
                            "a CUDA decode step reads them in its kernels, the rest dequantises them).")
ENGRAM = typer.Option("device", "--engram", metavar="device|host", callback=_one_of("device", "host"),
                      help="Where the Engram tables are kept: on the device (over --gpus N, a GPU its share of "
                           "the rows), or whole in host memory, shared by the ranks (a packed checkpoint's tables "
                           "are its shards' memory maps).")
GPUS = typer.Option(1, "--gpus", min=1, metavar="N",
                    help="Split the model over N processes, one a GPU from --device (on --device cpu, N CPU processes "
                         "over gloo); this one drives the others.")
THREADS = typer.Option(None, "--threads", min=1, metavar="N",
                       help="torch's compute threads (default: the CPUs this process may use, from its affinity "
                            "and cgroup quota; one for a model up to 2,048 wide on the CPU, as the embedded default).")
SPECULATIVE = typer.Option(None, "--speculative/--no-speculative",
                           help="DSpark speculative decoding (default: on where it pays, the CPU; off by itself when "
                                "the checkpoint has no draft stages).")
PREFIX_CACHE = typer.Option(None, "--prefix-cache/--no-prefix-cache",
                            help="A new session starts from the KV other sessions stored for the same system prompt "
                                 "and tools, replaying the window before it. \\[default: on]")


def load_runtime(d: Defaults, device: str, weights: str = "plain", gpus: int = 1, engram: str = "device") -> Runtime:
    """The model the defaults choose, with a progress bar on stderr while it loads; over
    ``gpus`` ranks this process starts, or torchrun's (whose ranks other than 0 follow rank 0
    here and exit when it is done, printing nothing)."""
    from dsagent import ranks

    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    settings = Settings(model=d.model, preset=d.preset, device=device, dtype=dtype, threads=d.threads,
                        weights=weights, gpus=gpus, engram=engram)
    world = ranks.torchrun_world()
    if world is not None and world.rank > 0:
        ranks.follow_as(world, settings)
        raise typer.Exit(0)
    _, err = consoles()
    with load_progress(err, "loading model") as progress:
        return Runtime.load(settings, progress=progress, world=world)


def agent_options(d: Defaults, session, tools, max_steps, seed, workspace, speculative=None):
    from dsagent.agent import AgentOptions
    from model.engine import Sampling

    sampling = Sampling(temperature=d.temperature, seed=seed, max_new_tokens=d.max_new_tokens)
    return AgentOptions(session=session, thinking_mode=d.thinking, tools=tools or None, policy=d.policy,
                        prefix_cache=d.prefix_cache,
                        workspace=workspace or Path.cwd(), max_steps=max_steps, sampling=sampling,
                        speculative=speculative)


def _defaults(model, preset, policy, yes, thinking, max_new, temperature, threads) -> Defaults:
    if model and preset:
        raise FlagError("pass --model or --preset, not both")
    if yes and policy not in (None, "yes"):
        raise FlagError(f"pass --yes or --policy {policy}, not both (--yes means --policy yes)")
    return resolve(model=model, preset=preset, policy="yes" if yes else policy, thinking=thinking,
                   max_new_tokens=max_new, temperature=temperature, threads=threads)


def _with_prefix_cache(d: Defaults, flag: bool | None) -> Defaults:
    """--prefix-cache / --no-prefix-cache over config.toml's prefix_cache and DSAGENT_PREFIX_CACHE."""
    from dataclasses import replace

    return d if flag is None else replace(d, prefix_cache=flag)


def _checked(d: Defaults, session: str | None, tools: list[str] | None, workspace: Path | None,
             seed: int | None) -> None:
    """The checks of a run or chat that need neither torch nor the store. `check_device`
    comes last of all (it imports torch), then the model loads, then the store opens."""
    preflight.check_seed(seed)
    preflight.check_session(session)
    preflight.check_tools(tools)
    preflight.check_workspace(workspace)
    preflight.check_thinking(d.thinking, d.model, d.preset, default_source())


@app.command()
def run(
    prompt: Optional[str] = typer.Argument(None, metavar="PROMPT", callback=text_arg,
                                           help="The user message; text piped on stdin goes before it."),
    session: Optional[str] = SESSION, model: Optional[str] = MODEL, preset: Optional[str] = PRESET,
    tool: Optional[List[str]] = TOOLS,
    image: Optional[List[Path]] = typer.Option(None, "--image", "-i", metavar="PATH",
                                               help="Attach an image (repeatable)."),
    max_steps: int = MAX_STEPS, max_new_tokens: Optional[int] = MAX_NEW, seed: Optional[int] = SEED,
    temperature: Optional[float] = TEMPERATURE, policy: Optional[str] = POLICY, yes: bool = YES,
    thinking: Optional[str] = THINKING, workspace: Optional[Path] = WORKSPACE, device: str = DEVICE,
    weights: str = WEIGHTS, engram: str = ENGRAM, gpus: int = GPUS, threads: Optional[int] = THREADS,
    speculative: Optional[bool] = SPECULATIVE, prefix_cache: Optional[bool] = PREFIX_CACHE,
    as_json: bool = typer.Option(False, "--json", help="Print one result object on stdout."),
    jsonl: bool = typer.Option(False, "--jsonl", help="Print every event as a JSON line on stdout."),
) -> None:
    """Run one agent turn (tools included) and print the answer."""
    out, err = consoles()
    with guarded():
        if as_json and jsonl:
            raise FlagError("pass --json or --jsonl, not both")
        d = _defaults(model, preset, policy, yes, thinking, max_new_tokens, temperature, threads)
        d = _with_prefix_cache(d, prefix_cache)
        images = preflight.read_images(image)
        _checked(d, session, tool, workspace, seed)
        text = preflight.prompt_text(prompt, notice=_notice(err))
        preflight.check_device(device)
        preflight.check_gpus(gpus, device)
        code = _run_turn(d, text, images, session, tool, max_steps, seed, workspace, device, (weights, engram), gpus,
                         speculative, as_json, jsonl, out, err)
    raise typer.Exit(code)


def _notice(err):
    return (lambda message: err.print(f"[dim]{message}[/]")) if err.is_terminal else None


def _run_turn(d: Defaults, text, images, session, tool, max_steps, seed, workspace, device, held, gpus,
              speculative, as_json, jsonl, out, err) -> int:
    """``held``: (``--weights``, ``--engram``)."""
    with load_runtime(d, device, held[0], gpus, held[1]) as rt:  # over several ranks, they leave with it
        return _turn_on(rt, d, text, images, session, tool, max_steps, seed, workspace, speculative, as_json, jsonl,
                        out, err)


def _turn_on(rt: Runtime, d: Defaults, text, images, session, tool, max_steps, seed, workspace, speculative,
             as_json, jsonl, out, err) -> int:
    from dsagent.agent import Agent
    from dsagent.chat import terminal_approver
    from sessions import Store

    for data in images:  # decoded and checked now, so a bad image stops the run before the store opens
        rt.image_span(data)
    sink = _event_sink(as_json, jsonl, out, err)
    approver = terminal_approver(err, hold=sink.paused) if d.policy == "ask" and sys.stdin.isatty() else None
    opts = agent_options(d, session, tool, max_steps, seed, workspace, speculative)
    with Store.open() as store, Agent(rt, store, opts, on_event=sink, approver=approver) as agent:
        sink.start()
        try:
            result = agent.turn(text, images)
        finally:
            sink.stop()
        refused = bool(agent.kv_refused)
    if sink.closed:  # nobody reads stdout any more: the session is saved, say nothing
        return PIPE_CLOSED
    _finish(result, as_json, jsonl, out, err, d, max_steps)
    return _exit_code(result, d.policy, approver, refused)


def _event_sink(as_json: bool, jsonl: bool, out, err):
    """--jsonl: every event on stdout; --json: only warnings (on stderr); else the terminal view.
    The status line shows on a terminal, except where JSON lines go to that same terminal."""
    from dsagent.render import Activity, JsonlWriter, StreamView

    if jsonl:
        return Activity(err, JsonlWriter(), show=not out.is_terminal, stdout_is_terminal=out.is_terminal)
    view = StreamView(out, err)
    if as_json:
        return Activity(err, lambda e: e["event"] == "warning" and view(e), stdout_is_terminal=False)
    return Activity(err, view, stdout_is_terminal=out.is_terminal)


def _finish(result, as_json: bool, jsonl: bool, out, err, d: Defaults, max_steps: int) -> None:
    from dsagent.render import JsonlWriter, stop_note, usage_line

    if as_json:
        typer.echo(json.dumps(result.to_json(), ensure_ascii=False))
    elif jsonl:
        JsonlWriter()({"event": "result", **result.to_json()})
    else:
        out.print()
    note = stop_note(result.stop, max_steps, d.max_new_tokens)
    if note:
        err.print(f"[yellow]{note}[/]", highlight=False)
    if not (as_json or jsonl):
        err.print(f"[dim]session {result.session}: {usage_line(result.to_json()['usage'])}; stop: {result.stop}[/]")


def _exit_code(result, policy: str, approver, cache_refused: bool) -> int:
    """0 also when the turn stopped at --max-steps or --max-new-tokens: the run did what it
    was allowed to (stderr says where it stopped, and `stop` in --json / --jsonl)."""
    from dsagent.errors import APPROVAL_NEEDED, CACHE_REFUSED, INTERRUPTED

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
    weights: str = WEIGHTS, engram: str = ENGRAM, gpus: int = GPUS, threads: Optional[int] = THREADS,
    speculative: Optional[bool] = SPECULATIVE, prefix_cache: Optional[bool] = PREFIX_CACHE,
) -> None:
    """Chat interactively; /help lists the slash commands, Ctrl-C stops a reply, Ctrl-D leaves."""
    out, err = consoles()
    with guarded():
        if session and resume_latest:
            raise FlagError("pass --session or --continue, not both")
        tolerant_stdin()
        d = _defaults(model, preset, policy, yes, thinking, max_new_tokens, temperature, threads)
        d = _with_prefix_cache(d, prefix_cache)
        _checked(d, session, tool, workspace, seed)
        preflight.check_device(device)
        preflight.check_gpus(gpus, device)
        _chat(d, session, resume_latest, tool, max_steps, seed, workspace, device, (weights, engram), gpus,
              speculative, out, err)


def _chat(d: Defaults, session, resume_latest, tool, max_steps, seed, workspace, device, held, gpus, speculative,
          out, err):
    """``held``: (``--weights``, ``--engram``)."""
    from dsagent.chat import ChatShell, latest_session
    from sessions import Store

    with load_runtime(d, device, held[0], gpus, held[1]) as rt, Store.open() as store:
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
    """Check the installation: torch and CUDA, threads, flash-attn, the store, the embedded model, the packages."""
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
        "threads": {"ok": True, "detail": _threads_detail()},
        "flash-attn": {"ok": True, "detail": "installed" if flash else "not installed (the reference attention runs)"},
        "store": {"ok": True, "detail": _store_detail()},
        "config": {"ok": True, "detail": f"{config_path()} ({'present' if config_path().is_file() else 'absent'})"},
        "embedded model": {"ok": True, "detail": _embedded_detail()},
        "packages": _packages_check(),
    }


def _threads_detail() -> str:
    from dsagent.threads import ONE_THREAD_MAX_HIDDEN, affinity_cpus, available_cpus, quota_cpus

    quota = quota_cpus()
    limit = f"cgroup quota {quota:g} CPUs" if quota is not None else "no cgroup quota"
    return (f"{available_cpus()} by default ({affinity_cpus()} CPUs in this process's affinity, {limit}); "
            f"1 for a model up to {ONE_THREAD_MAX_HIDDEN} wide on the CPU, as the embedded default")


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
