"""Does a checkpoint look planted values up? Teacher-forced accuracy on the value's tokens.

    python3 scripts/recall_probe.py MODEL [MODEL ...] [--bare] [--n 16] [--ranges 40,90:150,300:400,800]

For each range of log lengths, ``--n`` held-out recall records (corpus seed 7919, records
200 on; ``--bare``: without the system prompt, as the trainer's ``--recall-first`` phase
sees them) run through the training forward pass in exact mode, and the share of the
value's tokens (``4417-2192``) predicted right is printed, one JSON line per model. The
value's '-' alone is ~0.1 of its tokens (~0.2 of version 2's `UBE-2192`), so a lookup shows
as a rise well above that, long before whole answers come out right (what ``dsagent eval
--recall-tokens`` scores).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsagent.corpus import (RecallStyle, add_recall_style_arguments, bare_record, make_record,  # noqa: E402
                            value_example)
from model import load  # noqa: E402
from model.tokenizer import Tokenizer  # noqa: E402
from model.training import batch_for, batch_loss, quantised_weights  # noqa: E402

HELD_OUT_SEED = 7919


def recall_records(tokenizer: Tokenizer, lo: int, hi: int, n: int, seed: int = HELD_OUT_SEED,
                   indices: tuple[int, int] = (200, 1), style: RecallStyle = RecallStyle()) -> list[dict]:
    """``n`` recall records of corpus ``seed`` at indices START, START+STEP, ... with logs of
    LO-HI tokens. A record's key and value do not depend on its log's length, so a training
    run's own records (seed and indices of its recall pool) test what it learnt by heart; they
    are written in ``style``, as the trainer's were."""
    start, step = indices
    return [make_record(seed, start + step * i, "d", tokenizer, (lo, hi), style) for i in range(n)]


def probe(model, tokenizer: Tokenizer, ranges: list[tuple[int, int]], n: int, bare: bool,
          dense: bool = False, seed: int = HELD_OUT_SEED, indices: tuple[int, int] = (200, 1),
          style: RecallStyle = RecallStyle()) -> dict[str, float]:
    a, out = model.args, {}
    for lo, hi in ranges:
        records = recall_records(tokenizer, lo, hi, n, seed, indices, style)
        rows = [value_example(bare_record(r) if bare else r, tokenizer, a) for r in records]
        batch = batch_for(a, rows, ["exact"] * n, random.Random(0))
        with torch.no_grad():
            losses = batch_loss(model, batch, share_prefix=False, dense=dense)
        out[f"{lo}-{hi}"] = round(losses.correct / losses.tokens, 3)
    return out


def split_accuracy(model, tokenizer: Tokenizer, rows: list) -> dict[str, float | list[float]]:
    """Teacher-forced accuracy of the trained tokens of ``rows`` (examples whose trained tokens
    are a value, ``4417-2192.``), by kind: letter tokens, digit tokens, and whole values (every
    trained token right); and by position in the value (``positions``: the first token
    needs the key, the rest can follow the value's own first tokens). Runs the serving
    forward pass one row at a time."""
    hits = {"letters": [0, 0], "digits": [0, 0], "values": [0, 0]}
    at: dict[int, list[int]] = {}  # position in the value -> [right, seen]
    training = model.training
    model.eval()
    with torch.no_grad(), quantised_weights(model):
        for ex in rows:
            predicted = model(torch.tensor(ex.ids, device=model.device)[None])[0].argmax(-1)
            trained = [t for t in range(1, len(ex.ids)) if ex.trained[t]]
            right = [bool(predicted[t - 1] == ex.ids[t]) for t in trained]
            for k, (t, ok) in enumerate(zip(trained, right)):
                seen = at.setdefault(k, [0, 0])
                seen[0], seen[1] = seen[0] + ok, seen[1] + 1
                text = tokenizer.token_text(ex.ids[t]).strip()
                kind = "digits" if text.isdigit() else "letters" if text.isalpha() else None
                if kind:
                    hits[kind][0] += ok
                    hits[kind][1] += 1
            hits["values"][0] += all(right)
            hits["values"][1] += 1
    model.train(training)
    return ({k: round(c / max(1, m), 3) for k, (c, m) in hits.items()}
            | {"positions": [round(at[k][0] / at[k][1], 3) for k in sorted(at)]})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("models", nargs="+", help="checkpoint directories (or a preset for random weights)")
    p.add_argument("--bare", action="store_true", help="records without the system prompt")
    p.add_argument("--n", type=int, default=16, help="records per range")
    p.add_argument("--ranges", default="40,90:150,300:400,800", help="LO,HI log lengths in tokens, ':'-separated")
    p.add_argument("--dense", action="store_true",
                   help="every compressed record selected, not the indexer's top-k: what selection costs")
    p.add_argument("--split", action="store_true",
                   help="instead: accuracy of the value's letter tokens, digit tokens and whole values")
    p.add_argument("--seed", type=int, default=HELD_OUT_SEED,
                   help="the corpus seed of the records (a training seed tests memory)")
    p.add_argument("--indices", default="200,1", metavar="START,STEP",
                   help="the records' indices (a run's recall pool: 7,10 — SCHEDULE's recall slot)")
    add_recall_style_arguments(p)  # as the trainer wrote its records
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    style = RecallStyle.of(a)
    if a.split and a.dense:
        p.error("--split scores the served forward pass (the indexer's top-k); --dense goes without it")
    ranges = [tuple(int(x) for x in r.split(",")) for r in a.ranges.split(":")]
    indices = tuple(int(x) for x in a.indices.split(","))
    for path in a.models:
        model = load(path, device=a.device, dtype=torch.float32)
        model.eval()
        tokenizer = Tokenizer.of(model)
        if a.split:
            for lo, hi in ranges:
                rows = [value_example(bare_record(r) if a.bare else r, tokenizer, model.args)
                        for r in recall_records(tokenizer, lo, hi, a.n, a.seed, indices, style)]
                print(json.dumps({"model": path, "bare": a.bare, "range": f"{lo}-{hi}", "seed": a.seed,
                                  "indices": a.indices, **style.differences(),
                                  **split_accuracy(model, tokenizer, rows)}), flush=True)
            continue
        print(json.dumps({"model": path, "bare": a.bare, "dense": a.dense, **style.differences(),
                          **probe(model, tokenizer, ranges, a.n, a.bare, a.dense, a.seed, indices, style)}),
              flush=True)


if __name__ == "__main__":
    main()
