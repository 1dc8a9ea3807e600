"""`dsagent model ...`: inspect a model configuration or checkpoint.

Owns: turning ``model.census.census`` (and, for a checkpoint directory, the dtype census
of ``model.checkpoint``) into JSON or readable tables, and exit codes (0 ok, 1 a config or
checkpoint problem, with the message on stderr). Does not own any counting: every number
comes from the ``model`` package, imported when the command runs (it imports torch).

Without --preset or --model it describes the model `dsagent run` would load (the
embedded default), and it names what it describes first. The tables fit 80 columns
without cutting a number: columns that hold numbers or names never wrap or shorten.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from dsagent.runtime import EMBEDDED_MODEL, default_source
from model.args import ConfigError, ModelArgs

app = typer.Typer(help="Inspect model configurations and checkpoints.", no_args_is_help=True)


@app.callback()
def _group() -> None:
    """Inspect model configurations and checkpoints."""


def _args(preset: Optional[str], model_dir: Optional[Path], layers: Optional[int] = None,
          engram_rows: Optional[int] = None) -> ModelArgs:
    try:
        args = ModelArgs.from_file(model_dir) if model_dir else ModelArgs.preset(preset)
        return args.shortened(layers, engram_rows)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


def _chosen(preset: Optional[str], model_dir: Optional[Path]) -> tuple[Optional[str], Optional[Path], str]:
    """(preset, checkpoint dir, the name to print): the flags', else what `run` loads."""
    if model_dir is not None:
        return None, model_dir, str(model_dir)
    if preset is not None:
        return preset, None, f"preset {preset}"
    source = default_source()
    if source == str(EMBEDDED_MODEL):
        return None, EMBEDDED_MODEL, f"the embedded default ({EMBEDDED_MODEL})"
    return source, None, f"preset {source} (the embedded default is missing)"


def _checkpoint_census(model_dir: Path) -> Optional[dict]:
    """The directory's per-dtype tensor census, when ``model.checkpoint`` offers one."""
    from model import checkpoint

    if not hasattr(checkpoint, "census"):
        return None
    try:
        return checkpoint.census(model_dir)
    except checkpoint.CheckpointError as exc:
        typer.echo(f"warning: no checkpoint census: {exc}", err=True)
        return None


def _n(x: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= size:
            return f"{x / size:,.2f}{unit}"
    return str(x)


def _summary(c: dict) -> Table:
    t = Table(title="Parameters and KV", show_header=False, box=box.SIMPLE)
    t.add_column(no_wrap=True)
    t.add_column(no_wrap=True, justify="right")
    rows = [("total", _n(c["params_total"])), ("backbone", _n(c["params_backbone"])),
            ("engram", _n(c["params_engram"])), ("dspark", _n(c["params_dspark"])),
            ("vision", _n(c["params_vision"])), ("active per decoded token", _n(c["params_active_decode"])),
            ("active per prefilled token (amortised)", _n(c["params_active_prefill"])),
            ("global KV bytes per token", str(c["kv_global_bytes_per_token"])),
            ("window KV bytes (bounded)", f"{c['kv_window_bytes']:,}")]
    rows += [(f"  part: {k}", _n(v)) for k, v in c["params_by_part"].items()]
    for row in rows:
        t.add_row(*row)
    return t


def _layers(c: dict) -> Table:
    # short headings and no vertical rules: nine columns fit 80 with every value whole
    t = Table(title="Layers", box=box.SIMPLE_HEAD, pad_edge=False,
              caption="kv / idx: the layer whose KV / index keys it reads; cand: candidate pool")
    for col in ("layer", "ratio", "role", "kv", "idx", "cand", "engram", "part", "params"):
        t.add_column(col, no_wrap=True, justify="right" if col in ("layer", "ratio", "kv", "idx", "params") else "left")
    for r in c["layers"]:
        cand = "source" if r["candidate_source"] else ("yes" if r["candidates"] else "")
        t.add_row(str(r["index"]), str(r["ratio"]), r["role"], str(r["kv_source"] if r["kv_source"] is not None else ""),
                  str(r["index_source"] if r["index_source"] is not None else ""), cand,
                  "yes" if r["engram"] else "", r["part"], _n(r["params"]))
    return t


def _memory(rows: list[dict]) -> Table:
    t = Table(title="Weights a GPU holds (GB), the model split over N", box=box.SIMPLE_HEAD,
              caption="packed: FP8 / FP4 as stored, the rest bf16; plain: all bf16. Engram tables apart: "
                      "a GPU's share of their rows where the GPUs hold them, or whole in host memory")
    for col in ("N", "packed", "plain", "engram a GPU", "engram in host"):
        t.add_column(col, no_wrap=True, justify="right")
    for r in rows:
        packed, plain = r["packed"], r["plain"]
        t.add_row(str(r["ranks"]), f"{packed['gpu_total'] / 1e9:,.2f}", f"{plain['gpu_total'] / 1e9:,.2f}",
                  f"{packed['engram_share'] / 1e9:,.2f}", f"{packed['engram_tables'] / 1e9:,.2f}")
    return t


def _tables(c: dict) -> list[Table]:
    out = [_summary(c), _layers(c)]
    if c.get("per_gpu"):
        out.append(_memory(c["per_gpu"]))
    if c["engram_tables"]:
        t = Table(title="Engram tables", box=box.SIMPLE_HEAD)
        for col in ("layer", "prime sum", "rows", "match"):
            t.add_column(col, no_wrap=True)
        for r in c["engram_tables"]:
            t.add_row(str(r["layer"]), f"{r['primes_sum']:,}", f"{r['num_embeddings']:,}", "yes" if r["match"] else "NO")
        out.append(t)
    if "checkpoint" in c:
        t = Table(title="Checkpoint tensors by dtype", box=box.SIMPLE_HEAD)
        for col in ("dtype", "tensors", "bytes"):
            t.add_column(col, no_wrap=True, justify="left" if col == "dtype" else "right")
        for dtype, e in c["checkpoint"].get("by_dtype", {}).items():
            t.add_row(dtype, f"{e['tensors']:,}", f"{e['bytes']:,}")
        out.append(t)
    return out


@app.command()
def info(preset: Optional[str] = typer.Option(None, "--preset", metavar="P",
                                              help="v41-flash, small or tiny (random weights)."),
         model_dir: Optional[Path] = typer.Option(None, "--model", metavar="DIR",
                                                  help="A checkpoint directory (overrides --preset)."),
         as_json: bool = typer.Option(False, "--json", help="One JSON object."),
         gpus: Optional[List[int]] = typer.Option(None, "--gpus", metavar="N", min=1,
                                                  help="Also the weights a GPU holds with the model split over N "
                                                       "(repeatable)."),
         layers: Optional[int] = typer.Option(None, "--layers", metavar="N", min=2,
                                              help="The model cut to N layers that keep every kind (as the "
                                                   "benchmarks' --layers)."),
         engram_rows: Optional[int] = typer.Option(None, "--engram-rows", metavar="R", min=1,
                                                   help="Engram tables of about R rows each.")) -> None:
    """Parameter census (total, backbone, active), global KV bytes per token and layer roles
    of a preset, a checkpoint, or (by default) the embedded model `dsagent run` loads;
    ``--layers`` / ``--engram-rows``: of that model cut as the benchmarks cut it (what fits)."""
    from model.census import census, rank_bytes

    preset, model_dir, name = _chosen(preset, model_dir)
    args = _args(preset, model_dir, layers, engram_rows)
    if layers is not None or engram_rows is not None:
        name += f" cut to {args.num_hidden_layers} layers" + ("" if engram_rows is None else f", ~{engram_rows:,} "
                                                                                             "Engram rows a table")
    c = {"model": name, **census(args)}
    if gpus:
        try:
            c["per_gpu"] = [{"ranks": n, "packed": rank_bytes(args, n), "plain": rank_bytes(args, n, packed=False)}
                            for n in gpus]
        except (ValueError, ConfigError) as exc:  # heads, groups, experts or FP8 blocks that do not split by N
            typer.echo(f"error: --gpus: {exc}", err=True)
            raise typer.Exit(2) from None
    if model_dir is not None:
        ckpt = _checkpoint_census(model_dir)
        if ckpt is not None:
            c["checkpoint"] = ckpt
    if as_json:
        typer.echo(json.dumps(c, indent=2, default=str))
        return
    console = Console()
    console.print(f"model: {name}", markup=False, highlight=False, soft_wrap=True)
    for table in _tables(c):
        console.print(table)


# `dsagent model init` is added here by the engineer who owns checkpoint creation.
# Its body lives in model_init.py, beside the writer scripts/make_default_model.py shares.
from dsagent.commands.model_init import init as _init  # noqa: E402

app.command("init")(_init)
