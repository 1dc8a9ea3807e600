"""Where a corpus record's names come from: a closed list, or an open vocabulary in two halves.

The shipped default learnt its 16 words and 10 names by heart (issue 53: asked about a folder
of `hazel.csv, rowan.txt, summit.py` it listed `harbor.csv, maple.csv, quartz.csv`; told
"My name is Elena" it answered "Mira"). A record drawn with an open lexicon names its files,
owners, projects, pets, people and recall keys with generated pronounceable words — two or
three syllables of a consonant, a vowel and maybe a closing consonant (350 syllables: some 43
million words) — far more than a model can memorise, so that answering needs copying from the
context.

The open words fall in two halves that never meet: a word belongs to ``train`` or to
``held-out`` by one bit of its hash, and neither holds a word of the closed lists. Training
records draw from ``train``; the evaluation's generalisation split from ``held-out``.

The open halves also ask in their own words (``phrase``): the training half in the corpus's
phrasings and more, the held-out half in sentences that training never draws — made of
words training does use (an operator said as "multiplied by" is taught in both halves: a
meaning no record shows is not one a model can learn from the corpus).

Owns: ``Lexicon`` (``word``, ``person``, ``words``, ``phrase``, ``drew``) and ``split_of``. The closed lexicon
draws exactly what ``rng.choice`` / ``rng.sample`` of its lists draw, so the records written
before open lexicons existed stay byte for byte what they were. Does not own: the lists
themselves and which lexicon a record draws from (``dsagent.corpus``: ``lexicon``), nor
what a record says with the words.
"""
from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterable, Sequence

ONSETS = "bdfgklmnprstvz"
VOWELS = "aeiou"
CODAS = ("", "", "", "n", "r", "l", "s")  # most syllables open
SPLITS = ("train", "held-out")
LEXICONS = ("closed", "open", "held-out")  # open: the train half; held-out: the other
_GENERATED = re.compile(f"(?:[{ONSETS}][{VOWELS}][{''.join(filter(None, CODAS))}]?){{2,3}}")  # what word() makes


def split_of(word: str) -> str:
    """The half of the open vocabulary a word belongs to (one bit of its hash)."""
    return SPLITS[hashlib.blake2b(word.encode(), digest_size=1).digest()[0] & 1]


class Lexicon:
    """A record's source of words: ``closed`` (``words`` and ``names`` as given) or an open
    half (``split``: "train" or "held-out"), which never draws a closed word."""

    def __init__(self, name: str, words: Sequence[str], names: Sequence[str], split: str | None = None):
        assert split in (None, *SPLITS)
        self.name, self.closed_words, self.closed_names, self.split = name, list(words), list(names), split
        self._taken = {w.lower() for w in (*words, *names)}

    def word(self, rng: random.Random) -> str:
        """A lower-case word: a file's stem, an owner, a project, a pet."""
        if self.split is None:
            return rng.choice(self.closed_words)
        while True:
            w = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)
                        for _ in range(rng.randint(2, 3)))
            if w not in self._taken and split_of(w) == self.split:
                return w

    def drew(self, word: str) -> bool:
        """Whether ``word`` (any case) is one this lexicon draws: a word or name of the closed
        lists, or a generated word of this open half."""
        w = word.lower()
        if self.split is None:
            return w in self._taken
        return w not in self._taken and _GENERATED.fullmatch(w) is not None and split_of(w) == self.split

    def person(self, rng: random.Random) -> str:
        """A given name, capitalised."""
        return rng.choice(self.closed_names) if self.split is None else self.word(rng).capitalize()

    def phrase(self, rng: random.Random, own: Sequence[str], more: dict[str, Sequence[str]]) -> str:
        """A way of asking: the closed lexicon one of the corpus's ``own`` (what ``rng.choice``
        of them draws); the training half one of ``own`` and ``more["train"]``; the held-out
        half one of ``more["held-out"]`` alone, which training never draws."""
        if self.split is None:
            return own[0] if len(own) == 1 else rng.choice(own)  # one phrasing: no draw, as the corpus had none
        return rng.choice([*own, *more["train"]] if self.split == "train" else more["held-out"])

    def words(self, rng: random.Random, k: int, but: Iterable[str] = ()) -> list[str]:
        """``k`` distinct words, none of ``but``."""
        but = set(but)
        if self.split is None:
            return rng.sample([w for w in self.closed_words if w not in but], k)
        out: list[str] = []
        while len(out) < k:
            w = self.word(rng)
            if w not in but and w not in out:
                out.append(w)
        return out
