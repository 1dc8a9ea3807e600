"""`dsagent model init OUT`: write a seeded random checkpoint of a preset in the official format.

Owns: the command and `write_random_checkpoint`, which `scripts/make_default_model.py`
also uses to write the embedded default (`model/assets/default`). Does not own the file
format (`model.checkpoint`) or the presets (`model.args`); `dsagent model info` lives
with the rest of the model commands.
"""
from __future__ import annotations

import json
from pathlib import Path

import typer

from dsagent.failures import guarded


def write_random_checkpoint(out: Path, preset: str = "tiny", seed: int = 0) -> dict:
    """Seeded random weights of ``preset`` written to ``out`` (new or empty); returns the census."""
    from model.checkpoint import census, write_checkpoint  # torch: only when a checkpoint is written
    from model.loading import BUNDLED_TOKENIZER, load

    model = load(preset, seed=seed)
    write_checkpoint(out, model.args.to_config(), model.state_dict(), tokenizer_json=BUNDLED_TOKENIZER)
    return census(out)


def init(
    out: Path = typer.Argument(..., metavar="OUT", help="New (or empty) directory to write."),
    preset: str = typer.Option("tiny", "--preset", help="Architecture preset: tiny, small or v41-flash."),
    seed: int = typer.Option(0, "--seed", min=-2**63, max=2**64 - 1,  # the range torch's generator takes
                             help="Weight seed; the same seed writes the same bytes."),
    as_json: bool = typer.Option(False, "--json", help="Print the checkpoint census as JSON."),
) -> None:
    """Write a random-weight checkpoint (FP8/FP4, official names and layout) for tests and demos."""
    with guarded():
        info = write_random_checkpoint(out, preset, seed)
    if as_json:
        return typer.echo(json.dumps({"path": str(out), **info}, indent=2))
    typer.echo(f"wrote {out}: {info['tensors']} tensors, {info['bytes'] / 2**20:.1f} MiB in {info['shards']} shard(s)")
