"""What a stage boundary costs inside one persistent kernel against a dependent launch's (#10).

    python3 scripts/persistent_probe.py OUT.jsonl [--stages 8] [--layers 40] [--rows 2048,256]

A decode step at batch 1 is a chain of small dependent kernels (~13 a plain layer at `small`),
each paying a boundary — its wait for the kernel before, the read of that kernel's output,
its own reduction and store — of a few µs, beside weights that stream at the copy rate in
about 2 µs. The route left to the batch-1 bandwidth target is one persistent kernel a layer
whose stages wait on counters instead of launches. This probe times that boundary on its own,
on the simplest chain there is: ``layers`` x ``stages`` GEMVs y_i = W_i y_(i-1), W_i
[rows, rows] bf16, each weight distinct (rows 2048: 320 of 8 MB, more than the L2 holds), as

- ``launches``: one launch of ``model.kernels.matvec.gemv`` a stage, as a step runs it
  (CUDA graph, programmatic dependent launches: each program asks for its tile of the weight
  before its wait);
- ``persistent``: one launch a layer (``--per-launch`` stages), one program a tile of
  ``--tile-rows`` rows resident for the whole launch; at each stage a program asks for its
  tile of the weight, then spins until every program has stored its part of the stage
  before (a counter read by atomics or by volatile loads, or a flag a program read all at
  once; then acquire), reads that output from the L2, reduces, stores, and counts itself
  done (release). The counters are zeroed by a memset node a launch.

Both compute the same chain (``max_abs_diff`` of its last output: rounding only, the sums
in another order). Prints one JSON line a size with each variant's µs a stage (best of 5
graph replays) and the weights' TB/s; also with ``--rows 256`` (tiles
that stream in ~no time) so the boundary's latency stands alone. A probe, not a test: it
decides whether the rewrite is worth making.

Timed 2026-12-04 (a3c5b58; H200, 320 stages; docs/gpu-fast-path.md, *Tried and not kept*): PDL
launches 3.47-3.50 µs a stage of 8 MB and 1.08-1.09 of 128 KB; persistent at best 3.83-3.92
and 1.40-1.69 (no poll or program count got closer): a boundary inside one Triton kernel
costs more than a dependent launch's, so the persistent layer is not the route (not kept in
the model).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_sweep import graphed_us  # noqa: E402  (scripts/ is this script's own folder)
from model.kernels import matvec  # noqa: E402

SPIN_LIMIT = tl.constexpr(1 << 20)  # polls before a program gives up (a bug must not hang the GPU run)


@triton.jit
def _wait_for(cnt_ptr, target, err_ptr, POLL: tl.constexpr, PB: tl.constexpr):
    """Spin until the stage before is done (then acquire: the stores it counts are visible).
    POLL 0: the stage's counter read by atomics until it reaches ``target``; 1: the counter
    read by volatile loads, one atomic at the end; 2: ``target`` flags, one a program,
    read at once by volatile loads until none is 0 (no atomics on one word from every program)."""
    polls = 0
    if POLL == 2:
        q = tl.arange(0, PB)
        f = tl.load(cnt_ptr + q, mask=q < target, other=1, volatile=True)
        while (tl.min(f, 0) == 0) & (polls < SPIN_LIMIT):
            f = tl.load(cnt_ptr + q, mask=q < target, other=1, volatile=True)
            polls += 1
        seen = tl.where(tl.min(f, 0) == 0, 0, target)
        tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    elif POLL == 1:
        seen = tl.load(cnt_ptr, volatile=True)
        while (seen < target) & (polls < SPIN_LIMIT):
            seen = tl.load(cnt_ptr, volatile=True)
            polls += 1
        seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    else:
        seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
        while (seen < target) & (polls < SPIN_LIMIT):
            seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
            polls += 1
    if seen < target:
        tl.atomic_add(err_ptr, 1, sem="relaxed")


@triton.jit
def _persistent_chain_kernel(w_ptr, x_ptr, y_ptr, cnt_ptr, err_ptr, S, O, P,
                             D: tl.constexpr, BLOCK_O: tl.constexpr, POLL: tl.constexpr, PB: tl.constexpr):
    """Program p: rows [p * BLOCK_O, +BLOCK_O) of every stage s: y[s] = W[s] y[s - 1] (y[-1] = x).
    ``cnt`` counts the programs done with each stage (POLL 2: a flag a program and stage),
    zeroed before the launch."""
    p = tl.program_id(0)
    o = p * BLOCK_O + tl.arange(0, BLOCK_O)
    d = tl.arange(0, D)
    s = 0
    while s < S:
        w = tl.load(w_ptr + s * O * D + o[:, None] * D + d[None, :], eviction_policy="evict_first")
        if s == 0:
            xs = tl.load(x_ptr + d).to(tl.float32)
        else:
            if POLL == 2:
                _wait_for(cnt_ptr + (s - 1) * P, P, err_ptr, POLL, PB)
            else:
                _wait_for(cnt_ptr + s - 1, P, err_ptr, POLL, PB)
            xs = tl.load(y_ptr + (s - 1) * D + d, cache_modifier=".cg").to(tl.float32)
        acc = tl.sum(w.to(tl.float32) * xs[None, :], 1)
        tl.store(y_ptr + s * D + o, acc.to(tl.bfloat16))
        tl.debug_barrier()  # every thread's store made before the count
        if POLL == 2:
            tl.atomic_xchg(cnt_ptr + s * P + p, 1, sem="release", scope="gpu")
        else:
            tl.atomic_add(cnt_ptr + s, 1, sem="release", scope="gpu")
        s += 1


def persistent_chain(ws: torch.Tensor, x: torch.Tensor, y: torch.Tensor, cnt: torch.Tensor, err: torch.Tensor,
                     tile_rows: int, warps: int, poll: int) -> None:
    """``ws`` [S, O, D] -> ``y`` [S, D] (O == D, the chain's rows), one launch; ``cnt`` holds
    S * programs int32s."""
    S, O, D = ws.shape
    P = O // tile_rows
    cnt.zero_()
    _persistent_chain_kernel[(P,)](ws, x, y, cnt, err, S, O, P, D=D, BLOCK_O=tile_rows,
                                   POLL=poll, PB=triton.next_power_of_2(P), num_warps=warps)


def run(rows: int, a, out) -> None:
    """Both variants on chains of ``rows`` x ``rows`` weights (D = rows)."""
    L, S = a.layers, a.stages
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = (torch.randn(L * S, rows, rows, device="cuda", generator=gen) / rows ** 0.5).to(torch.bfloat16)
    x = torch.randn(1, rows, device="cuda", generator=gen).to(torch.bfloat16)
    stages, weight_bytes = L * S, ws.numel() * ws.element_size()

    def launches():
        h = x
        for i in range(stages):
            (h,) = matvec.gemv(h, ws[i])
        return h

    ref = launches()
    res = {"rows": rows, "stages": stages}
    us = graphed_us(launches, calls=1)
    res["launches"] = {"us_per_stage": us / stages, "weights_tb_per_s": weight_bytes / us / 1e6}
    os.environ["DSAGENT_PDL"] = "0"  # read at each launch (``fused.chained``)
    us = graphed_us(launches, calls=1)
    del os.environ["DSAGENT_PDL"]
    res["launches_no_pdl"] = {"us_per_stage": us / stages, "weights_tb_per_s": weight_bytes / us / 1e6}
    per = a.per_launch or S
    y = torch.empty(stages, rows, device="cuda", dtype=torch.bfloat16)
    cnt = torch.zeros(stages * rows, device="cuda", dtype=torch.int32)  # room for a flag a program
    err = torch.zeros(1, device="cuda", dtype=torch.int32)
    for tile_rows, warps, poll in a.variants:
        if rows % tile_rows:
            continue

        def chain():
            h = x
            for i in range(0, stages, per):
                persistent_chain(ws[i:i + per], h.reshape(-1), y[i:i + per], cnt[i * rows:(i + per) * rows],
                                 err, tile_rows, warps, poll)
                h = y[i + per - 1]
            return h

        try:
            got = chain()
            torch.cuda.synchronize()
            us = graphed_us(chain, calls=1)
            key = f"persistent_t{tile_rows}_w{warps}_{('atomic', 'volatile', 'flags')[poll]}"
            res[key] = {"us_per_stage": us / stages, "weights_tb_per_s": weight_bytes / us / 1e6,
                        "programs": rows // tile_rows, "stages_per_launch": per,
                        "max_abs_diff": (got.float() - ref.reshape(-1).float()).abs().max().item(),
                        "spin_timeouts": int(err.item())}
        except Exception as e:  # a tile that does not compile is a figure too
            res[f"persistent_t{tile_rows}_w{warps}"] = {"error": repr(e)[:300]}
    print(json.dumps(res), flush=True)
    out.write(json.dumps(res) + "\n")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--stages", type=int, default=8)
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--rows", default="2048,256")
    p.add_argument("--per-launch", type=int, default=0, help="stages a persistent launch (0: --stages)")
    p.add_argument("--variants", default="16:8:0,16:8:1,16:8:2,8:8:2",
                   help="tile_rows:warps:poll (0 counter by atomics, 1 by volatile loads, 2 flags), comma-separated")
    a = p.parse_args()
    a.variants = [tuple(int(v) for v in s.split(":")) for s in a.variants.split(",")]
    with open(a.out, "w") as out:
        out.write(json.dumps({"device": torch.cuda.get_device_name(),
                              "sms": torch.cuda.get_device_properties(0).multi_processor_count}) + "\n")
        for rows in (int(r) for r in a.rows.split(",")):
            run(rows, a, out)


if __name__ == "__main__":
    main()
