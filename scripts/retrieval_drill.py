"""A focused experiment for the recall skill: can a model learn to look a planted value up?

    python3 scripts/retrieval_drill.py [--init model/assets/default] [--steps 300] [--tokens 150,300]
                                       [--lr 1e-3] [--batch 8] [--device cpu] [--dense] [--chat]
                                       [--minutes M] [--tokenizer FILE] [--eval N]

Trains on short synthetic logs only — filler lines, a `password of cobalt: ABC-1234` line in
the first third, two decoys of the same kind later, then the question and the answer; no
system prompt, no chat template — with the loss on the answer value alone, through the
same code path as scripts/train_default.py (QAT weights and KV, exact replay). Prints one
JSON line per 10 steps with the answer-token accuracy: the '-' and '.' of a value are
~0.3 of its tokens, so a rise above that is retrieval being learnt. Writes nothing.
``--eval N`` ends with N held-out drills scored by the value's letter tokens, digit tokens
and whole values; ``--tokenizer`` writes the logs with another tokenizer (the model's ids
are the same 4096, its Engram map the bundled one's), to compare how numbers are split.

``--chat`` trains on the corpus's own recall conversations instead (bare: without the system
prompt; logs of --tokens; the loss on the whole reply, as scripts/train_default.py has it):
the accuracy is then over the reply's tokens, whose '-' and copied key words make ~0.8
(``--value-only``: the value's tokens alone are trained, as without --chat).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsagent.corpus import (KEY_KINDS, WORDS, bare_record, filler_line, make_record, secret,  # noqa: E402
                            training_example, value_example)
from model import load  # noqa: E402
from model.loading import BUNDLED_TOKENIZER  # noqa: E402
from model.tokenizer import Tokenizer  # noqa: E402
from model.training import Example, add_weight_qat, batch_for, batch_loss, quantised_weights  # noqa: E402
from recall_probe import split_accuracy  # noqa: E402  (a script beside this one)

DRILL_SEED = 37  # the corpus seed of --chat conversations (no training run uses it)


def drill(rng: random.Random, tokenizer: Tokenizer, lo: int, hi: int) -> Example:
    kind, owner, value = rng.choice(KEY_KINDS), rng.choice(WORDS), secret(rng)
    lines, n, target = [], 0, rng.randint(lo, hi)
    while n < target:
        lines.append(filler_line(rng))
        n += len(tokenizer.encode_content(lines[-1] + "\n"))
    lines.insert(rng.randrange(0, max(1, len(lines) // 3)), f"{kind} of {owner}: {value}")
    for other in rng.sample([w for w in WORDS if w != owner], 2):
        lines.insert(rng.randrange(len(lines) // 3, len(lines)), f"{kind} of {other}: {secret(rng)}")
    prompt = tokenizer.encode_content("\n".join(lines) + f"\nWhat is the {kind} of {owner}?\nThe {kind} of {owner} is ")
    answer = tokenizer.encode_content(f"{value}.")
    return Example(prompt + answer, [False] * len(prompt) + [True] * len(answer))


def chat_drill(rng: random.Random, tokenizer: Tokenizer, lo: int, hi: int, args, value_only: bool = False) -> Example:
    """A recall conversation of the corpus (its log of LO..HI tokens) without the system
    prompt, its whole reply trained or (``value_only``) the value's tokens alone."""
    record = make_record(DRILL_SEED, rng.randrange(10 ** 9), "d", tokenizer, (lo, hi))
    return (value_example if value_only else training_example)(bare_record(record), tokenizer, args)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--init", default="tiny", help="a checkpoint directory, or a preset for random weights")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--minutes", type=float, default=0.0, help="stop training after this long (0: --steps alone)")
    p.add_argument("--tokens", default="150,300", help="LO,HI: length of a log in tokens")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dense", action="store_true", help="every record visible (the indexer's warm-up)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--chat", action="store_true",
                   help="the corpus's recall conversations, bare, the whole reply trained")
    p.add_argument("--value-only", action="store_true", help="with --chat: the reply's value tokens alone trained")
    p.add_argument("--tokenizer", type=Path, default=BUNDLED_TOKENIZER,
                   help="a tokenizer.json to write the logs with (say, scripts/train_tokenizer.py --digits individual)")
    p.add_argument("--eval", type=int, default=0, metavar="N",
                   help="at the end, N held-out drills: accuracy of the value's letters, its digits, and whole values")
    a = p.parse_args()
    if a.value_only and not a.chat:
        p.error("--value-only goes with --chat (without it only the value is trained anyway)")
    lo, hi = map(int, a.tokens.split(","))
    torch.manual_seed(a.seed)
    model = load(a.init, device=a.device, dtype=torch.float32, seed=a.seed)
    add_weight_qat(model)
    model.train()
    args, tokenizer = model.args, Tokenizer.from_file(a.tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95))
    rng, began, window = random.Random(a.seed), time.time(), [0, 0, 0.0, 0]
    for step in range(1, a.steps + 1):
        if a.minutes and time.time() - began >= a.minutes * 60:
            break
        rows = [chat_drill(rng, tokenizer, lo, hi, args, a.value_only) if a.chat else drill(rng, tokenizer, lo, hi)
                for _ in range(a.batch)]
        batch = batch_for(args, rows, ["exact"] * a.batch, rng)
        opt.zero_grad(set_to_none=True)
        with quantised_weights(model):
            losses = batch_loss(model, batch, dense=a.dense, share_prefix=False)
            losses.total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        window = [window[0] + losses.correct, window[1] + losses.tokens, window[2] + float(losses.lm.detach()),
                  window[3] + 1]
        if step % 10 == 0:
            print(json.dumps({"step": step, "seconds": round(time.time() - began), "lm": round(window[2] / window[3], 3),
                              "answer_token_acc": round(window[0] / window[1], 3)}), flush=True)
            window = [0, 0, 0.0, 0]
    if a.eval:
        print(json.dumps({"held_out": a.eval, **held_out(model, tokenizer, lo, hi, a.eval)}), flush=True)


def held_out(model, tokenizer: Tokenizer, lo: int, hi: int, n: int) -> dict[str, float]:
    """Teacher-forced accuracy on ``n`` drills of another seed: the value's letter tokens, its
    digit tokens, and values whose every token is predicted right."""
    rng = random.Random(10 ** 6 + 7)
    return split_accuracy(model, tokenizer, [drill(rng, tokenizer, lo, hi) for _ in range(n)])


if __name__ == "__main__":
    main()
