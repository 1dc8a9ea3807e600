"""`dsagent bench prefill|decode|resume|linears|store`: the measurements of RUNTIME.md §9, printed.

Owns: loading the model for a benchmark, building real FP4 KV payloads from a prefilled
engine state for the store benchmark, and printing the returned dicts (JSON with
`--json`, `key: value` lines otherwise). Does not own any measurement: those are
`model.bench` (engine) and `sessions.bench` (store). Benchmarks are never tests.
"""
from __future__ import annotations

import json
import math
from typing import Optional

import typer

from dsagent.errors import handled
from dsagent.render import consoles, load_progress
from dsagent.runtime import Runtime, Settings
from model.bench import (bench_decode, bench_host, bench_linears, bench_paths, bench_prefill, bench_profile,
                         bench_resume, bench_speculative, prompt_ids)
from model.engine import Engine
from sessions import DEFAULT_ZSTD_LEVEL, KVChunk
from sessions.bench import store_throughput, zstd_levels

app = typer.Typer(help="Measure prefill, decode, resume, linear layers and the store (prints figures; never a test).",
                  no_args_is_help=True)

PRESET = typer.Option(None, "--preset", help="Random weights of a preset (tiny on CPU, small on a GPU).")
MODEL = typer.Option(None, "--model", help="Checkpoint directory (default: the embedded model).")
CTX = typer.Option(512, "--ctx", min=1, help="Context length in tokens.")
DEVICE = typer.Option("cpu", "--device", help="cpu or cuda.")
JSON = typer.Option(False, "--json", help="One JSON object on stdout.")


def _runtime(model: str | None, preset: str | None, device: str) -> Runtime:
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    _, err = consoles()
    with load_progress(err, "loading model") as progress:
        return Runtime.load(Settings(model=model, preset=preset, device=device, dtype=dtype), progress=progress)


def _emit(result: dict, as_json: bool) -> None:
    if as_json:
        return typer.echo(json.dumps(result, indent=2, default=str))
    for key, value in result.items():
        typer.echo(f"{key:<28} {round(value, 4) if isinstance(value, float) else value}")


@app.command()
def prefill(preset: Optional[str] = PRESET, model: Optional[str] = MODEL, ctx: int = CTX,
            device: str = DEVICE, as_json: bool = JSON) -> None:
    """CED prefill vs exact prefill: tokens/s and how far their outputs agree."""
    with handled():
        _emit(bench_prefill(_runtime(model, preset, device).model, ctx, gen=16), as_json)


@app.command()
def decode(preset: Optional[str] = PRESET, model: Optional[str] = MODEL, ctx: int = CTX,
           device: str = DEVICE, as_json: bool = JSON,
           speculative: bool = typer.Option(False, "--speculative", help="DSpark: verify cost, accepted length, "
                                                                          "tokens per target forward."),
           paths: bool = typer.Option(False, "--paths", help="Step time with each fast path (CUDA graphs, kernels, "
                                                            "grouped experts) turned off in turn."),
           profiled: bool = typer.Option(False, "--profile", help="Kernels per step and the ones that take "
                                                                  "the step's device time."),
           chained: bool = typer.Option(False, "--chained", help="With --profile: dependent launches on, as a "
                                                                  "step runs (read each kernel's advance of the "
                                                                  "step's span, not its busy time)."),
           host: bool = typer.Option(False, "--host", help="The host's time to issue a step beside the step's "
                                                           "time: near 1, the device waits on Python."),
           batch: int = typer.Option(1, "--batch", min=1, help="Rows of each --paths or --profile step (the MoE "
                                                                "paths differ most at batch 16).")) -> None:
    """Decode step time at a short context and at --ctx (sparse attention keeps it flat)."""
    with handled():
        m = _runtime(model, preset, device).model
        if profiled:
            _emit(bench_profile(m, ctx, batch=batch, chained=chained), as_json)
        elif host:
            _emit(bench_host(m, ctx), as_json)
        elif paths:
            _emit(bench_paths(m, ctx, batch=batch), as_json)
        else:
            _emit(bench_speculative(m, ctx) if speculative else bench_decode(m, ctx, steps=8), as_json)


@app.command()
def resume(preset: Optional[str] = PRESET, model: Optional[str] = MODEL, ctx: int = CTX,
           device: str = DEVICE, as_json: bool = JSON) -> None:
    """Resume from exported global KV plus a window replay vs a full re-prefill."""
    with handled():
        _emit(bench_resume(_runtime(model, preset, device).model, ctx, gen=16), as_json)


@app.command()
def linears(preset: Optional[str] = PRESET, model: Optional[str] = MODEL, device: str = DEVICE, as_json: bool = JSON,
            tokens: int = typer.Option(8192, "--tokens", min=1, help="Tokens of the one exact prefill chunk.")) -> None:
    """Prefill linear layers (nn.Linear and grouped-expert GEMMs) against the device's matmul rate."""
    with handled():
        _emit(bench_linears(_runtime(model, preset, device).model, tokens), as_json)


@app.command()
def store(preset: Optional[str] = PRESET, model: Optional[str] = MODEL, ctx: int = CTX,
          chunk_tokens: int = typer.Option(256, "--chunk-tokens", min=1), device: str = DEVICE,
          as_json: bool = JSON) -> None:
    """zstd levels and store save/load throughput on real FP4 KV from a prefilled state."""
    with handled():
        rt = _runtime(model, preset, device)
        chunks, tokens = real_chunks(rt, ctx, chunk_tokens)
        payloads = {kind: b"".join(b for c in chunks for n, b in c.blobs.items() if n.endswith(kind))
                    for kind in (".kv", ".index")}
        result = {"bench": "store", "ctx": len(tokens), "chunk_tokens": chunk_tokens,
                  "zstd": zstd_levels(payloads, levels=(1, 3, 9, 19), repeat=1),
                  "store": store_throughput(chunks, tokens, chunk_tokens=chunk_tokens, zstd_level=DEFAULT_ZSTD_LEVEL,
                                            formula_bytes_per_token=rt.args.kv_bytes_per_token())}
        _emit(result, as_json)


def real_chunks(rt: Runtime, ctx: int, chunk_tokens: int) -> tuple[list[KVChunk], list[int]]:
    """KV chunks of a CED prefill of ``ctx`` random tokens, cut as the agent's save point cuts them."""
    engine = Engine(rt.model, mode="ced")
    state = engine.new_state()
    ids = prompt_ids(rt.model, ctx)
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
