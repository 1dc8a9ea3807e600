"""A focused experiment for the image skill: does a model learn shapes and counts from pictures alone?

    python3 scripts/image_drill.py [--init model/assets/default] [--steps 300] [--batch 32] [--lr 1e-3]
                                   [--records 3000] [--device cpu] [--tower-lr 1]
                                   [--form-only | --form-share F] [--tower-only] [--prompted] [--save DIR]

Trains on the corpus's image conversations only (corpus seed 31: since run 5 of the shipped
default a training seed), without the system prompt unless ``--prompted``, through the same
code path as scripts/train_default.py (QAT weights and KV, exact replay), and prints one
JSON line per 25 steps: the next-token accuracy of the replies on the training batches and
on 64 held-out conversations (seed 7919). The replies name colour, shape and count ("3.
There are three red circles."); a model that knows colour alone sits near 0.85-0.88, so a
rise above that is the ViT learning form.

``--form-only`` trains and scores the kind and count words alone (chance: a third of the
kinds, a fifth of the counts) — with ``--tower-only`` the colour then drifts, nothing asking
for it (2026-12-01, a99ee58: 286 such steps named every picture green); ``--form-share F`` narrows a
share F of the conversations so and keeps the whole reply in the rest. ``--tower-only``
trains the vision tower alone (text is answered as before). ``--prompted`` keeps the system
prompt in every conversation (training and held-out), as the agent and ``dsagent eval``
have it: one forward of the shared prompt a batch, then the rows. ``--save DIR`` writes the
result as an official checkpoint.
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsagent.corpus import CORPUS_VERSION, bare_record, form_example, make_record, training_example  # noqa: E402
from model import load  # noqa: E402
from model.tokenizer import Tokenizer  # noqa: E402
from model.training import (Example, add_weight_qat, batch_for, batch_loss, param_groups,  # noqa: E402
                            quantised_weights, write_trained)

DRILL_SEED, HELD_OUT_SEED = 31, 7919
TOWER = ("vision.", "aligner.", "image_")  # the ViT, its aligner and the image span markers


def image_examples(seed: int, n: int, tokenizer: Tokenizer, args, form_share: float = 0.0,
                   prompted: bool = False) -> list[Example]:
    """``n`` image conversations of corpus ``seed``, without the system prompt unless
    ``prompted``; a ``form_share`` of them (drawn per conversation) trained on the words naming
    the shapes' kind and count alone, the rest on the whole reply."""
    keep = (lambda record: record) if prompted else bare_record
    return [(form_example if random.Random(f"form:{seed}:{i}").random() < form_share else training_example)(
        keep(make_record(seed, i, "c", tokenizer)), tokenizer, args) for i in range(n)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--init", default="model/assets/default", help="a checkpoint directory, or a preset")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--records", type=int, default=3000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tower-lr", type=float, default=1.0, help="learning-rate multiplier of the ViT and its aligner")
    p.add_argument("--form-share", type=float, default=0.0,
                   help="the share of conversations trained (and scored) on the kind and count words alone; the "
                        "rest keep the whole reply, so the colour the tower knows is still asked of it")
    p.add_argument("--form-only", dest="form_share", action="store_const", const=1.0,
                   help="--form-share 1: every conversation trained (and scored) on the kind and count words alone")
    p.add_argument("--tower-only", action="store_true",
                   help="train the ViT, its aligner and the image span markers alone: the language model "
                        "stays as it is, so text without images is answered exactly as before")
    p.add_argument("--prompted", action="store_true",
                   help="keep the system prompt in every conversation, as the agent and the evaluation have it")
    p.add_argument("--minutes", type=float, default=0.0,
                   help="stop after this many minutes of training (at least one step) and save what was trained")
    p.add_argument("--save", type=Path, help="write the trained model here (official checkpoint + TRAINING.json)")
    a = p.parse_args(argv)
    if not 0.0 <= a.form_share <= 1.0:
        p.error(f"--form-share {a.form_share}: want a share between 0 and 1")
    torch.manual_seed(0)
    model = load(a.init, device=a.device, dtype=torch.float32, seed=0)
    add_weight_qat(model)
    model.train()
    args, tokenizer = model.args, Tokenizer.of(model)
    train = image_examples(DRILL_SEED, a.records, tokenizer, args, a.form_share, a.prompted)
    held = image_examples(HELD_OUT_SEED, 64, tokenizer, args, a.form_share, a.prompted)

    def loss(rows, rng):
        batch = batch_for(args, rows, ["exact"] * len(rows), rng)
        with quantised_weights(model):
            return batch_loss(model, batch, share_prefix=a.prompted)

    def held_acc() -> float:
        model.eval()
        with torch.no_grad():
            losses = loss(held, random.Random(0))
        model.train()
        return round(losses.correct / losses.tokens, 4)

    if a.tower_only:
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith(TOWER))
    groups = param_groups(model, a.tower_lr)
    for g in groups:
        g["lr"] = a.lr * g["scale"]
    opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95))
    rng, began, window = random.Random(1), time.time(), [0, 0]
    print(json.dumps({"step": 0, "held_acc": held_acc()}), flush=True)
    steps_run = 0
    for step in range(1, a.steps + 1):
        if a.minutes and step > 1 and time.time() - began >= a.minutes * 60:
            print(f"stopping at step {step - 1} of {a.steps} after {time.time() - began:.0f} s (--minutes)", flush=True)
            break
        opt.zero_grad(set_to_none=True)
        losses = loss([train[rng.randrange(len(train))] for _ in range(a.batch)], rng)
        losses.total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps_run = step
        window = [window[0] + losses.correct, window[1] + losses.tokens]
        if step % 25 == 0:
            print(json.dumps({"step": step, "seconds": round(time.time() - began),
                              "train_acc": round(window[0] / window[1], 4), "held_acc": held_acc()}), flush=True)
            window = [0, 0]
    if a.save:
        save(a, model, seconds=time.time() - began, steps=steps_run)


def save(a, model, seconds: float, steps: int) -> None:
    """The model as an official checkpoint in ``a.save`` with a TRAINING.json saying how it
    was made (the run's entry for the shipped model's ``runs``)."""
    write_trained(model, a.save)
    info = {"command": "python3 scripts/image_drill.py " + " ".join(shlex.quote(x) for x in sys.argv[1:]),
            "init": str(a.init), "corpus_seed": DRILL_SEED, "corpus_version": CORPUS_VERSION, "records": a.records,
            "steps": steps, "rows": steps * a.batch, "lr": a.lr, "tower_lr": a.tower_lr,
            "tower_only": a.tower_only, "form_share": a.form_share, "prompted": a.prompted, "seconds": round(seconds, 1),
            "device": torch.cuda.get_device_name() if str(a.device).startswith("cuda") else str(a.device),
            "torch": torch.__version__}
    (a.save / "TRAINING.json").write_text(json.dumps(info, indent=1) + "\n")


if __name__ == "__main__":
    main()
