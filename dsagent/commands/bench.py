"""`dsagent bench load|prefill|decode|resume|linears|store|prefix`: the measurements of RUNTIME.md §9, printed.

Owns: loading the model for a benchmark, building real FP4 KV payloads from a prefilled
engine state for the store benchmark, and printing the returned dicts (JSON with
`--json`, `key: value` lines otherwise). Does not own any measurement: those are
`model.bench` (engine), `sessions.bench` (store) and `dsagent.prefix_bench` (sessions
sharing a prefix). Benchmarks are never tests.
They are imported when a benchmark runs, not when the command line is built
(`model.bench` imports torch, which `dsagent --help` must not wait for).
"""
from __future__ import annotations

import json
import math
import os
from typing import Optional

import typer

from dsagent.failures import guarded
from dsagent.render import consoles, load_progress
from dsagent.runtime import Runtime, Settings
from dsagent.settings import FlagError, resolve
from sessions import DEFAULT_ZSTD_LEVEL, KVChunk

app = typer.Typer(help="Measure loading, prefill, decode, resume, linear layers and the store (prints figures; "
                       "never a test).",
                  no_args_is_help=True)

PRESET = typer.Option(None, "--preset", help="Random weights of a preset (tiny on CPU, small on a GPU).")
MODEL = typer.Option(None, "--model", help="Checkpoint directory (default: the embedded model).")
CTX = typer.Option(512, "--ctx", min=1, help="Context length in tokens.")
DEVICE = typer.Option("cpu", "--device", help="cpu or cuda.")
JSON = typer.Option(False, "--json", help="One JSON object on stdout.")
WEIGHTS = typer.Option("plain", "--weights", metavar="plain|packed",
                       help="packed: the FP8 / FP4 families held as the checkpoint stores them.")
LAYERS = typer.Option(None, "--layers", min=1, metavar="N", help="With --preset: cut to N layers, every kind of "
                                                                 "layer kept.")
ENGRAM_ROWS = typer.Option(None, "--engram-rows", min=1, metavar="R",
                           help="With --preset: Engram tables of about R rows each.")


def _measure():
    """`model.bench`, imported when a benchmark runs."""
    import model.bench

    return model.bench


def _runtime(model: str | None, preset: str | None, device: str, gpus: int = 1,
             held: tuple[str, int | None, int | None] = ("plain", None, None)) -> Runtime:
    """The benchmark's model; ``held``: (``--weights``, ``--layers``, ``--engram-rows``)."""
    from dsagent import ranks
    from dsagent.preflight import check_device, check_gpus
    from dsagent.runtime import default_source

    check_device(device)
    check_gpus(gpus, device)
    weights, layers, engram_rows = held
    _check_held(preset or model or default_source(), weights, layers, engram_rows)
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    threads = resolve().threads  # DSAGENT_THREADS or config.toml; else the CPUs this process may use
    settings = Settings(model=model, preset=preset, device=device, dtype=dtype, threads=threads, gpus=gpus,
                        weights=weights, layers=layers, engram_rows=engram_rows)
    world = ranks.torchrun_world()  # torchrun's ranks other than 0 follow rank 0's benchmark, then exit
    if world is not None and world.rank > 0:
        ranks.follow_as(world, settings)
        raise typer.Exit(0)
    _, err = consoles()
    with load_progress(err, "loading model") as progress:
        return Runtime.load(settings, progress=progress, world=world)


def _emit(result: dict, as_json: bool) -> None:
    if as_json:
        return typer.echo(json.dumps(result, indent=2, default=str))
    for key, value in result.items():
        if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            typer.echo(key)  # a breakdown: a row each, its figures by name
            for name, row in value.items():
                typer.echo(f"  {name:<26} " + "  ".join(f"{k} {_short(v)}" for k, v in row.items()))
        else:
            typer.echo(f"{key:<28} {_short(value)}")


def _short(value):
    """A figure as a table shows it: floats to 4 places (small ones to 4 significant digits)."""
    if not isinstance(value, float):
        return value
    return round(value, 4) if abs(value) >= 0.01 or value == 0 else float(f"{value:.4g}")


@app.command()
def load(preset: Optional[str] = PRESET, model: Optional[str] = MODEL, device: str = DEVICE, as_json: bool = JSON,
         weights: str = WEIGHTS, layers: Optional[int] = LAYERS, engram_rows: Optional[int] = ENGRAM_ROWS) -> None:
    """Load a checkpoint (or build a preset): seconds, bytes held, host memory before, at the peak and
    after, on CUDA the device's, and their ratios to the checkpoint's shards."""
    with guarded():
        from dsagent.preflight import check_device
        from dsagent.runtime import default_source
        from dsagent.threads import apply_threads

        check_device(device)
        source = preset or model or default_source()
        _check_held(source, weights, layers, engram_rows)
        apply_threads(resolve().threads)
        dtype = _dtype(device)
        if _is_checkpoint(source):
            _, err = consoles()
            with load_progress(err, "loading model") as progress:
                _, result = _measure().bench_checkpoint(source, device=device, dtype=dtype, weights=weights,
                                                        progress=progress)
        else:
            _, result = _measure().bench_model(source, device=device, dtype=dtype, weights=weights, layers=layers,
                                               engram_rows=engram_rows)
        _emit(result, as_json)


def _check_held(source: str, weights: str, layers: int | None, engram_rows: int | None) -> None:
    from model.loading import WEIGHTS as FORMATS

    if weights not in FORMATS:
        raise FlagError(f"--weights {weights!r} is not plain or packed")
    if (layers or engram_rows) and _is_checkpoint(source):
        raise FlagError("--layers and --engram-rows cut a preset; a checkpoint loads as it is")


def _is_checkpoint(source: str) -> bool:
    from model.args import PRESETS

    return source not in PRESETS


def _dtype(device: str):
    """The dtype the other benchmarks load in: bf16 on CUDA, float32 on the CPU."""
    import torch

    return torch.bfloat16 if device.startswith("cuda") else torch.float32


@app.command()
def prefill(preset: Optional[str] = PRESET, model: Optional[str] = MODEL, ctx: int = CTX,
            device: str = DEVICE, as_json: bool = JSON,
            chunk: Optional[int] = typer.Option(None, "--chunk", min=1, help="Tokens a prefill runs at once "
                                                                              "(default: 8192 on CUDA, 512 on the CPU)."),
            parts: bool = typer.Option(True, "--parts/--no-parts", help="Time each part of the model in one "
                                                                        "more run of each mode."),
            weights: str = WEIGHTS, layers: Optional[int] = LAYERS, engram_rows: Optional[int] = ENGRAM_ROWS) -> None:
    """CED prefill vs exact prefill: tokens/s, how far their outputs agree, and the model FLOPs
    over the time against the device's matmul rate (prefill_mfu), by part."""
    with guarded():
        m = _runtime(model, preset, device, held=(weights, layers, engram_rows)).model
        _emit(_measure().bench_prefill(m, ctx, chunk=chunk, gen=16, parts=parts), as_json)


@app.command()
def decode(preset: Optional[str] = PRESET, model: Optional[str] = MODEL, ctx: int = CTX,
           device: str = DEVICE, as_json: bool = JSON,
           speculative: bool = typer.Option(False, "--speculative", help="DSpark: verify cost, accepted length, "
                                                                          "tokens per target forward; of a "
                                                                          "checkpoint, on the evaluation's replies."),
           cases: int = typer.Option(4, "--cases", min=1, help="With --speculative, of a checkpoint: held-out "
                                                               "evaluation cases per skill (a-e, r) to reply to."),
           temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="With --speculative, of a "
                                             "checkpoint: sample the replies (reply i seeded i), 0 greedy."),
           paths: bool = typer.Option(False, "--paths", help="Step time with each fast path (CUDA graphs, kernels, "
                                                            "grouped experts) turned off in turn."),
           profiled: bool = typer.Option(False, "--profile", help="Kernels per step and the ones that take "
                                                                  "the step's device time."),
           chained: bool = typer.Option(False, "--chained", help="With --profile: dependent launches on, as a "
                                                                  "step runs (read each kernel's advance of the "
                                                                  "step's span, not its busy time)."),
           host: bool = typer.Option(False, "--host", help="The host's time to issue a step beside the step's "
                                                           "time: near 1, the device waits on Python."),
           tables: bool = typer.Option(False, "--tables", help="The Engram tables on the device and in host memory "
                                                               "side by side: each placement's step time and its "
                                                               "gather of a step's rows."),
           batch: int = typer.Option(1, "--batch", min=1, help="Rows of each --paths or --profile step (the MoE "
                                                                "paths differ most at batch 16)."),
           gpus: int = typer.Option(1, "--gpus", min=1, metavar="N",
                                    help="The model split over N ranks (as run --gpus N); the step beside its "
                                         "all-reduces. Not with --speculative, --paths, --profile or --host."),
           weights: str = WEIGHTS, layers: Optional[int] = LAYERS, engram_rows: Optional[int] = ENGRAM_ROWS) -> None:
    """Decode step time at a short context and at --ctx (sparse attention keeps it flat)."""
    with guarded():
        if gpus > 1 and (speculative or paths or profiled or host or tables):
            raise FlagError("--gpus N > 1 times the plain step only: leave out --speculative, --paths, --profile, "
                            "--host and --tables")
        with _runtime(model, preset, device, gpus, (weights, layers, engram_rows)) as rt:
            if speculative and preset is None:
                return _emit(_speculative_replies(rt, cases, temperature), as_json)
            if tables:
                return _emit(_tables(rt.model, ctx), as_json)
            _decode(rt.model, ctx, as_json, speculative, paths, profiled, chained, host, batch)


def _tables(m, ctx: int) -> dict:
    out = _measure().bench_engram(m, ctx)
    if not out:
        raise FlagError("--tables: this model has no Engram layers")
    return out


def _speculative_replies(rt: Runtime, cases: int, temperature: float = 0.0) -> dict:
    """DSpark on a checkpoint: the replies to ``cases`` held-out evaluation cases per skill."""
    from dsagent.evaluate import MAX_NEW_TOKENS, SKILLS, SLACK, make_cases, prompt_inputs
    from model.dspark import SpeculationUnavailable, has_draft_stages

    if not has_draft_stages(rt.model):
        raise SpeculationUnavailable("this checkpoint has no DSpark draft stages (mtp.*); run without --speculative")
    held = make_cases(rt.tokenizer, n=cases, skills=SKILLS)
    prompts = [(*prompt_inputs(rt, c), min(MAX_NEW_TOKENS, c.expected_tokens + SLACK)) for c in held]
    result = _measure().bench_speculative_replies(rt.model, prompts, stop_ids=(rt.tokenizer.eos_id,),
                                                  chunk=rt.engine.chunk, temperature=temperature)
    return {**result, "cases": f"{cases} per skill of {','.join(SKILLS)} (seed 7919)"}


def _decode(m, ctx, as_json, speculative, paths, profiled, chained, host, batch) -> None:
    measure = _measure()
    if profiled:
        _emit(measure.bench_profile(m, ctx, batch=batch, chained=chained), as_json)
    elif host:
        _emit(measure.bench_host(m, ctx), as_json)
    elif paths:
        _emit(measure.bench_paths(m, ctx, batch=batch), as_json)
    else:
        _emit(measure.bench_speculative(m, ctx) if speculative else measure.bench_decode(m, ctx, steps=8), as_json)


@app.command()
def resume(preset: Optional[str] = PRESET, model: Optional[str] = MODEL, ctx: int = CTX,
           device: str = DEVICE, as_json: bool = JSON) -> None:
    """Resume from exported global KV plus a window replay vs a full re-prefill."""
    with guarded():
        _emit(_measure().bench_resume(_runtime(model, preset, device).model, ctx, gen=16), as_json)


@app.command()
def linears(preset: Optional[str] = PRESET, model: Optional[str] = MODEL, device: str = DEVICE, as_json: bool = JSON,
            tokens: int = typer.Option(8192, "--tokens", min=1, help="Tokens of the one exact prefill chunk."),
            weights: str = WEIGHTS, layers: Optional[int] = LAYERS, engram_rows: Optional[int] = ENGRAM_ROWS) -> None:
    """Prefill linear layers (nn.Linear and grouped-expert GEMMs) against the device's matmul rate, by
    part of the model and by the format each weight is held in."""
    with guarded():
        m = _runtime(model, preset, device, held=(weights, layers, engram_rows)).model
        _emit(_measure().bench_linears(m, tokens), as_json)


@app.command()
def store(preset: Optional[str] = PRESET, model: Optional[str] = MODEL, ctx: int = CTX,
          chunk_tokens: int = typer.Option(256, "--chunk-tokens", min=1), device: str = DEVICE,
          as_json: bool = JSON) -> None:
    """zstd levels and store save/load throughput on real FP4 KV from a prefilled state."""
    with guarded():
        from sessions.bench import store_throughput, zstd_levels

        rt = _runtime(model, preset, device)
        chunks, tokens = real_chunks(rt, ctx, chunk_tokens)
        payloads = {kind: b"".join(b for c in chunks for n, b in c.blobs.items() if n.endswith(kind))
                    for kind in (".kv", ".index")}
        result = {"bench": "store", "ctx": len(tokens), "chunk_tokens": chunk_tokens,
                  "zstd": zstd_levels(payloads, levels=(1, 3, 9, 19), repeat=1),
                  "store": store_throughput(chunks, tokens, chunk_tokens=chunk_tokens, zstd_level=DEFAULT_ZSTD_LEVEL,
                                            formula_bytes_per_token=rt.args.kv_bytes_per_token())}
        _emit(result, as_json)


@app.command()
def prefix(preset: Optional[str] = PRESET, model: Optional[str] = MODEL, device: str = DEVICE, as_json: bool = JSON,
           rounds: int = typer.Option(3, "--rounds", min=1, help="New sessions timed each way, alternated."),
           prompt: str = typer.Option("What is 48 * 12?", "--prompt", help="The new sessions' first message.")) -> None:
    """A new session's first turn with and without the KV stored for its system prompt and tools."""
    with guarded():
        from dsagent.prefix_bench import bench_prefix

        _emit(bench_prefix(_runtime(model, preset, device), prompt=prompt, rounds=rounds), as_json)


def real_chunks(rt: Runtime, ctx: int, chunk_tokens: int) -> tuple[list[KVChunk], list[int]]:
    """KV chunks of a CED prefill of ``ctx`` random tokens, cut as the agent's save point cuts them."""
    from model.engine import Engine

    engine = Engine(rt.model, mode="ced")
    state = engine.new_state()
    ids = _measure().prompt_ids(rt.model, ctx)
    engine.prefill(state, ids)
    ratios = [r for r in rt.args.ratios if r]
    mult = math.lcm(*ratios) if ratios else 1
    if chunk_tokens % mult:
        raise ValueError(f"--chunk-tokens must be a multiple of {mult} (every compression ratio)")
    k = state.cache.stored_tokens(mult)
    if k == 0:
        raise ValueError(f"--ctx {ctx} is too short to store any KV; use a longer context")
    chunks = [KVChunk(c, min(c + chunk_tokens, k), state.cache.export_range(c, min(c + chunk_tokens, k)))
              for c in range(0, k, chunk_tokens)]
    return chunks, ids[0, :k].tolist()


@app.command("threads")
def threads_(preset: Optional[str] = PRESET, model: Optional[str] = MODEL, ctx: int = CTX, as_json: bool = JSON,
             counts: str = typer.Option("", "--counts", metavar="A,B,...",
                                        help="Thread counts to time (default: the machine's CPUs, then the CPUs "
                                             "this process may use)."),
             busy: int = typer.Option(0, "--co-load", min=0, metavar="N",
                                      help="Busy-loop processes started beside the run, each taking a CPU."),
             steps: int = typer.Option(16, "--steps", min=1, help="Decode steps timed after each prefill."),
             rounds: int = typer.Option(3, "--rounds", min=1,
                                        help="Rounds; the counts alternate within each.")) -> None:
    """Prefill and decode time at several torch thread counts, beside busy loops if asked."""
    from dsagent.threads import available_cpus, measure

    with guarded():
        try:
            chosen = [int(c) for c in counts.split(",") if c.strip()] or [os.cpu_count() or 1, available_cpus()]
        except ValueError:
            raise FlagError(f"--counts takes thread counts like 2,1, not {counts!r}") from None
        if min(chosen) < 1:
            raise FlagError("--counts: every thread count must be 1 or more")
        m = _runtime(model, preset, "cpu").model
        _emit(measure(m, list(dict.fromkeys(chosen)), ctx, steps, rounds, busy), as_json)
