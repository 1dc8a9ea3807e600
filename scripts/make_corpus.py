"""Write the synthetic training corpus of issue 11 as versioned JSONL shards.

    python3 scripts/make_corpus.py --out DIR --n N --seed S [--kinds a,b,c,d,e]

Record i has kind `kinds[i % len(kinds)]` and is built by `dsagent.corpus.make_record` from
its own seeded RNG, so the output is byte-for-byte the same for the same arguments. The
default kinds are the default mixture's, a-e; the mixed conversations (f) are asked for by
name (`--kinds a,b,c,d,e,f`).
Writes `corpus-NNNNN.jsonl` shards (SHARD_RECORDS records each) and `manifest.json`
(version, seed, kinds, counts per kind, token statistics, shard names). Token counts
are of the rendered conversation with each image as one placeholder token.

Does not own the records themselves (dsagent/corpus.py) or training.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsagent.corpus import (CORPUS_VERSION, DEFAULT_KINDS, KINDS, THINKING_MODE,  # noqa: E402
                            add_record_share_arguments, encode_record, make_record, record_options, record_shares)
from model.tokenizer import Tokenizer  # noqa: E402

SHARD_RECORDS = 1000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="output directory (created)")
    p.add_argument("--n", type=int, required=True, help="number of conversations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", default=",".join(DEFAULT_KINDS),
                   help=f"comma-separated subset of {','.join(KINDS)} (default: the default mixture's)")
    add_record_share_arguments(p)
    args = p.parse_args(argv)
    args.kinds = args.kinds.split(",")
    for name, share in record_shares(args).items():
        if not 0.0 <= share <= 1.0:
            p.error(f"--{name.replace('_', '-')} takes a share in [0, 1]")
    unknown = [k for k in args.kinds if k not in KINDS]
    if unknown or not args.kinds or args.n < 1:
        p.error(f"--kinds takes a comma-separated subset of {','.join(KINDS)} and --n must be >= 1")
    return args


def token_stats(counts: list[int]) -> dict[str, int]:
    return {"records": len(counts), "min": min(counts), "max": max(counts),
            "mean": round(sum(counts) / len(counts)), "total": sum(counts)}


def write_corpus(out: Path, n: int, seed: int, kinds: list[str], shares: dict[str, float] | None = None) -> dict:
    """Write shards and the manifest; returns the manifest. ``shares``: names of
    ``corpus.RECORD_SHARES``, each a share in [0, 1] (absent: 0)."""
    shares = {name: share for name, share in (shares or {}).items() if share}
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.bundled()
    tokens: dict[str, list[int]] = {k: [] for k in kinds}
    trained: dict[str, int] = {k: 0 for k in kinds}
    shards = []
    for start in range(0, n, SHARD_RECORDS):
        shards.append(f"corpus-{len(shards):05d}.jsonl")
        with open(out / shards[-1], "w", encoding="utf-8") as f:
            for i in range(start, min(n, start + SHARD_RECORDS)):
                record = make_record(seed, i, kinds[i % len(kinds)], tokenizer, **record_options(seed, i, shares))
                conv, mask = encode_record(record, tokenizer)
                tokens[record["kind"]].append(len(conv.ids))
                trained[record["kind"]] += sum(mask)
                f.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n")
    manifest = {"version": CORPUS_VERSION, "seed": seed, "n": n, "kinds": kinds, "thinking_mode": THINKING_MODE,
                "counts": {KINDS[k]: len(tokens[k]) for k in kinds},
                "tokens": {KINDS[k]: {**token_stats(tokens[k]), "trained": trained[k]} for k in kinds if tokens[k]},
                "shards": shards, "command": f"python3 scripts/make_corpus.py --out DIR --n {n} --seed {seed} "
                                             f"--kinds {','.join(kinds)}"
                                             + "".join(f" --{name.replace('_', '-')} {share}"
                                                       for name, share in shares.items()), **shares}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return manifest


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    manifest = write_corpus(args.out, args.n, args.seed, args.kinds, record_shares(args))
    print(json.dumps({"out": str(args.out), "counts": manifest["counts"]}))


if __name__ == "__main__":
    main()
