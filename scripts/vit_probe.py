"""Is shape and count in the image features at all? A linear probe of the vision tower.

    python3 scripts/vit_probe.py [MODEL ...]   (default: model/assets/default tiny)

For 1,200 corpus pictures (seed 5: 1-5 same-coloured shapes of one kind), the image's LLM
embeddings (ViT + aligner, the 3x3 cell tokens concatenated) are standardised and a
logistic regression is fitted on 900 to the shape kind (3 classes) and the count (5); the
held-out accuracy on the other 300 is printed per model, one JSON line each. Chance is
0.33 and 0.2; a preset name gives random weights, the baseline a trained tower should beat.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsagent.corpus import SHAPES, Shapes, draw_shapes  # noqa: E402
from model import load  # noqa: E402
from model.vision import decode_image, preprocess  # noqa: E402


def features(model, pictures: list[Shapes]) -> torch.Tensor:
    """[n, cells * D]: each picture's aligner rows, flattened."""
    out = []
    with torch.no_grad():
        for s in pictures:
            pixels, plan = preprocess(decode_image(s.png), model.args.vision)
            rows = model.aligner(model.vision(pixels, plan.n_h, plan.n_w), plan.n_h, plan.n_w)
            out.append(rows.flatten())
    return torch.stack(out)


def probe_accuracy(x: torch.Tensor, y: torch.Tensor, train: int, steps: int = 300) -> float:
    """Held-out accuracy of an L2-regularised logistic regression fitted on the first ``train`` rows."""
    x = (x - x[:train].mean(0)) / (x[:train].std(0) + 1e-6)
    w = torch.zeros(x.shape[1], int(y.max()) + 1, requires_grad=True)
    b = torch.zeros(w.shape[1], requires_grad=True)
    opt = torch.optim.Adam([w, b], lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(x[:train] @ w + b, y[:train]) + 1e-3 * w.square().sum()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return ((x[train:] @ w + b).argmax(1) == y[train:]).float().mean().item()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("models", nargs="*", default=["model/assets/default", "tiny"])
    p.add_argument("--n", type=int, default=1200)
    a = p.parse_args()
    torch.manual_seed(0)
    rng = random.Random(5)
    pictures = [draw_shapes(rng) for _ in range(a.n)]
    labels = {"kind": torch.tensor([SHAPES.index(s.kind) for s in pictures]),
              "count": torch.tensor([s.count - 1 for s in pictures])}
    for path in a.models:
        model = load(path, device="cpu", dtype=torch.float32, seed=0).eval()
        x = features(model, pictures)
        print(json.dumps({"model": path, **{k: round(probe_accuracy(x, y, a.n * 3 // 4), 3)
                                            for k, y in labels.items()}}), flush=True)


if __name__ == "__main__":
    main()
