"""`dsagent sessions ...`: list, show, export, fork, rm, prune, verify (and repair), gc, storage.

Owns: turning the session store's results into stdout text or JSON, confirmation
prompts for destructive commands, and exit codes (0 ok, 1 error or a failed verify, 2 a bad flag).
A read-only store serves list, show, export, storage and verify; the others say it is read-only.
Does not own: any storage logic; every command is a thin call into `sessions.Store`.
The store lives in `$DSAGENT_HOME` (else the platform's user data directory).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import math
import shutil
from pathlib import Path
from typing import Iterator, Optional

import typer

from dsagent.inputs import text_arg
from sessions import Store, StoreError, StoreReadOnly

app = typer.Typer(help="Manage stored sessions.", no_args_is_help=True)
NAME = typer.Argument(..., callback=text_arg)  # a name typed with bytes that are not UTF-8 is still looked up


@contextlib.contextmanager
def _store() -> Iterator[Store]:
    """Open the store; any StoreError (or an OSError the store did not type) becomes a
    message on stderr and exit code 1, never a traceback."""
    try:
        with Store.open() as store:
            yield store
    except (StoreError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


def _json(obj: object) -> None:
    typer.echo(json.dumps(obj, indent=2, default=str))


def _when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


@app.command("list")
def list_(as_json: bool = typer.Option(False, "--json", help="One JSON array.")) -> None:
    """List sessions, most recently used first, each with the start of its first user message."""
    with _store() as store:
        infos = store.list_sessions()
        previews = {i.name: _preview(store.messages(i.name)) for i in infos}
    if as_json:
        return _json([dataclasses.asdict(i) for i in infos])
    if not infos:
        return typer.echo("no sessions yet")
    room = max(20, shutil.get_terminal_size().columns - len(_row("", "", "", "", "-")))
    typer.echo(_row("NAME", "UPDATED", "MSGS", "TOKENS", "FIRST MESSAGE"))
    for i in infos:
        typer.echo(_row(i.name, _when(i.updated_at), i.n_messages, i.n_tokens, _clip(previews[i.name], room)))


def _row(name: str, when: str, msgs: object, tokens: object, preview: str) -> str:
    return f"{name:<24} {when:<16}  {msgs:>5}  {tokens:>8}  {preview}".rstrip()


def _preview(messages: list[dict]) -> str:
    """The first user message's text on one line ("" when there is none)."""
    for m in messages:
        if m.get("role") == "user":
            content = m.get("content", "")
            if isinstance(content, list):  # text and image parts: the text is the preview
                content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            return " ".join(str(content).split())
    return ""


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


EXPORT_FORMATS = ("markdown", "json", "jsonl")


def _export_format(value: str) -> str:
    """--format is one of :data:`EXPORT_FORMATS` (a usage error, before the store opens)."""
    if value not in EXPORT_FORMATS:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(EXPORT_FORMATS)}")
    return value


@app.command()
def show(name: str = NAME, as_json: bool = typer.Option(False, "--json")) -> None:
    """Show one session: its record and the storage it uses."""
    with _store() as store:
        info = store.get_session(name)
        usage = next(s for s in store.storage().sessions if s.name == name)
    if as_json:
        return _json({"session": dataclasses.asdict(info), "storage": dataclasses.asdict(usage)})
    for key, value in {**dataclasses.asdict(info), **dataclasses.asdict(usage)}.items():
        if isinstance(value, dict):  # metadata: one `key: value` line each, not a Python dict
            typer.echo(f"{key + ':':<20} {'' if value else '–'}".rstrip())
            for k, v in value.items():
                typer.echo(f"  {k}: {_human(v)}")
        else:
            typer.echo(f"{key + ':':<20} {_when(value) if key.endswith('_at') else _human(value)}")


def _human(value: object) -> str:
    """None as a dash, lists and dicts as JSON, anything else as str()."""
    if value is None:
        return "–"
    if isinstance(value, (list, dict)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def _output_path(value: Optional[Path]) -> Optional[Path]:
    """--output must name a file in a folder that exists (checked before the store opens)."""
    if value is None:
        return None
    path = value.expanduser()
    if path.is_dir():
        raise typer.BadParameter(f"{value} is a directory; name a file to write")
    if not path.parent.is_dir():
        raise typer.BadParameter(f"the folder {path.parent} does not exist; create it first or write elsewhere")
    return path


@app.command()
def export(
    name: str = NAME,
    fmt: str = typer.Option("markdown", "--format", "-f", callback=_export_format, help="markdown, json or jsonl"),
    output: Optional[Path] = typer.Option(None, "--output", "-o", callback=_output_path,
                                          help="Write here instead of stdout."),
) -> None:
    """Export a transcript."""
    with _store() as store:
        text = store.export(name, fmt)
    if output is None:
        typer.echo(text, nl=False)
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as exc:
        typer.echo(f"error: cannot write {output}: {exc.strerror or exc}", err=True)
        raise typer.Exit(1) from None


@app.command()
def fork(src: str = NAME, dst: str = typer.Argument(..., callback=text_arg)) -> None:
    """Copy a session under a new name; its stored KV is shared, not copied."""
    with _store() as store:
        info = store.fork(src, dst)
    typer.echo(f"forked {src} -> {info.name} ({info.n_tokens} tokens)")


def _confirm(question: str, yes: bool) -> None:
    if not yes and not typer.confirm(question, default=False):
        typer.echo("aborted", err=True)
        raise typer.Exit(1)


@app.command()
def rm(
    name: str = NAME,
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Say what would be removed."),
) -> None:
    """Delete a session (transcript, token log and its KV), then collect garbage."""
    with _store() as store:
        info = store.get_session(name)
        if dry_run:
            return typer.echo(f"would remove {info.name} ({info.n_messages} messages, {info.n_tokens} tokens)")
        _confirm(f"Delete session '{name}' and its transcript?", yes)
        store.rm(name)
        freed = store.gc()
    typer.echo(f"removed {name}; freed {_mib(freed.kv_bytes + freed.image_bytes)}")


def _finite(value: float) -> float:
    """click's float range lets nan and inf through; an age must be a number of days."""
    if not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number of days")
    return value


@app.command()
def prune(
    older_than: float = typer.Option(..., "--older-than", min=0, callback=_finite, help="Days since last use."),
    yes: bool = typer.Option(False, "--yes", "-y"),
    dry_run: bool = typer.Option(False, "--dry-run"),
) -> None:
    """Delete sessions not used for --older-than days."""
    with _store() as store:
        todo = store.prune(older_than, dry_run=True).removed
        if dry_run or not todo:
            return typer.echo("\n".join(f"would remove {n}" for n in todo) or "nothing to prune")
        _confirm(f"Delete {len(todo)} session(s): {', '.join(todo)}?", yes)
        result = store.prune(older_than)
        store.gc()
    for n in result.removed:
        typer.echo(f"removed {n}")
    for n in result.in_use:
        typer.echo(f"skipped {n} (in use)", err=True)


@app.command()
def verify(
    name: Optional[str] = typer.Argument(None, callback=text_arg),
    as_json: bool = typer.Option(False, "--json"),
    repair: bool = typer.Option(False, "--repair", help="Cut damaged sessions back to their last whole turn."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Repair without asking."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Say what --repair would drop."),
) -> None:
    """Check message bodies, the token log and where it ends, chunk chains, checksums and
    images; exit 1 if anything is wrong. --repair drops each damaged session's broken tail."""
    if (yes or dry_run) and not repair:
        raise typer.BadParameter("--yes and --dry-run go with --repair", param_hint="--yes / --dry-run")
    with _store() as store:
        results = store.verify(name)
        if repair:
            results = _repair(store, name, results, yes, dry_run, as_json)
    if as_json:
        _json([{**dataclasses.asdict(r), "ok": r.ok} for r in results])
    else:
        for r in results:
            typer.echo(f"{r.name:<24} {'ok' if r.ok else 'BAD'}  {r.chunks - r.bad_chunks}/{r.chunks} chunks good")
            for p in r.problems:
                typer.echo(f"  {p}")
            if r.repair is not None and not repair:
                typer.echo(f"  --repair would {r.repair.describe()}: `dsagent sessions verify {r.name} --repair`")
    if not all(r.ok for r in results):
        raise typer.Exit(1)


def _repair(store: Store, name: Optional[str], results: list, yes: bool, dry_run: bool, as_json: bool) -> list:
    """Repair every damaged session that can be (asking first unless --yes); verify again."""
    todo = [r.repair for r in results if r.repair is not None]
    say = (lambda line: typer.echo(line, err=True)) if as_json else typer.echo
    if not todo:
        say("nothing to repair")
        return results
    if dry_run:
        for plan in todo:
            say(f"would repair {plan.name}: {plan.describe()}")
        return results
    if store.read_only:  # say so before asking, not after
        raise StoreReadOnly(store.path, "repair sessions")
    listing = "; ".join(f"{p.name}: {p.describe()}" for p in todo)
    _confirm(f"Repair {len(todo)} session(s) ({listing})?", yes)
    for plan in todo:
        done = store.repair(plan.name)
        say(f"repaired {done.name}: {done.describe()}")
    return store.verify(name)


@app.command()
def gc(dry_run: bool = typer.Option(False, "--dry-run"), as_json: bool = typer.Option(False, "--json")) -> None:
    """Delete KV chunks and images no session references."""
    with _store() as store:
        r = store.gc(dry_run=dry_run)
    if as_json:
        return _json(dataclasses.asdict(r))
    verb = "would free" if dry_run else "freed"
    typer.echo(f"{verb} {r.kv_rows} KV rows ({_mib(r.kv_bytes)}) and {r.images} images ({_mib(r.image_bytes)}); "
               f"file {_mib(r.file_bytes_before)} -> {_mib(r.file_bytes_after)}")


@app.command()
def storage(as_json: bool = typer.Option(False, "--json")) -> None:
    """Bytes per session and stored KV bytes per token."""
    with _store() as store:
        rep = store.storage()
    if as_json:
        return _json(dataclasses.asdict(rep))
    for s in rep.sessions:
        typer.echo(f"{s.name:<24} kv {_mib(s.kv_bytes):>12}  {s.kv_bytes_per_token:>8.1f} B/token  "
                   f"transcript {s.transcript_bytes} B  images {s.image_bytes} B")
    typer.echo(f"file {_mib(rep.file_bytes)}; unique KV {_mib(rep.kv_unique_bytes)}; "
               f"unreferenced {_mib(rep.kv_unreferenced_bytes)}")
