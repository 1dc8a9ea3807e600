"""Train the small byte-level BPE bundled for the embedded default model.

Owns: a seeded generator of chat-like training text (arithmetic, numbers, file names,
shell commands, shapes and colours, short prose, JSON and DSML tool calls) and the
training run that writes `model/assets/tokenizer/tokenizer.json`. Does not own the
runtime tokenizer (`model/tokenizer.py`) or the chat format (`model/chat.py`).

The corpus is generated, never read from the working tree, so the shipped file depends
only on this script, its seed and the `tokenizers` version. Reproduce it with:

    python3 scripts/train_tokenizer.py --out model/assets/tokenizer/tokenizer.json

and check it with `--check` (retrains in memory and compares with the shipped file).

Special tokens get fixed ids, in this order: BOS 0, EOS 1, pad 2, then `<｜User｜>`,
`<｜Assistant｜>`, `<｜System｜>`, `<think>`, `</think>`, `<｜deepseek_image｜>` (an added
token that is *not* special, as in V4.1), `<｜latest_reminder｜>` and the task tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SEED = 41
VOCAB_SIZE = 4096  # the BPE trainer's target; the generated text fills ~950 of it
PADDED_SIZE = 1024  # the shipped file's size: placeholders fill the rest (as V3 / V4 pad theirs)
N_DOCUMENTS = 24_000
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "model" / "assets" / "tokenizer" / "tokenizer.json"

SPECIAL_TOKENS = [
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>",
    "<｜User｜>", "<｜Assistant｜>", "<｜System｜>", "<think>", "</think>",
    "<｜deepseek_image｜>", "<｜latest_reminder｜>",
    "<｜action｜>", "<｜query｜>", "<｜authority｜>", "<｜domain｜>", "<｜title｜>", "<｜read_url｜>",
]
NOT_SPECIAL = {"<｜deepseek_image｜>"}

COLOURS = ["red", "green", "blue", "yellow", "orange", "purple", "black", "white", "grey", "pink"]
SHAPES = ["square", "circle", "triangle", "rectangle", "hexagon", "star", "line", "dot"]
WORDS = ("the a an is are was of to in on for with and or not this that it file line "
         "number value result error output input run test check read write list open "
         "close find show count add sum total size path name text data image model turn "
         "tool call user assistant system answer question please thanks sure here there "
         "first next last each every because then when where which what how why can will "
         "should must may now done ok yes no more less than between inside outside").split()
EXTS = ["py", "md", "txt", "json", "toml", "sh", "rs", "c", "png", "csv", "log", "yaml"]
DIRS = ["src", "tests", "docs", "model", "tools", "scripts", "data", "tmp", "home/user", "work"]
COMMANDS = ["ls -la", "cat", "grep -n", "python3", "git status", "git diff", "pytest -q",
            "wc -l", "head -n 20", "mkdir -p", "rm", "cp", "mv", "echo", "find . -name"]
TOOLS = ["read_file", "list_dir", "write_file", "run_shell", "calculator", "view_image"]


def _file(rng: random.Random) -> str:
    stem = "_".join(rng.sample(WORDS, rng.randint(1, 2)))
    return f"{rng.choice(DIRS)}/{stem}.{rng.choice(EXTS)}"


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(4, 14))]
    return " ".join(words).capitalize() + rng.choice([".", ".", "?", "!", ":"])


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 9999), rng.randint(1, 999)
    op = rng.choice(["+", "-", "*", "/"])
    value = {"+": a + b, "-": a - b, "*": a * b, "/": round(a / b, 4)}[op]
    return f"What is {a} {op} {b}? {a} {op} {b} = {value}."


def _shapes(rng: random.Random) -> str:
    n = rng.randint(1, 12)
    return f"There are {n} {rng.choice(COLOURS)} {rng.choice(SHAPES)}s at ({rng.randint(0, 640)}, {rng.randint(0, 480)})."


def _shell(rng: random.Random) -> str:
    return f"$ {rng.choice(COMMANDS)} {_file(rng)}\n{rng.randint(0, 500)} lines, exit code {rng.choice([0, 0, 1, 2])}"


def _code(rng: random.Random) -> str:
    name, arg = rng.choice(WORDS), rng.choice(WORDS)
    return (f"def {name}_{arg}({arg}: int) -> int:\n    \"\"\"{_sentence(rng)}\"\"\"\n"
            f"    return {arg} * {rng.randint(2, 64)} + {rng.randint(0, 9)}\n")


def _tool_call(rng: random.Random) -> str:
    tool, path = rng.choice(TOOLS), _file(rng)
    args = json.dumps({"path": path, "limit": rng.randint(1, 100)})
    return (f"\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"{tool}\">\n"
            f"<｜DSML｜ parameter name=\"path\" string=\"true\">{path}</｜DSML｜ parameter>\n"
            f"</｜DSML｜ invoke>\n</｜DSML｜ calls>\n<tool_result>{args}</tool_result>")


GENERATORS = [_sentence, _arithmetic, _shapes, _shell, _code, _tool_call]


def corpus(seed: int = SEED, n: int = N_DOCUMENTS) -> Iterator[str]:
    """Deterministic training documents; none contains a special-token string."""
    rng = random.Random(seed)
    for _ in range(n):
        parts = [rng.choice(GENERATORS)(rng) for _ in range(rng.randint(1, 4))]
        yield rng.choice([" ", "\n", "\n\n"]).join(parts)


def train(seed: int = SEED, digits: str = "individual") -> str:
    """Train and return the tokenizer JSON text. ``digits``: "individual" (the shipped file:
    every digit its own pre-token, so numbers are spelled with 10 tokens, as a small model
    copies them; padded to `PADDED_SIZE` ids with special placeholders
    `<｜place▁holder▁no▁N｜>`) or "merged" (the tokenizer of the first embedded defaults: a run
    of digits is one pre-token, so BPE learns whole numbers — 3,153 of its 4,096 tokens are
    digit strings, nearly every 4-digit number one rare token — unpadded)."""
    if digits not in ("merged", "individual"):
        raise ValueError(f"digits={digits!r}: want 'merged' or 'individual'")
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (byte_level if digits == "merged" else
                         pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]))
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    if digits == "individual":
        size = tok.get_vocab_size(with_added_tokens=True)
        if size > PADDED_SIZE:
            raise RuntimeError(f"BPE filled {size} ids, more than the padded size {PADDED_SIZE}")
        tok.add_special_tokens([f"<｜place▁holder▁no▁{i}｜>" for i in range(PADDED_SIZE - size)])
    spec = json.loads(tok.to_str())
    for added in spec["added_tokens"]:
        added["special"] = added["content"] not in NOT_SPECIAL
    return json.dumps(spec, ensure_ascii=False, separators=(",", ":")) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--check", action="store_true", help="compare with --out, write nothing")
    parser.add_argument("--digits", choices=("merged", "individual"), default="individual",
                        help="one token per digit (the shipped file) or numbers as BPE merges them")
    args = parser.parse_args(argv)
    text = train(digits=args.digits)
    if args.check:
        same = args.out.is_file() and args.out.read_text(encoding="utf-8") == text
        sys.stderr.write("tokenizer is up to date\n" if same else f"{args.out} differs from a fresh training run\n")
        return 0 if same else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    sys.stderr.write(f"wrote {args.out} ({len(text.encode())} bytes)\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
