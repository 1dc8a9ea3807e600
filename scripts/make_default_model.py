"""Write the embedded default model: the `tiny` preset, seeded random weights, official format.

Owns: producing `model/assets/default/` (config.json, FP8/FP4 safetensors shards, index,
tokenizer/tokenizer.json) so that `dsagent chat` and `dsagent run` work on a fresh machine
with no download. Until a trained small checkpoint exists, the weights are `load("tiny",
seed=0)`; the writer is deterministic, so rerunning the script gives the same bytes.
Does not own the checkpoint format (`model.checkpoint`), the loader (`model.loading`) or
the writer itself (`dsagent.commands.model_init`, also behind `dsagent model init`).

    python3 scripts/make_default_model.py            # writes model/assets/default
    python3 scripts/make_default_model.py --out DIR  # anywhere else (DIR must be new or empty)
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from dsagent.commands.model_init import write_random_checkpoint

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "model" / "assets" / "default"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    a = p.parse_args()
    if a.force and a.out.exists():
        shutil.rmtree(a.out)
    info = write_random_checkpoint(a.out, "tiny", a.seed)
    print(f"wrote {a.out}: {info['tensors']} tensors, {info['bytes'] / 2**20:.1f} MiB in {info['shards']} shard(s)")


if __name__ == "__main__":
    main()
