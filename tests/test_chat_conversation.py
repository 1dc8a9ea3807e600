"""A conversation through the real `dsagent chat` in a pseudo-terminal (pexpect), on the
embedded default: one session of five scored questions of mixed skills — a calculation, the
files of a folder whose names training never used, a picture, a name told and asked back
turns later, a second calculation — each scored on its reply alone (the tool calls and
results the chat shows are left out).

Issue 55 asks that such a chat answer at least four of the five, and the test asserts it.
The defaults before fell short (README, *The embedded default*): on 2026-12-05 it answered the
first question and then carried tool calls and numbers from it into every later turn (1 of 5);
the default of run 12 (2026-12-06) answers both calculations (2 of 5), runs 13 and 15 the
picture too (3 of 5), but each names the folder's files and the told name from its training
lists; runs 20 and 21 give the told name back and one or two of the three files, and misread
the picture (3 of 5). Run 22's (2026-12-07) answers four: the calculations, the picture and the
name; of the files it still names one right. Skipped when pexpect is missing.
"""
import os
import random
import re
import sys
from pathlib import Path

import pytest

from dsagent import corpus

pexpect = pytest.importorskip("pexpect")

ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
NOT_REPLY = ("→ ", "ok ", "error ", "denied ", "tool call not understood:", "warning:")  # the chat's own lines
STATUS = re.compile(r"^(prefilling|generating|calling \S+)( ·|$)")  # the progress line, erased before the reply


def _reply(screen: str, message: str) -> str:
    """The reply text of one turn's screen: what follows the echoed message, less the progress
    line (rewritten in place, then erased), the tool calls (``→ name(...)``), their results and
    the chat's notes (a call it could not parse). The terminal is wide enough that none wraps."""
    kept = []
    for line in ANSI.sub("", screen).replace("\r\n", "\n").split("\n"):
        line = line.split("\r")[-1].strip()  # a line rewritten in place: its last form
        if line and line != message and not STATUS.match(line) and not line.startswith(NOT_REPLY):
            kept.append(line)
    return " ".join(kept)


def _world(workspace: Path, seed: int):
    """A data folder of three files and a picture, named with words of the open vocabulary's
    held-out half (never in training), and a held-out name."""
    rng, lex = random.Random(seed), corpus.lexicon("held-out")
    files = [f"{w}.{ext}" for w, ext in zip(lex.words(rng, 3), ("csv", "txt", "py"))]
    (workspace / "data").mkdir(parents=True)
    for name in files:
        (workspace / "data" / name).write_text("a line\n")
    shapes = corpus.draw_shapes(rng)
    picture = workspace / f"{lex.word(rng)}.png"
    picture.write_bytes(shapes.png)
    return files, picture, shapes, lex.person(rng)


def test_a_chat_of_five_mixed_questions(tmp_path):
    workspace = tmp_path / "work"
    files, picture, shapes, name = _world(workspace, seed=55)
    count = corpus.NUMBER_WORDS[shapes.count]
    turns = [  # (message, what the reply must hold, lower-cased; None: not scored)
        ("What is 37 * 23?", ["851"]),
        ("What files are in the data folder?", [f.lower() for f in files]),
        (f"/image {picture}", None),
        ("Describe this image.", [count, shapes.colour, shapes.kind]),
        (f"My name is {name}.", None),
        ("What is 15 + 27?", ["42"]),
        ("What is my name?", [name.lower()]),
    ]
    env = {**os.environ, "DSAGENT_HOME": str(tmp_path / "home"), "NO_COLOR": "1", "TERM": "xterm", "COLUMNS": "400"}
    child = pexpect.spawn(sys.executable, ["-m", "dsagent", "chat", "--yes", "--session", "mixed",
                                           "--workspace", str(workspace)],
                          env=env, cwd=ROOT, encoding="utf-8", timeout=300, dimensions=(40, 400))
    replies, right = [], []
    try:
        child.expect("› ")
        for message, wanted in turns:
            child.sendline(message)
            child.expect("› ")
            if wanted is not None:
                reply = _reply(child.before, message)
                replies.append(reply)
                right.append(all(w in reply.lower() for w in wanted))
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert len(replies) == 5 and all(replies), replies  # every turn answered
    assert right[0], replies  # the first question, the default's strength: the reply is read
    assert sum(right) >= 4, (sum(right), replies)


def test_a_turns_reply_is_read_without_the_chats_own_lines():
    """``_reply`` on a screen as the chat writes it: the echoed message, the progress line
    rewritten and erased, a tool call and its result, a note, then the reply."""
    screen = ("What files are in the data folder?\r\n\x1b[?25l\x1b[2mgenerating · 0 s\x1b[0m\r\x1b[2K\x1b[2m"
              "calling list_dir · 0 s\x1b[0m\r\n\x1b[?25h\r\x1b[1A\x1b[2K\x1b[1m→ list_dir\x1b[0m"
              '({"path": "data"})\r\n  ok a.csv b.txt\r\n\x1b[31mtool call not understood:\x1b[0m x\r\n'
              "The data folder holds\r\na.csv and b.txt.\r\n")
    assert _reply(screen, "What files are in the data folder?") == "The data folder holds a.csv and b.txt."
