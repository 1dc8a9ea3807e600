"""Where a decode step's host time goes (on a GPU): ``bench_host``; every operation in a
step that makes the host wait for the device (``torch.cuda.set_sync_debug_mode``), each
with the lines that called it; then cProfile over steps.

    python3 scripts/step_host.py [--preset small] [--ctx 4096] [--steps 20]
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model import load  # noqa: E402
from model.bench import _warm_decoder, bench_host  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="small")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    model = load(a.preset, device="cuda", dtype=torch.bfloat16)
    print(json.dumps(bench_host(model, a.ctx)), flush=True)
    step = _warm_decoder(model, a.ctx, 1, 512)
    sites: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename and "warnings" not in f.filename]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}({f.name})" for f in reversed(frames[-6:]))
        key = f"{str(message)[:60]} @ {where}"
        sites[key] = sites.get(key, 0) + 1

    shown = warnings.showwarning
    warnings.showwarning = record
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    for _ in range(3):
        step()
    torch.cuda.set_sync_debug_mode(0)
    warnings.showwarning = shown
    print(json.dumps({"syncs_in_3_steps": sites}, indent=1), flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.steps):
        step()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof).strip_dirs()
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
