"""A decode step's map by layer, from ``gpu_bench.py --timeline`` (the chained profile's kernels
in order): each layer's span from one MoE down sum's end to the next, and the kernels of the
layers asked for with their advance (``model.bench.layer_map``).

    python3 scripts/layer_map.py TIMELINE.jsonl [--layers 40] [--show 0,1,20] [--profile 0]

Prints JSON: ``layer_us``, the spans from the file's first down sum on, ``--layers`` a line —
a profile starts at a step's start, so each line runs from layer 1 to the next step's layer 0,
which holds that step's start (and, profiled, the host's gap) — and ``kernels`` {i: [[name,
advance µs], ...]} for ``--show``'s spans i of the first line (i = layer - 1).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.bench import layer_map  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("timeline")
    p.add_argument("--layers", type=int, default=40, help="layers a step (the preset's)")
    p.add_argument("--show", default="", help="spans of the first line whose kernels to list (layer - 1)")
    p.add_argument("--profile", type=int, default=0, help="which line of the file (one a profile)")
    p.add_argument("--boundary", default="",
                   help="the kernel that ends a layer (default: the MoE's last, _down_slots_kernel, or "
                        "_sum_slots_kernel where the step has no down-slots kernel: FP4 experts by pair)")
    a = p.parse_args()
    with open(a.timeline) as f:
        line = f.readlines()[a.profile]
    spans = [tuple(s) for s in json.loads(line)["spans"]]
    out = layer_map(spans, boundary=a.boundary or None, layers=a.layers)
    shown = {int(i): [[n[:60], us] for n, us in out["kernels"][int(i)]] for i in filter(None, a.show.split(","))}
    print("{\n \"layer_us\": [\n  " + ",\n  ".join(json.dumps(step) for step in out["layer_us"]) + "],\n"
          + " \"kernels\": " + json.dumps(shown, indent=1) + "\n}")


if __name__ == "__main__":
    main()
