"""The per-turn evaluation of mixed conversations (skill f of dsagent/evaluate.py).

A kind-f record of T turns gives T cases, each cut before its turn's first assistant step
and scored against that turn's own truth; results are counted by turn index (1, 2, 3+) in
every mode, in the JSON result and in `dsagent eval`'s table. Scripted test doubles stand
in for the model; one test runs the embedded default in resume mode on two cases, saved
and resumed between turns through a real Store.
"""
import io
from dataclasses import replace

import pytest
from rich.console import Console

from dsagent.commands.eval import result_table
from dsagent.corpus import make_record
from dsagent.evaluate import (MODES, SKILLS, TURN_BUCKETS, Case, Completion, EvalConfigError, ModelGenerator,
                              check_config, evaluate, in_turns, make_cases, prompt_inputs, score)
from dsagent.runtime import Runtime, Settings
from model.chat import EOS, encode_messages
from model.tokenizer import Tokenizer
from sessions import Store

N = 8  # records of the held-out seed


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.bundled()


@pytest.fixture(scope="module")
def records(tokenizer) -> list[dict]:
    return [make_record(7919, i, "f", tokenizer) for i in range(N)]


@pytest.fixture(scope="module")
def cases(tokenizer) -> list[Case]:
    return make_cases(tokenizer, n=N, skills=["f"])


# ---------------------------------------------------------------------------- cases
def test_a_record_gives_a_case_per_turn_cut_before_the_turns_first_step(records, cases):
    assert len(cases) == sum(len(r["truth"]["turns"]) for r in records)
    for r in records:
        mine = [c for c in cases if c.id.startswith(r["id"] + "-t")]
        users = [i for i, m in enumerate(r["messages"]) if m["role"] == "user"]
        assert [c.turn for c in mine] == list(range(1, len(users) + 1))
        for c, at, truth in zip(mine, users, r["truth"]["turns"]):
            assert c.id == f"{r['id']}-t{c.turn}" and c.skill == "f" and c.truth == truth
            assert c.prompt == r["messages"][: at + 1]  # the turns before, whole, and this turn's question
            stored = r["messages"][at + 1]
            if stored.get("stop", "eos") != "eos":  # a reply the record cut off: the case wants it whole
                assert c.target == {"role": "assistant", "content": truth["cut"]["reply"]}
                assert truth["cut"]["reply"].startswith(stored["content"]) and "stop" not in c.target
            else:
                assert c.target == stored and c.target["role"] == "assistant"
            viewed = truth["skill"] == "image" and isinstance(c.prompt[-1]["content"], str)  # not attached
            assert bool(c.target.get("tool_calls")) == (truth["skill"] in ("calc", "file", "back") or viewed), c.id
            assert score(c, c.expected) == 1, c.id
            assert score(c, "I do not know." + EOS) == 0, c.id


def test_f_is_asked_for_by_name_and_the_default_skills_stay(tokenizer):
    assert SKILLS == ("a", "b", "c", "d", "e", "r")
    assert {c.skill for c in make_cases(tokenizer, n=1)} == set(SKILLS)
    check_config(skills=["f", "a"])
    with pytest.raises(EvalConfigError, match="skill"):
        check_config(skills=["g"])


def test_turn_keys():
    assert [in_turns(t, "3+") for t in (None, 1, 2, 3, 8)] == [False, False, False, True, True]
    assert [in_turns(t, "2") for t in (None, 1, 2, 3)] == [False, False, True, False]


# ---------------------------------------------------------------------------- test doubles
class TurnScriptedGenerator:
    """TEST DOUBLE: a scripted generator that answers with the ground truth up to turn
    ``right[mode]`` of a per-turn case (and every other case), wrong after it."""

    def __init__(self, right: dict[str, int]):
        self.right = right

    def complete(self, case: Case, mode: str) -> Completion:
        good = case.turn is None or case.turn <= self.right[mode]
        return Completion(case.expected if good else "I do not know." + EOS)


class RepeatingScriptedGenerator:
    """TEST DOUBLE: a scripted generator that repeats the last assistant step of its prompt
    (issue 55's failure: a later turn answered with an earlier answer or call)."""

    def complete(self, case: Case, mode: str) -> Completion:
        steps = [i for i, m in enumerate(case.prompt) if m["role"] == "assistant"]
        if not steps:
            return Completion("I do not know." + EOS)
        last = steps[-1]
        return Completion(encode_messages([case.prompt[last]], context=case.prompt[:last],
                                          thinking_mode=case.thinking_mode).text)


def _by_hand(cases: list[Case], last_right: int, key: str) -> tuple[int, int]:
    mine = [c for c in cases if in_turns(c.turn, key)]
    return sum(c.turn <= last_right for c in mine), len(mine)


def test_results_are_counted_by_turn_index_in_every_mode(cases, tokenizer):
    others = make_cases(tokenizer, n=2, skills=["a"])  # no turn: in no turn's count
    right = {"exact": 1, "ced": 2, "float-kv": 3, "resume": 0, "prefix": 8}
    result = evaluate(TurnScriptedGenerator(right), others + cases)
    assert result.skills == ["a", "f"] and result.turn_skills() == ["f"]
    out = result.to_json()
    for mode, last in right.items():
        for key in TURN_BUCKETS:
            want = _by_hand(cases, last, key)
            assert result.turn_cell("f", mode, key) == want and want[1] > 0
            assert out["turns"]["f"][mode][key] == {"correct": want[0], "n": want[1], "accuracy": want[0] / want[1]}
        assert result.cell("f", mode) == _by_hand(cases, last, "1+") and result.cell("a", mode) == (2, 2)
        per_index = out["turn_index"]["f"][mode]
        assert set(per_index) == {str(t) for t in range(1, max(c.turn for c in cases) + 1)}
        assert sum(v["n"] for v in per_index.values()) == len(cases)
    assert set(out["turns"]) == {"f"} and list(out["turns"]["f"]) == list(MODES)
    assert "turns" not in evaluate(TurnScriptedGenerator(right), others).to_json()


def test_table_has_a_row_per_turn_index_under_a_per_turn_skill(cases):
    result = evaluate(TurnScriptedGenerator({m: 1 for m in MODES}), cases, ["exact", "resume"])
    buf = io.StringIO()
    Console(file=buf, width=200, no_color=True).print(result_table(result))
    rows = {line.split("│")[1].strip(): line for line in buf.getvalue().splitlines() if line.count("│") > 2}
    n1, n2, n3 = (_by_hand(cases, 8, key)[1] for key in TURN_BUCKETS)
    assert f"{n1}/{n1}" in rows["turn 1"] and f"0/{n2}" in rows["turn 2"] and f"0/{n3}" in rows["turn 3+"]
    assert f"{n1}/{len(cases)}" in rows["f mixed"]


class AsksScriptedGenerator:
    """TEST DOUBLE: a scripted generator wrong on the turns that ask ``wrong`` (what a turn
    asks: its truth's skill), right on every other case."""

    def __init__(self, wrong: set[str]):
        self.wrong = wrong

    def complete(self, case: Case, mode: str) -> Completion:
        return Completion("I do not know." + EOS if case.truth.get("skill") in self.wrong else case.expected)


def test_later_turns_are_also_counted_over_what_a_first_turn_asks(cases):
    """A later turn may refer back (``back``: a calculation on an earlier result; ``recall``: a
    fact told before), which no first turn asks; a model wrong on those alone loses points at
    turns 2 and 3+ against turn 1, and ``turns_first_asks`` / the table's "asking as turn 1
    does" rows, which count only what first turns ask, show no gap. ``turn_asks`` counts each
    kind of turn by turn index."""
    first = sorted({c.truth["skill"] for c in cases if c.turn == 1})
    later_only = {c.truth["skill"] for c in cases} - set(first)
    assert later_only and first  # the records of the held-out seed have both
    result = evaluate(AsksScriptedGenerator(later_only), cases, ["exact", "resume"])
    assert result.turn_asks("f", turn=1) == first
    out = result.to_json()
    for mode in ("exact", "resume"):
        n1 = result.turn_cell("f", mode, "1")[1]
        assert result.turn_cell("f", mode, "1") == (n1, n1)
        plain, same = result.turn_cell("f", mode, "3+"), result.turn_cell("f", mode, "3+", first)
        assert plain[0] < plain[1] and same == (same[1], same[1]) and same[1] < plain[1]
        assert out["turns_first_asks"]["f"][mode]["3+"] == {"correct": same[1], "n": same[1], "accuracy": 1.0}
        for asks, cells in out["turn_asks"]["f"][mode].items():
            mine = [c for c in cases if c.truth["skill"] == asks and c.turn >= 3]
            assert cells["3+"]["n"] == len(mine) and cells["3+"]["correct"] == (0 if asks in later_only else len(mine))
    buf = io.StringIO()
    Console(file=buf, width=200, no_color=True).print(result_table(result))
    row = next(line for line in buf.getvalue().splitlines() if "turn 3+, asking as turn 1 does" in line)
    assert row.count(f"{same[1]}/{same[1]}") == 2


class AfterCutScriptedGenerator:
    """TEST DOUBLE: a scripted generator right on every case but those right after a reply
    cut off, where it answers nothing."""

    def complete(self, case: Case, mode: str) -> Completion:
        return Completion("" if case.after_cut else case.expected)


def test_the_cases_after_a_cut_reply_are_counted_apart(records, cases):
    """A case follows a cut reply where its record's turn before was cut off (``cut`` in that
    turn's truth; its reply in the prompt is the words kept, with its stop); the result
    counts those cases apart in the JSON and the table."""
    after = [c for c in cases if c.after_cut]
    assert after and all(c.turn > 1 for c in after)
    for c in after:
        record = next(r for r in records if c.id.startswith(r["id"] + "-t"))
        before = record["truth"]["turns"][c.turn - 2]
        last = [m for m in c.prompt if m["role"] == "assistant"][-1]
        assert "cut" in before and last["stop"] == before["cut"]["stop"]
        assert len(last["content"].split()) == before["cut"]["words"]
    assert sum("cut" in t for r in records for t in r["truth"]["turns"]) == len(after)
    result = evaluate(AfterCutScriptedGenerator(), cases, ["exact", "resume"])
    for mode in ("exact", "resume"):
        assert result.after_cut_cell("f", mode) == (0, len(after))
        assert result.cell("f", mode) == (len(cases) - len(after), len(cases))
        assert result.to_json()["after_cut"]["f"][mode] == {"correct": 0, "n": len(after), "accuracy": 0.0}
    buf = io.StringIO()
    Console(file=buf, width=200, no_color=True).print(result_table(result))
    row = next(line for line in buf.getvalue().splitlines() if "after a cut reply" in line)
    assert row.count(f"0/{len(after)}") == 2


def test_repeating_an_earlier_answer_fails_the_later_turns(cases):
    """The split sees issue 55's failure: a model that repeats its last answer or call scores
    nothing on turn 1 and little after it."""
    result = evaluate(RepeatingScriptedGenerator(), cases, ["exact"])
    assert result.turn_cell("f", "exact", "1")[0] == 0
    for key in ("2", "3+"):
        correct, n = result.turn_cell("f", "exact", key)
        assert correct / n < 0.2, (key, correct, n)


# ---------------------------------------------------------------------------- the real model
@pytest.fixture(scope="module")
def runtime() -> Runtime:
    return Runtime.load(Settings())


def test_resume_saves_between_turns(runtime, cases, tmp_path):
    """Resume mode on the embedded default: the session is stored up to the end of the turn
    before (the system prompt alone before turn 1), resumed from disk, and the resumed
    Agent logs the turn's question and replies."""
    gen = ModelGenerator(runtime, max_new_tokens=2, store_home=tmp_path)
    for case in (cases[0], cases[1]):
        stats = gen.complete(case, "resume").stats
        before, _ = prompt_inputs(gen.rt, replace(case, prompt=case.prompt[:-1]))
        whole, _ = prompt_inputs(gen.rt, case)
        assert stats["resumed_tokens"] == before.shape[1] < stats["log_tokens"] == whole.shape[1]
        assert stats["cached_tokens"] > 0 and stats["completion_tokens"] <= 2  # stored KV, then the new turn
        with Store.open(tmp_path) as store:
            loaded = store.load(stats["session"], fingerprint=runtime.fingerprint, chunk_tokens=256)
        assert loaded.tokens[: whole.shape[1]] == whole[0].tolist()
        assert [m["role"] for m in loaded.messages] == [m["role"] for m in case.prompt] + ["assistant"]
