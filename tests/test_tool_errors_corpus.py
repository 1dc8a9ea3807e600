"""Records whose file question asks for what the workspace lacks (``corpus.missing_question``,
``make_record(..., tool_errors=True)``): the real tool's error, a reply that says the path is
not there; the trainer's ``--tool-errors`` share and the evaluation's ``--tool-errors`` cases."""
import pytest

from dsagent import corpus
from dsagent.evaluate import make_cases, score
from model.tokenizer import Tokenizer
from tests.corpus_shares import share_marks_its_records


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.bundled()


def _asked(record: dict) -> list[tuple[dict, dict, dict]]:
    """(the call, its tool message, the reply after) of every tool call of ``record``."""
    m = record["messages"]
    return [(c, m[i + 1], m[i + 2]) for i, msg in enumerate(m) for c in msg.get("tool_calls", ())]


@pytest.mark.parametrize("words", ["closed", "held-out"])
def test_a_tool_record_asks_for_what_the_workspace_lacks(tokenizer, words):
    kinds = set()
    for i in range(8):
        record = corpus.make_record(3, i, "b", tokenizer, words=words, tool_errors=True)
        missing, files = record["truth"]["missing"], record["truth"]["files"]
        assert missing not in {part for path in files for part in path.split("/")}
        [(call, result, reply)] = _asked(record)
        name, args = call["function"]["name"], call["function"]["arguments"]
        kinds.add(name)
        assert name in ("list_dir", "read_file") and missing in args
        assert result["content"].startswith("error:") and missing in result["content"]  # the tool's own words
        assert reply["content"] in (f"There is no {missing} folder in the workspace.",
                                    f"There is no file {missing} in the workspace.")
    assert kinds == {"list_dir", "read_file"}


def test_other_kinds_and_plain_records_are_as_before(tokenizer):
    for kind in "ace":
        for i in range(3):
            assert corpus.make_record(4, i, kind, tokenizer, tool_errors=True) == corpus.make_record(4, i, kind, tokenizer)
    drawn = [corpus.tool_errors_for(4, i, 0.3) for i in range(60)]
    assert 5 < sum(drawn) < 35 and not any(corpus.tool_errors_for(4, i, 0.0) for i in range(60))


def test_a_conversations_first_file_turn_asks_for_what_is_missing(tokenizer):
    seen = 0
    for i in range(30):
        plain = corpus.make_record(9, i, "f", tokenizer)
        record = corpus.make_record(9, i, "f", tokenizer, tool_errors=True)
        files = [t for t in plain["truth"]["turns"] if t["skill"] == "file"]
        if not files:
            assert record == plain
            continue
        turns = [t for t in record["truth"]["turns"] if t["skill"] == "file"]
        assert "missing" in turns[0] and all("missing" not in t for t in turns[1:])
        seen += 1
    assert seen >= 3


def test_the_trainer_the_corpus_writer_and_the_evaluation_take_tool_errors(tokenizer, tmp_path):
    share_marks_its_records(tmp_path, "--tool-errors", "b,a", lambda r: "missing" in r["truth"],
                            lambda i: corpus.tool_errors_for(4, i, 0.5) and i % 2 == 0)
    calls = make_cases(tokenizer, n=4, skills=["b"], tool_errors=True)
    assert all(c.truth["missing"] in c.expected for c in calls)
    replies = make_cases(tokenizer, n=4, skills=["r"], tool_errors=True)
    for case in replies:
        assert score(case, case.expected) == 1
        assert score(case, "The owner in notes.txt is Fors.") == 0  # an answer from elsewhere
