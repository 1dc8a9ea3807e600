"""`dsagent eval`: the skill evaluation of a model on held-out corpus records, printed.

Owns: the flags, loading the model with a progress bar, the evaluation progress bar,
and printing the result as a table (rows skills, with a row per turn index 1, 2, 3+ under
a per-turn skill; columns modes; cells correct/n) or as one JSON object with `--json`.
Does not own cases, generation or scoring: those are `dsagent.evaluate`, whose docstring
states the rules.

The flags' defaults are written here, not imported from `dsagent.evaluate` (which imports
torch and the model): building `dsagent --help` must not load them. A test checks that
they equal the evaluation's own constants.
"""
from __future__ import annotations

import json
from typing import Optional

import typer
from rich.table import Table

from dsagent.failures import guarded
from dsagent.render import consoles, load_progress
from dsagent.runtime import Runtime, Settings
from dsagent.settings import FlagError, resolve

# = dsagent.evaluate's HELD_OUT_SEED, MODES, SKILLS (the default; f is asked for by name), MAX_NEW_TOKENS
# and dsagent.corpus's RECALL_TOKENS
HELD_OUT_SEED = 7919
MODES = ("exact", "ced", "float-kv", "resume", "prefix")
SPECULATIVE = "speculative"
SKILLS = ("a", "b", "c", "d", "e", "r")
MAX_NEW_TOKENS = 128
RECALL_TOKENS = (2000, 6000)


def eval_command(
    model: Optional[str] = typer.Option(None, "--model", help="Checkpoint directory (default: the embedded model)."),
    preset: Optional[str] = typer.Option(None, "--preset", help="Random weights of a preset instead."),
    n: int = typer.Option(10, "--n", min=1, help="Cases per skill (f: records, each a case per turn)."),
    seed: int = typer.Option(HELD_OUT_SEED, "--seed", help="Corpus seed of the held-out records (the seeds that trained the default, TRAINING.json's, are refused)."),
    skills: str = typer.Option(",".join(SKILLS), "--skills", help="Comma-separated skills: a chat, b tools, "
                                                                   "c images, d recall, e multi-turn, r reading "
                                                                   "tool results back; and f, mixed conversations "
                                                                   "scored per turn (not in the default)."),
    modes: str = typer.Option(",".join(MODES), "--modes", help="Comma-separated: " + ", ".join(MODES) + ", and "
                              "speculative (CED with DSpark; not in the default)."),
    speculative: bool = typer.Option(False, "--speculative", help="Add the speculative mode (CED prefill, DSpark "
                                     "decoding: its accuracy, replies the same as ced's, tokens per verify)."),
    max_new_tokens: int = typer.Option(MAX_NEW_TOKENS, "--max-new-tokens", min=1, help="Cap on new tokens per "
                                       "reply (each is also capped at its target's length + 16)."),
    recall_tokens: str = typer.Option(f"{RECALL_TOKENS[0]},{RECALL_TOKENS[1]}", "--recall-tokens",
                                      help="LO,HI: length of the recall cases' logs in tokens (shorter ones probe "
                                           "retrieval by distance; the table's default is the corpus's)."),
    recall_place: str = typer.Option("first", "--recall-place", metavar="first|any",
                                     help="Where the recall cases' asked key lies: first (the corpus's: early, "
                                          "its decoys of the same kind after) or any (the key and each decoy "
                                          "anywhere: decoys often come first, which training never showed)."),
    words: str = typer.Option("closed", "--words", metavar="closed|held-out",
                              help="Where the cases' names, files and keys come from: closed (the corpus's "
                                   "word lists) or held-out (generated words of the open vocabulary's half "
                                   "that training never draws from: the generalisation split)."),
    casual: bool = typer.Option(False, "--casual", help="Every question typed as people type them: lower case "
                                "first, no closing ? or ., 37*23 for 37 * 23 (echo requests as written)."),
    tool_errors: bool = typer.Option(False, "--tool-errors", help="Every tool question (b, r) and each "
                                     "conversation's first file question (f) asks for a file or folder the "
                                     "workspace lacks: the tool answers with an error, the reply must say so."),
    folder_words: bool = typer.Option(False, "--folder-words", help="The workspace's folder is named by a word "
                                      "of the cases' lexicon, not data, and every tool question (b, r) and each "
                                      "conversation's first file question (f) asks for its files by that name."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout."),
) -> None:
    """Score the model on held-out cases per skill, in exact, CED, float-KV, resumed and shared-prefix modes."""
    out, err = consoles()
    with guarded():
        if model and preset:
            raise FlagError("pass --model or --preset, not both")
        try:
            lengths = tuple(int(x) for x in _split(recall_tokens))
        except ValueError:
            raise FlagError(f"--recall-tokens takes LO,HI (two integers), not {recall_tokens!r}") from None
        from dsagent.evaluate import EvalConfigError, check_config, run_eval

        modes = modes + f",{SPECULATIVE}" if speculative and SPECULATIVE not in _split(modes) else modes
        try:
            check_config(skills=_split(skills), modes=_split(modes), seed=seed, recall_tokens=lengths,
                         recall_place=recall_place, words=words)
        except EvalConfigError as e:
            raise FlagError(str(e)) from None
        rt = _runtime(model, preset, device)
        with load_progress(err, "evaluating", unit="cases") as progress:
            try:
                result = run_eval(rt, n=n, seed=seed, skills=_split(skills), modes=_split(modes),
                                  max_new_tokens=max_new_tokens, recall_tokens=lengths, recall_place=recall_place,
                                  words=words, casual=casual, tool_errors=tool_errors, folder_words=folder_words,
                                  progress=progress)
            except EvalConfigError as e:
                raise FlagError(str(e)) from None
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=2, ensure_ascii=False))
    else:
        out.print(result_table(result))


def _split(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def _runtime(model: str | None, preset: str | None, device: str) -> Runtime:
    from dsagent.preflight import check_device

    check_device(device)
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    threads = resolve().threads  # DSAGENT_THREADS or config.toml; else the CPUs this process may use
    _, err = consoles()
    with load_progress(err, "loading model") as progress:
        return Runtime.load(Settings(model=model, preset=preset, device=device, dtype=dtype, threads=threads),
                            progress=progress)


def result_table(result) -> Table:
    """The `EvalResult` as a table: rows skills, columns modes."""
    from dsagent.evaluate import SKILL_NAMES, TURN_BUCKETS

    logs = "" if tuple(result.recall_tokens) == RECALL_TOKENS else ", recall logs {}-{} tokens".format(*result.recall_tokens)
    logs += "" if result.recall_place == "first" else f", recall keys placed {result.recall_place}"
    logs += "" if result.words == "closed" else f", {result.words} words"
    logs += ", typed casually" if result.casual else ""
    logs += ", files the workspace lacks" if result.tool_errors else ""
    logs += ", folders named by new words" if result.folder_words else ""
    t = Table(title=f"held-out skills (seed {result.seed}{logs}), correct/n")
    t.add_column("skill")
    for mode in result.modes:
        t.add_column(mode, justify="right")
    for skill in result.skills:
        t.add_row(f"{skill} {SKILL_NAMES[skill]}", *(_fraction(*result.cell(skill, m)) for m in result.modes))
        if skill in result.turn_skills():
            for turns in TURN_BUCKETS:
                t.add_row(f"  turn {turns}", *(_fraction(*result.turn_cell(skill, m, turns)) for m in result.modes))
            first = result.turn_asks(skill, turn=1)
            if first and first != result.turn_asks(skill):  # later turns also ask what no first turn does
                for turns in TURN_BUCKETS[1:]:
                    t.add_row(f"  turn {turns}, asking as turn 1 does",
                              *(_fraction(*result.turn_cell(skill, m, turns, first)) for m in result.modes))
            if any(r.after_cut for r in result.results if r.skill == skill):
                t.add_row("  after a cut reply", *(_fraction(*result.after_cut_cell(skill, m)) for m in result.modes))
    totals = [[result.cell(s, m) for s in result.skills] for m in result.modes]
    t.add_row("all", *(_fraction(sum(c for c, _ in col), sum(k for _, k in col)) for col in totals), end_section=True)
    same = [result.identical_to_ced(m) for m in result.modes]
    t.add_row("same reply as ced", *("" if s is None or m == "ced" else f"{s:.0%}" for s, m in zip(same, result.modes)))
    t.add_row("seconds", *(f"{result.seconds(m):.1f}" for m in result.modes))
    spec = result.speculation() if SPECULATIVE in result.modes else None
    if spec is not None:
        t.add_row("tokens per verify", *(f"{spec['tokens_per_verify']:.2f}" if m == SPECULATIVE else ""
                                         for m in result.modes))
    return t


def _fraction(correct: int, n: int) -> str:
    return f"{correct}/{n}"
