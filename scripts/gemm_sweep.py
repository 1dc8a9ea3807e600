"""Time the packed prefill GEMMs at V4.1-Flash's shapes, one JSON line each.

    python3 scripts/gemm_sweep.py OUT.jsonl [--only tiles,paths,stacks] [--rows 8192] [--tokens 8192]
        [--toy]  (tiny shapes and one tile a kind: a check that the script runs, e.g. on the CPU
        under TRITON_INTERPRET=1, not figures)

- ``tiles``: ``model.kernels.gemm``'s registers' kernel at each candidate tile, dense FP8 and
  FP4 weights (``--rows`` rows) and the grouped FP4 stacks (w1 with w3, and w2), against
  cuBLAS bf16 on floats already there; the best tile of each kind.
- ``paths``: by rows, a packed weight's GEMM three ways: the registers' kernel, decoded once
  (``model.kernels.dequant``) then ``F.linear``, and ``F.linear`` on floats already there; the
  decode pass alone. ``gemm.DEQUANT_ROWS`` is where the first two cross.
- ``stacks``: the MoE's routed experts (384, top 6) over ``--tokens`` tokens: the registers'
  grouped kernel against the stacks decoded by chunks then ``torch._grouped_mm``
  (``DSAGENT_PACKED_GEMM`` 1 / 0 through ``model.moe.GroupedLinear``).

Each figure is the median of repeated calls between CUDA events (perf_counter on the CPU),
after one warm-up call; every output is compared with a reference (``rel_err``), so a fast
wrong tiling shows. The bf16 matmul rate (n = 8192) is measured in the same run. A guide
for choosing ``model.kernels.gemm``'s constants, not a test. Figures of 2026-12-05 (an H100):
docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.bench import matmul_tflops, median_seconds as seconds  # noqa: E402
from model.kernels import dequant, gemm  # noqa: E402
from model.linear import Linear  # noqa: E402
from model.moe import GroupedLinear  # noqa: E402

SHAPES = [(1280, 5120), (32768, 1280), (5120, 8192), (2304, 5120), (5120, 2304)]  # wq_a, wq_b, wo_b, shared w1, w2
DENSE_TILES = [(128, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4),
               (256, 128, 64, 8, 3), (128, 64, 64, 4, 4)]
GROUPED_TILES = [(64, 128, 64, 4, 3), (64, 128, 128, 4, 3), (128, 128, 64, 4, 3), (64, 64, 64, 4, 3),
                 (128, 256, 64, 8, 3), (64, 256, 64, 4, 3), (64, 128, 64, 8, 3), (128, 128, 64, 8, 3),
                 (128, 128, 64, 8, 4)]
ROWS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
EXPERTS, TOP, INTER, HIDDEN = 384, 6, 2304, 5120
TOY = {"shapes": [(96, 64), (64, 128)], "tile": (32, 32, 32, 4, 1), "rows": (8, 40), "experts": 4, "inter": 64,
       "hidden": 64}


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def packed_layer(n: int, k: int, fmt: str, device, seed: int = 0) -> Linear:
    layer = Linear(k, n)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k ** -0.5)
    layer.pack(fmt)
    return layer.to(device)


def fp4_stack(e: int, n: int, k: int, device, seed: int) -> GroupedLinear:
    """Random FP4 bytes and scales near 2^-6 for ``e`` experts [n, k]: the sweep's values, not a model's."""
    g = torch.Generator().manual_seed(seed)
    stack = GroupedLinear()
    stack.hold(torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8).view(torch.int8).to(device),
               torch.randint(119, 124, (e, n, k // 32), generator=g, dtype=torch.uint8)
               .view(torch.float8_e8m0fnu).to(device), k)
    return stack


def routed_rows(tokens: int, experts: int, device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``ends`` of tokens x top-6 pairs routed uniformly at random, sorted by expert, and their route weights."""
    g = torch.Generator().manual_seed(seed)
    pairs = torch.randint(0, experts, (tokens * TOP,), generator=g)
    ends = torch.bincount(pairs, minlength=experts).cumsum(0).to(device, torch.int32)
    return ends, torch.rand(tokens * TOP, generator=g).to(device)


def sweep_tiles(args, emit, device, dtype) -> None:
    for fmt in ("fp8", "fp4"):
        for n, k in args.shapes:
            layer = packed_layer(n, k, fmt, device)
            w, dense = layer.gemv_weight(), layer.dense_weight(dtype)
            x = torch.randn(args.rows, k, device=device).to(dtype)
            ref = torch.nn.functional.linear(x, dense)
            flops = 2 * args.rows * n * k
            row = {"kind": "dense", "fmt": fmt, "N": n, "K": k, "rows": args.rows,
                   "cublas_tflops": flops / seconds(lambda: torch.nn.functional.linear(x, dense), device) / 1e12}
            for tile in args.dense_tiles:
                y = gemm.packed_matmul(x, w, tile)
                row[str(tile)] = {"tflops": flops / seconds(lambda: gemm.packed_matmul(x, w, tile), device) / 1e12,
                                  "rel_err": rel_err(y, ref)}
            emit(row)
    ends, route = routed_rows(args.tokens, args.experts, device)
    for name, n, k, paired in (("w1 with w3", args.inter, args.hidden, True), ("w2", args.hidden, args.inter, False)):
        w, v = fp4_stack(args.experts, n, k, device, 1), fp4_stack(args.experts, n, k, device, 2)
        x = (torch.randn(int(ends[-1]), k, device=device) * 0.1).to(dtype)
        flops = 2 * x.shape[0] * n * k * (2 if paired else 1)
        row, ref = {"kind": "grouped", "name": name, "rows": x.shape[0], "N": n, "K": k}, None

        def run(tile):
            return gemm.grouped_fp4(x, ends, w.weight, w.scale, paired=(v.weight, v.scale) if paired else None,
                                    route=route if paired else None, limit=10.0 if paired else 0.0, tile=tile)

        for tile in args.grouped_tiles:
            y = run(tile)
            ref = y if ref is None else ref
            row[str(tile)] = {"tflops": flops / seconds(lambda: run(tile), device) / 1e12, "rel_err": rel_err(y, ref)}
        emit(row)


def sweep_paths(args, emit, device, dtype) -> None:
    for fmt in ("fp8", "fp4"):
        for n, k in args.shapes:
            layer = packed_layer(n, k, fmt, device)
            w, dense = layer.gemv_weight(), layer.dense_weight(dtype)
            decoded = dequant.dequantise(w, dtype)
            row = {"kind": "paths", "fmt": fmt, "N": n, "K": k, "decode_equal": bool(torch.equal(decoded, dense)),
                   "decode_us": 1e6 * seconds(lambda: dequant.dequantise(w, dtype), device)}
            for m in args.row_counts:
                x = torch.randn(m, k, device=device).to(dtype)
                flops = 2 * m * n * k
                row[m] = {name: flops / seconds(fn, device) / 1e12 for name, fn in (
                    ("registers_tflops", lambda: gemm.packed_matmul(x, w, args.tile)),
                    ("decoded_once_tflops", lambda: torch.nn.functional.linear(x, dequant.dequantise(w, dtype))),
                    ("floats_there_tflops", lambda: torch.nn.functional.linear(x, dense)))}
            emit(row)


def sweep_stacks(args, emit, device, dtype) -> None:
    ends, route = routed_rows(args.tokens, args.experts, device)
    w1, w3 = fp4_stack(args.experts, args.inter, args.hidden, device, 1), fp4_stack(args.experts, args.inter, args.hidden, device, 2)
    w2 = fp4_stack(args.experts, args.hidden, args.inter, device, 3)
    rows = int(ends[-1])
    x = (torch.randn(rows, args.hidden, device=device) * 0.1).to(dtype)
    h = (torch.randn(rows, args.inter, device=device) * 0.1).to(dtype)
    flops = 2 * rows * args.inter * args.hidden
    row, outs = {"kind": "stacks", "tokens": args.tokens, "rows": rows}, {}
    with torch.no_grad():
        for flag, name in (("1", "registers"), ("0", "decoded_by_chunks")):
            os.environ["DSAGENT_PACKED_GEMM"] = flag
            outs[name] = w1(x, ends, gate=(w3, route, 10.0))
            row[name] = {"up_tflops": 2 * flops / seconds(lambda: w1(x, ends, gate=(w3, route, 10.0)), device) / 1e12,
                         "down_tflops": flops / seconds(lambda: w2(h, ends), device) / 1e12}
        os.environ.pop("DSAGENT_PACKED_GEMM")
    row["up_rel_err"] = rel_err(outs["registers"], outs["decoded_by_chunks"])
    emit(row)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--only", default="tiles,paths,stacks")
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--toy", action="store_true")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # fp32: the interpreter's
    toy = args.toy = args.toy or device == "cpu"
    args.shapes = TOY["shapes"] if toy else SHAPES
    args.dense_tiles = [TOY["tile"]] if toy else DENSE_TILES
    args.grouped_tiles = [TOY["tile"]] if toy else GROUPED_TILES
    args.tile = TOY["tile"] if toy else None
    args.row_counts = TOY["rows"] if toy else ROWS
    args.experts, args.inter, args.hidden = (TOY["experts"], TOY["inter"], TOY["hidden"]) if toy else (EXPERTS, INTER, HIDDEN)
    if toy:
        args.rows, args.tokens = min(args.rows, 48), min(args.tokens, 16)
    with args.out.open("a") as f:
        def emit(row: dict) -> None:
            line = json.dumps(row, default=str)
            f.write(line + "\n")
            f.flush()
            print(line, flush=True)

        emit({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "matmul_tflops": matmul_tflops(64 if toy else 8192, dtype, device)})
        sweeps = {"tiles": sweep_tiles, "paths": sweep_paths, "stacks": sweep_stacks}
        for name in args.only.split(","):
            sweeps[name](args, emit, device, dtype)


if __name__ == "__main__":
    main()
