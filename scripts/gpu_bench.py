"""Run the engine benchmarks on a GPU and write JSON lines.

Usage: python3 scripts/gpu_bench.py OUT.jsonl [--preset small] [--layers N] [--engram-rows R] [--weights packed]
       [--prefill 8192,32768] [--decode 4096,32768]
       [--chunk 2048] [--prefill-profile 8192] [--linears 8192] [--paths 4096] [--paths-batch 1,16] [--host 4096] [--engram 4096] [--profile 16384]
       [--knobs moe.DOWN_EARLY,fused.MIN_BLOCKS_PER_SPLIT=2 --knobs-ctx 131072 --knobs-rounds 2] [--set moe.DOWN_EARLY,...]
Each figure is a ratio measured side by side in one run (RUNTIME.md §9). The device
machine lacks sqlite-utils/zstandard, so this imports only the `model` package.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from model.bench import (bench_batch, bench_model, bench_decode, bench_engram, bench_host, bench_knobs, bench_linears,
                         bench_paths,
                         bench_prefill, bench_prefill_profile, bench_profile, bench_resume, copy_tb_per_s, kernel_knob, matmul_tflops,
                         switched)


def device_ceilings() -> dict:
    return {"bf16_matmul_tflops": matmul_tflops(8192, torch.bfloat16, "cuda"),
            "copy_tb_per_s": copy_tb_per_s("cuda", 2 ** 30, repeats=10)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--preset", default="small")
    p.add_argument("--layers", type=int, default=None, help="the preset cut to this many layers (every kind kept)")
    p.add_argument("--engram-rows", type=int, default=None, help="Engram tables of about this many rows")
    p.add_argument("--weights", default="plain", choices=("plain", "packed"),
                   help="packed: the FP8 / FP4 families kept as a checkpoint stores them")
    p.add_argument("--prefill", default="8192")
    p.add_argument("--decode", default="4096,32768")
    p.add_argument("--resume", default="8192")
    p.add_argument("--batch", default="4096")
    p.add_argument("--linears", default="8192")
    p.add_argument("--paths", default="4096", help="contexts at which each fast path is turned off in turn")
    p.add_argument("--paths-batch", default="1", help="batch sizes of --paths (e.g. 1,16: the MoE paths at batch 16)")
    p.add_argument("--engram", default="", help="contexts at which the Engram tables on the GPU and in host memory "
                                                 "are timed side by side")
    p.add_argument("--host", default="", help="contexts at which the host's share of a decode step is measured")
    p.add_argument("--profile", default="", help="contexts at which a decode step is profiled by kernel")
    p.add_argument("--prefill-profile", default="", help="contexts at which a CED and an exact prefill are profiled")
    p.add_argument("--chunk", type=int, default=None,
                   help="prefill chunk of --prefill and --prefill-profile (default: the engine's, 8192 on CUDA)")
    p.add_argument("--profile-batch", default="1", help="batch sizes of --profile")
    p.add_argument("--timeline", default="",
                   help="a file for the chained profile's kernels in order: a JSON line a profile, [[start µs, end µs, "
                        "name], ...]")
    p.add_argument("--knobs", default="", help="kernel knobs (moe.DOWN_EARLY,fused.MIN_BLOCKS_PER_SPLIT=2,...) timed "
                                               "off, alone and all on")
    p.add_argument("--knobs-ctx", default="131072", help="contexts of --knobs")
    p.add_argument("--knobs-rounds", type=int, default=2, help="alternated rounds of --knobs (each variant's best kept)")
    p.add_argument("--set", default="", help="kernel knobs turned on before every bench (moe.DOWN_EARLY,...)")
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    with open(a.out, "w") as out:
        def emit(d):
            out.write(json.dumps(d) + "\n")
            out.flush()
            print(json.dumps(d), file=sys.stderr, flush=True)

        emit({"device": torch.cuda.get_device_name(), "torch": torch.__version__, **device_ceilings()})
        for knob in filter(None, a.set.split(",")):
            module, name, value = kernel_knob(knob)
            setattr(module, name, value)
            emit({"set": knob})
        model, loaded = bench_model(a.preset, weights=a.weights, layers=a.layers, engram_rows=a.engram_rows)
        emit({**loaded, "params": sum(x.numel() for x in model.parameters())})
        for n in map(int, filter(None, a.prefill.split(","))):
            emit(bench_prefill(model, n, chunk=a.chunk, gen=16))
        for n in map(int, filter(None, a.prefill_profile.split(","))):
            for mode in ("ced", "exact"):
                emit(bench_prefill_profile(model, n, mode=mode, chunk=a.chunk))
        short, *longs = list(map(int, filter(None, a.decode.split(",")))) or [0]
        for n in longs:
            emit(bench_decode(model, n, short=short, steps=8))
        for n in map(int, filter(None, a.batch.split(","))):
            emit(bench_batch(model, n, batch=16))
        for n in map(int, filter(None, a.resume.split(","))):
            emit(bench_resume(model, n, gen=16))
        for n in map(int, filter(None, a.linears.split(","))):
            emit(bench_linears(model, n))
        for n in map(int, filter(None, a.paths.split(","))):
            for b in map(int, a.paths_batch.split(",")):
                emit(bench_paths(model, n, batch=b))
        for n in map(int, filter(None, a.knobs_ctx.split(","))) if a.knobs else ():
            emit(bench_knobs(model, n, a.knobs.split(","), rounds=a.knobs_rounds))
        for n in map(int, filter(None, a.engram.split(","))):
            emit(bench_engram(model, n))
        for n in map(int, filter(None, a.host.split(","))):
            emit(bench_host(model, n))
        for n in map(int, filter(None, a.profile.split(","))):
            for b in map(int, a.profile_batch.split(",")):
                # plain launches with and without graphs (each kernel's own time), then as a step
                # runs, dependent launches on (each kernel's advance of the step's span)
                for graphs, chained in ((True, False), (False, False), (True, True)):
                    spans = [] if a.timeline and chained else None
                    with switched(graphs=graphs):
                        emit({"graphs": graphs, **bench_profile(model, n, batch=b, top=60, chained=chained,
                                                                spans=spans)})
                    if spans:
                        with open(a.timeline, "a") as f:
                            f.write(json.dumps({"ctx": n, "batch": b, "spans": [[s, e, k[:60]] for s, e, k in spans]})
                                    + "\n")


if __name__ == "__main__":
    main()
