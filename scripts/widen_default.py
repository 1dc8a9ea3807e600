"""A checkpoint made wider (``hidden_size`` times a whole factor) that computes what it did.

    python3 scripts/widen_default.py --init model/assets/default --out WIDE [--factor 2] [--noise 0]

writes WIDE as an official checkpoint with a TRAINING.json saying what it was widened from, for
``train_default.py --init WIDE``.

Every residual channel c of the D-wide model becomes the channels c, c + D, ... of the wider
one (within each D-wide block of a dimension that stacks several: the mHC streams' ``hc x D``,
DSpark's ``main_proj`` reading three taps, Engram's key and value; the leading D of DSpark's
confidence head): a tensor's dimension that
writes the residual width (a Linear's output rows, the token embedding's columns, a norm's or
a bias's channels, the image markers) holds the copies; one that reads it (a Linear's input
columns: the attention's, compressor's and indexer's projections, the router, the experts'
``w1`` / ``w3``, the mHC mixes, the head) holds the copies divided by the factor, so each dot
sums to what it did. RMSNorm over copies is the same RMS. Engram's gate divides its dot by
``sqrt(D)``, so its ``q_weight`` is divided by ``sqrt(factor)``. The dimensions that change are
found by building the wider model (on the meta device) and comparing shapes, so a width that
equals the residual's by chance (the experts' 128, the indexer's head width, ``o_groups x
o_lora_rank``) is left alone.

The FP8 and FP4 blocks take the division in their ue8m0 scales (a power of two), so the wider
checkpoint holds the same codes. Copies get the same gradients: ``--noise`` adds that much
relative noise to the copies so that training can part them (0 keeps the function exactly).

Why: issue 53's miss (a word the corpus never uses, copied) did not move with the data; the
checkpoint limit of 40 MB leaves room for a wider network, and this one starts from what the
default knows (docs/default-model-training.md).
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.checkpoint import write_checkpoint  # noqa: E402
from model.loading import load  # noqa: E402
from model.model import Transformer  # noqa: E402
from model.training import BUNDLED_TOKENIZER, plain_state_dict  # noqa: E402

EMBEDDINGS = ("embed.weight",)  # [rows, D]: the width is their output
GATE_QUERY = "engram.q_weight"  # Engram's gate divides its dot by sqrt(D): this weight takes 1 / sqrt(factor)
GATE_WEIGHTS = (GATE_QUERY, "engram.k_weight")  # [hc, D]: Engram's gate's weights, channel by channel
LEADING = ("confidence_head.proj.weight",)  # [1, D + markov rank]: reads the residual, then the Markov embedding


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--init", required=True, help="the checkpoint to widen")
    p.add_argument("--out", type=Path, required=True, help="output directory (new or empty)")
    p.add_argument("--factor", type=int, default=2, help="the new hidden_size over the old (a whole number >= 2)")
    p.add_argument("--noise", type=float, default=0.0,
                   help="relative noise on the copies (std over each tensor's RMS): 0 keeps the function exactly")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.factor < 2:
        p.error("--factor must be a whole number >= 2")
    return a


def widened(name: str, old: torch.Tensor, shape: torch.Size, D: int, factor: int) -> torch.Tensor:
    """``old`` at the wider ``shape``: each dimension that grew by ``factor`` copied within its
    D-wide blocks, divided by ``factor`` where it reads the residual width (see the module)."""
    t = old.float()
    if name.endswith(LEADING) and t.shape != shape:
        rest = t.shape[-1] - D
        return torch.cat([widened(name + "[:D]", t[..., :D], (*shape[:-1], shape[-1] - rest), D, factor),
                          t[..., D:]], dim=-1)
    for dim, (was, now) in enumerate(zip(old.shape, shape)):
        if was == now:
            continue
        if now != was * factor or was % D:
            raise ValueError(f"{name}: dimension {dim} goes {was} -> {now}, not a multiple of {D} times {factor}")
        blocks = t.unflatten(dim, (was // D, D))
        t = torch.cat([blocks] * factor, dim=dim + 1).flatten(dim, dim + 1)
        reads = dim == t.dim() - 1 and t.dim() == 2 and not name.endswith(EMBEDDINGS + GATE_WEIGHTS)
        if reads:
            t = t / factor
    if name.endswith(GATE_QUERY) and t.shape != old.shape:
        t = t / factor ** 0.5
    return t


def widen(model: Transformer, factor: int, noise: float = 0.0, seed: int = 0) -> tuple[object, dict]:
    """(the wider args, its state dict under official names) of ``model``."""
    args = model.args
    wide = args.replace(hidden_size=args.hidden_size * factor)
    with torch.device("meta"):
        shapes = {k: t.shape for k, t in plain_state_dict(Transformer(wide)).items()}
    old = plain_state_dict(model)
    if set(shapes) != set(old):
        raise ValueError(f"the wider model's tensors differ: {sorted(set(shapes) ^ set(old))[:6]}")
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, t in old.items():
        w = widened(name, t, shapes[name], args.hidden_size, factor)
        if noise and w.shape != t.shape and w.is_floating_point():
            w = w + noise * w.pow(2).mean().sqrt() * torch.randn(w.shape, generator=g)
        state[name] = w.to(t.dtype)
    return wide, state


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    model = load(a.init, device="cpu")
    wide, state = widen(model, a.factor, a.noise, a.seed)
    tokenizer_json = getattr(model, "tokenizer_json", None) or BUNDLED_TOKENIZER
    write_checkpoint(a.out, wide.to_config(), state, tokenizer_json=tokenizer_json)
    info = {"command": "python3 scripts/widen_default.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:])),
            "widened_from": str(a.init), "hidden_size": [model.args.hidden_size, wide.hidden_size],
            "noise": a.noise, "seed": a.seed}
    (a.out / "TRAINING.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"{a.init}: hidden_size {model.args.hidden_size} -> {wide.hidden_size}, "
          f"{sum(t.numel() for t in plain_state_dict(model).values()) / 1e6:.2f}M -> "
          f"{sum(t.numel() for t in state.values()) / 1e6:.2f}M parameters, written to {a.out}")


if __name__ == "__main__":
    main()
