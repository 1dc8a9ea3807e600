"""Where corpus records' names come from (dsagent/lexicon.py): the closed lists, or the open
vocabulary's two halves, which never meet; records drawn with each, and the evaluation's
held-out words."""
import json
import random
import re

import pytest

from dsagent import corpus
from dsagent.evaluate import EvalConfigError, check_config, make_cases
from dsagent.lexicon import SPLITS, Lexicon, split_of
from model.tokenizer import Tokenizer
from tests.corpus_shares import share_marks_its_records


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.bundled()


def test_the_closed_lexicon_draws_what_the_lists_draw():
    """So the records written before open lexicons existed are unchanged (their digests are
    held in test_corpus)."""
    closed = corpus.lexicon("closed")
    a, b = random.Random(5), random.Random(5)
    got = [closed.word(a), closed.person(a), closed.words(a, 3), closed.words(a, 2, but=("maple",))]
    want = [b.choice(corpus.WORDS), b.choice(corpus.NAMES), b.sample(corpus.WORDS, 3),
            b.sample([w for w in corpus.WORDS if w != "maple"], 2)]
    assert got == want and a.getstate() == b.getstate()


def test_the_open_halves_are_disjoint_large_and_hold_no_closed_word():
    rng = random.Random(0)
    halves = {s: {corpus.lexicon(name).word(rng) for _ in range(3000)} for s, name in zip(SPLITS, ("open", "held-out"))}
    closed = {w.lower() for w in (*corpus.WORDS, *corpus.NAMES)}
    for split, words in halves.items():
        assert len(words) > 2900 and all(split_of(w) == split for w in words)  # few repeats: a large vocabulary
        assert not words & closed and all(re.fullmatch(r"[a-z]{4,9}", w) for w in words)
    assert not halves["train"] & halves["held-out"]
    person = corpus.lexicon("held-out").person(rng)
    assert person[0].isupper() and split_of(person.lower()) == "held-out"
    picked = corpus.lexicon("open").words(rng, 4, but=("zuzu",))
    assert len(set(picked)) == 4 and "zuzu" not in picked
    with pytest.raises(ValueError, match="lexicon"):
        corpus.lexicon("huge")
    with pytest.raises(AssertionError):
        Lexicon("x", [], [], split="test")


def _names(record: dict) -> set[str]:
    """The lower-case words of a record's user messages, its tool calls and results."""
    text = json.dumps([m for m in record["messages"][1:] if m["role"] != "assistant" or m.get("tool_calls")])
    return {w.lower() for w in re.findall(r"[A-Za-z]+", text)}


def test_a_lexicon_knows_the_words_it_draws():
    """``drew``: what a half generates is its own and not the other's nor the closed lists';
    the closed lexicon's are its words and names in any case."""
    rng = random.Random(6)
    opened, held, closed = (corpus.lexicon(n) for n in ("open", "held-out", "closed"))
    for w in [opened.word(rng) for _ in range(300)] + [opened.person(rng) for _ in range(50)]:
        assert opened.drew(w) and not held.drew(w) and not closed.drew(w), w
    for w in [held.word(rng) for _ in range(300)]:
        assert held.drew(w) and not opened.drew(w), w
    assert closed.drew("falcon") and closed.drew("MIRA") and not opened.drew("falcon") and not held.drew("Mira")
    assert not opened.drew("strength") and not opened.drew("ba")  # not of the syllables' shape


def test_records_of_held_out_words_name_nothing_of_the_lists(tokenizer):
    """Every kind drawn with the held-out half: its truth says so, its files, owners, pets,
    people and keys are open words of that half, and none of the closed lists' appear; the
    same record with the closed lexicon is the corpus's own."""
    fixed = {w for place in corpus.PLACES for w in place.split()}  # "the harbor": a filler line's place, not a name
    closed_words = {w.lower() for w in (*corpus.WORDS, *corpus.NAMES)} - fixed
    for kind in "abdef":  # c: attached pictures, no names
        fresh = set()
        for i in range(8):
            own = corpus.make_record(11, i, kind, tokenizer, (200, 400))
            held = corpus.make_record(11, i, kind, tokenizer, (200, 400), words="held-out")
            assert held["truth"]["words"] == "held-out" and "words" not in own["truth"]
            assert not _names(held) & closed_words, (kind, i, _names(held) & closed_words)
            fresh |= {w for w in _names(held) - _names(own) if split_of(w) == "held-out"}
        assert fresh, kind  # a calculator question or a chat fact names nothing; the rest do
    files = corpus.make_record(11, 0, "b", tokenizer, words="held-out")["truth"].get("files", {})
    for path in files:
        stem = path.rsplit("/", 1)[-1].split(".")[0]
        assert stem in ("notes", "todo", "run") or split_of(stem) == "held-out", path


def test_a_corpus_draws_open_words_for_its_share_of_records():
    shares = {share: [corpus.words_for(3, i, share) for i in range(400)] for share in (0.0, 0.25, 1.0)}
    assert set(shares[0.0]) == {"closed"} and set(shares[1.0]) == {"open"}
    assert 60 < shares[0.25].count("open") < 140
    assert shares[0.25] == [corpus.words_for(3, i, 0.25) for i in range(400)]  # reproducible


def test_the_evaluation_takes_held_out_words_and_refuses_the_training_half(tokenizer):
    cases = make_cases(tokenizer, n=2, skills=["b", "e"], words="held-out")
    assert all(c.truth["words"] == "held-out" for c in cases)
    for words in ("open", "new"):
        with pytest.raises(EvalConfigError, match="words"):
            check_config(words=words)
    check_config(words="closed")


def test_make_corpus_and_the_trainer_draw_their_share_of_open_words(tmp_path):
    """--open-words SHARE: make_corpus writes that share of its records with the open
    vocabulary's training half (named in each record's truth and in the manifest), and the
    trainer lays out the same records as the corpus would."""
    share_marks_its_records(tmp_path, "--open-words", "b,e", lambda r: r["truth"].get("words", "closed"),
                            lambda i: corpus.words_for(4, i, 0.5))


def test_the_halves_ask_in_their_own_words():
    """``phrase``: the closed lexicon draws the corpus's own phrasings as ``rng.choice`` does
    (one phrasing: no draw at all); the training half those and its own more; the held-out
    half only phrasings training never draws."""
    own, more = ["own a", "own b"], {"train": ["train c"], "held-out": ["held d", "held e"]}
    a, b = random.Random(2), random.Random(2)
    assert corpus.lexicon("closed").phrase(a, own, more) == b.choice(own) and a.getstate() == b.getstate()
    assert corpus.lexicon("closed").phrase(a, ["only"], more) == "only" and a.getstate() == b.getstate()
    rng = random.Random(3)
    assert {corpus.lexicon("open").phrase(rng, own, more) for _ in range(200)} == {"own a", "own b", "train c"}
    assert {corpus.lexicon("held-out").phrase(rng, own, more) for _ in range(200)} == {"held d", "held e"}


def test_held_out_questions_say_operators_in_words_the_calculator_call_keeps_symbols(tokenizer):
    """A calculator question of one operator between two numbers says it in words (the
    training half: its symbol or words; the held-out half: words only, the same ones, in
    sentences of its own); the call carries the expression written, whose value the reply gives."""
    said = {"open": set(), "held-out": set()}
    for words in said:
        for i in range(60):
            r = corpus.make_record(21, i, "b", tokenizer, words=words)
            calls = r["messages"][2].get("tool_calls") or []
            if len(calls) != 1 or calls[0]["function"]["name"] != "calculator":
                continue
            expr = json.loads(calls[0]["function"]["arguments"])["expression"]
            m = re.fullmatch(r"(\d+) ([-+*/]) (\d+)", expr)
            if m:
                a, _, c = m.groups()
                said[words].add(re.search(rf"{a} (.+?) {c}\b", r["messages"][1]["content"]).group(1))
            assert r["messages"][-1]["content"] == f"{expr} = {r['truth']['arithmetic'][0]['value']}."
    words = {w for spoken in corpus.SPOKEN_OPS.values() for w in spoken}
    assert said["open"] <= words | set("+-*/") and said["held-out"] <= words
    assert len(said["held-out"]) >= 2 and said["open"] - set("+-*/"), said


def test_open_records_ask_for_the_number_after_one_of_any_length(tokenizer):
    """The chat question "What number comes after n?": the closed lexicon draws n below 99 as
    the corpus always has; an open half draws one to five digits, each length alike, so the
    answer is learnt as adding one rather than as a table of the first hundred."""
    def numbers(words: str) -> list[int]:
        got = []
        for i in range(1500):
            r = corpus.make_record(5, i, "a", tokenizer, words=words)
            m = re.fullmatch(r"What number comes after (\d+)\?", r["messages"][1]["content"])
            if m:
                assert r["truth"]["answer"] == f"{int(m.group(1)) + 1}."
                got.append(int(m.group(1)))
        return got
    closed, opened = numbers("closed"), numbers("open")
    assert closed and max(closed) < 99
    assert {len(str(n)) for n in opened} == {1, 2, 3, 4, 5}


# ---------------------------------------------------------------------------- typed casually
@pytest.mark.parametrize("text, forms", [
    ("What is 37 * 23?", {"what is 37 * 23?", "What is 37 * 23", "What is 37*23?", "what is 37 * 23",
                          "what is 37*23?", "What is 37*23", "what is 37*23"}),
    ("Compute (12 + 5) * 3.", {"compute (12 + 5) * 3.", "Compute (12 + 5) * 3", "Compute (12+5)*3.",
                               "compute (12 + 5) * 3", "compute (12+5)*3.", "Compute (12+5)*3", "compute (12+5)*3"}),
    ("My name is Kenji.", {"my name is Kenji.", "My name is Kenji", "my name is Kenji"}),
    ("NEA-9022 is what?", {"NEA-9022 is what"}),  # an id's capitals are kept
])
def test_casual_text_makes_every_slip_and_nothing_else(text, forms):
    made = {corpus.casual_text(random.Random(k), text) for k in range(200)}
    assert made == forms  # each slip alone and together, never the text itself


@pytest.mark.parametrize("text", [
    "Repeat after me: Kenji 37 * 23.", "Copy this: a + b?",  # what an echo request asks to be copied
    "Read these lines:\nWhat is 37 * 23?", "What is " + "1 + " * 60 + "1?",  # several lines, too long
    "OK", "ok",  # nothing to slip
])
def test_casual_text_leaves_what_must_stay(text):
    assert all(corpus.casual_text(random.Random(k), text) == text for k in range(50))


def _texts(message) -> list[str]:
    content = message["content"]
    return [content] if isinstance(content, str) else [b["text"] for b in content if b.get("type") == "text"]


def _bare(text: str) -> str:
    return text.lower().replace(" ", "").rstrip("?.")


@pytest.mark.parametrize("kind", ["a", "b", "c", "e", "f"])
def test_a_casual_record_changes_its_questions_alone(tokenizer, kind):
    changed = 0
    for i in range(4):
        plain = corpus.make_record(21, i, kind, tokenizer)
        typed = corpus.make_record(21, i, kind, tokenizer, casual=True)
        assert typed["truth"].pop("casual") is True and typed["truth"] == plain["truth"]
        assert len(typed["messages"]) == len(plain["messages"])
        for p, t in zip(plain["messages"], typed["messages"]):
            if p["role"] != "user":
                assert t == p
                continue
            for was, now in zip(_texts(p), _texts(t), strict=True):
                assert _bare(now) == _bare(was)
                changed += now != was
    assert changed > 0
    drawn = [corpus.casual_for(4, i, 0.5) for i in range(40)]
    assert 5 < sum(drawn) < 35 and not any(corpus.casual_for(4, i, 0.0) for i in range(40))


def test_the_trainer_the_corpus_writer_and_the_evaluation_take_casual_questions(tokenizer, tmp_path):
    cases, before = (make_cases(tokenizer, n=3, skills=["b"], casual=c) for c in (True, False))
    assert [c.expected for c in cases] == [c.expected for c in before]
    assert [c.prompt for c in cases] != [c.prompt for c in before]
    share_marks_its_records(tmp_path, "--casual", "b,e", lambda r: bool(r["truth"].get("casual")),
                            lambda i: corpus.casual_for(4, i, 0.5), refused=1.5)
