"""What one decode step launches, op by op, on the CPU: every Triton kernel (run by Triton's
interpreter) and every torch operator that would launch a kernel on a GPU, counted by name
and by the line of the model that issued it — the list to fuse from (issue 10: a `small`
step is ~32 kernels a layer at a few µs each).

    TRITON_INTERPRET=1 PYTHONPATH=<triton>:. python3 scripts/step_census.py [--preset tiny]
        [--ctx 300] [--batch 1] [--dtype bf16] [--top 40]

Prints one JSON object: kernels (Triton launches and torch operators) per step, by name,
and the model lines that issue the torch operators. Operators that only make a view or an
empty tensor launch nothing and are left out. Counts, not times: the CPU cannot time GPU
kernels; ``dsagent bench decode --profile`` does that on a GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import traceback
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_compile_check import record  # noqa: E402  (a script beside this one)
from model import load  # noqa: E402
from model.bench import _warm_decoder  # noqa: E402

ROOT = str(Path(__file__).resolve().parents[1])
# operators that only make a view, an alias or an uninitialised tensor: no kernel on a GPU
NO_KERNEL = {"view", "_unsafe_view", "alias", "detach", "empty", "empty_like", "empty_strided", "new_empty",
             "new_empty_strided", "as_strided", "expand", "unsqueeze", "squeeze", "select", "slice", "t",
             "transpose", "permute", "reshape", "unflatten", "flatten", "split", "split_with_sizes", "chunk",
             "unbind", "narrow", "view_as_real", "view_as_complex", "lift_fresh", "_reshape_alias", "set_",
             "resize_", "diagonal", "unfold", "movedim", "is_same_size"}


def model_line() -> str:
    """The innermost line of this repository's model code on the stack (not the script's)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename.startswith(ROOT) and "/scripts/" not in frame.filename:
            return f"{os.path.relpath(frame.filename, ROOT)}:{frame.lineno}({frame.name})"
    return "?"


class Census(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops, self.lines = Counter(), Counter()
        self.paused = 0

    @contextlib.contextmanager
    def pause(self):
        """Around a kernel launch: the interpreter's own torch calls are not the step's."""
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if not self.paused and name not in NO_KERNEL:
            self.ops[name] += 1
            self.lines[f"{name} @ {model_line()}"] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="tiny")
    p.add_argument("--ctx", type=int, default=300)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--top", type=int, default=40)
    a = p.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        p.error("set TRITON_INTERPRET=1: the kernels run in Triton's interpreter on the CPU")
    from model.kernels import moe

    # the MoE's down sum in its early form, the one form of it the interpreter runs (its looped
    # form's range over a runtime width is not: tests/interpreted.py); one launch either way,
    # where the looped form's failure would count the MoE's torch twin (~40 operators a layer)
    moe.DOWN_EARLY = True
    model = load(a.preset, device="cpu", dtype=torch.bfloat16 if a.dtype == "bf16" else torch.float32, seed=0)
    step = _warm_decoder(model, a.ctx, a.batch, 512)
    census, launches = Census(), []
    unwrap = record(launches, around=census.pause)
    try:
        with census:
            step()
    finally:
        unwrap()
    kernels = Counter(launch["name"] for launch in launches)
    layers = model.args.num_hidden_layers
    print(json.dumps({"preset": a.preset, "ctx": a.ctx, "batch": a.batch, "dtype": a.dtype, "layers": layers,
                      "kernels_per_step": sum(kernels.values()) + sum(census.ops.values()),
                      "triton_per_step": sum(kernels.values()), "torch_per_step": sum(census.ops.values()),
                      "triton": dict(kernels.most_common()), "torch": dict(census.ops.most_common()),
                      "torch_by_line": dict(census.lines.most_common(a.top))}, indent=1))


if __name__ == "__main__":
    main()
