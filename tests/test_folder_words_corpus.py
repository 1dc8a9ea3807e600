"""Records whose workspace folder is named by a word of their lexicon, not ``data``
(``make_record(..., folder_words=True)``): the tool question lists that folder by its name, so
the call must copy the name from the question; the trainer's and the corpus writer's
``--folder-words`` share and the evaluation's ``--folder-words`` cases."""
import json

import pytest

from dsagent import corpus
from dsagent.evaluate import make_cases, score
from model.args import ModelArgs
from model.tokenizer import Tokenizer
from tests.corpus_shares import share_marks_its_records


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.bundled()


@pytest.mark.parametrize("words", ["closed", "held-out"])
def test_a_tool_record_lists_the_folder_by_its_new_name(tokenizer, words):
    folders = set()
    for i in range(6):
        record = corpus.make_record(5, i, "b", tokenizer, words=words, folder_words=True)
        folder, files = record["truth"]["folder"], record["truth"]["files"]
        assert folder not in corpus.WORKSPACE_WORDS and corpus.lexicon(words).drew(folder)
        names = sorted(p.split("/", 1)[1] for p in files if "/" in p and not p.startswith("logs/"))
        assert names and all(f"{folder}/{n}" in files for n in names)
        assert folder not in {n.split(".")[0] for n in names}  # no file of it says its name for it
        question, call, result, reply = record["messages"][1:5]
        assert folder in question["content"]
        [c] = call["tool_calls"]
        assert (c["function"]["name"], json.loads(c["function"]["arguments"])) == ("list_dir", {"path": folder})
        assert all(n in result["content"] for n in names)
        s = "" if len(names) == 1 else "s"
        assert reply["content"] == f"The {folder} folder has {len(names)} file{s}: {', '.join(names)}."
        folders.add(folder)
    assert len(folders) >= 4  # drawn a record, not one name


def test_the_calls_folder_name_is_a_copy_the_trainer_can_weight(tokenizer):
    record = corpus.make_record(5, 0, "b", tokenizer, words="held-out", folder_words=True)
    ex = corpus.copy_example(record, tokenizer, ModelArgs.preset("tiny"))
    copied = tokenizer.decode([int(t) for t, on in zip(ex.ids, ex.trained) if on])
    assert record["truth"]["folder"] in copied


def test_other_kinds_and_plain_records_are_as_before(tokenizer):
    for kind in "acd":
        for i in range(2):
            assert (corpus.make_record(4, i, kind, tokenizer, folder_words=True)
                    == corpus.make_record(4, i, kind, tokenizer))
    for i in range(4):
        assert corpus.make_record(4, i, "b", tokenizer, folder_words=False) == corpus.make_record(4, i, "b", tokenizer)
    drawn = [corpus.folder_words_for(4, i, 0.3) for i in range(60)]
    assert 5 < sum(drawn) < 35 and not any(corpus.folder_words_for(4, i, 0.0) for i in range(60))
    assert drawn != [corpus.tool_errors_for(4, i, 0.3) for i in range(60)]  # a draw of its own


def test_a_conversations_first_file_turn_lists_the_folder(tokenizer):
    seen = 0
    for i in range(30):
        record = corpus.make_record(9, i, "f", tokenizer, folder_words=True)
        turns = [t for t in record["truth"]["turns"] if t["skill"] == "file"]
        if not turns:
            continue
        folder = record["truth"]["folder"]
        calls = [c for m in record["messages"] for c in m.get("tool_calls", ()) if c["function"]["name"] == "list_dir"]
        assert json.loads(calls[0]["function"]["arguments"]) == {"path": folder}
        assert not any(p.startswith("data/") for p in record["truth"]["files"])
        seen += 1
    assert seen >= 3


def test_the_trainer_the_corpus_writer_and_the_evaluation_take_folder_words(tokenizer, tmp_path):
    share_marks_its_records(tmp_path, "--folder-words", "b,a", lambda r: "folder" in r["truth"],
                            lambda i: corpus.folder_words_for(4, i, 0.5) and i % 2 == 0)
    calls = make_cases(tokenizer, n=4, skills=["b"], folder_words=True)
    assert all(f'"path": "{c.truth["folder"]}"' in c.target["tool_calls"][0]["function"]["arguments"]
               for c in calls)
    assert all(score(c, c.expected) == 1 for c in calls)
    assert not any(score(c, c.expected.replace(c.truth["folder"], "data")) for c in calls)  # the old folder fails
    for call, case in zip(calls, make_cases(tokenizer, n=4, skills=["r"], folder_words=True)):  # the same records
        folder = call.truth["folder"]
        assert case.truth["read"][-1] == folder
        assert score(case, case.expected) == 1
        assert score(case, case.expected.replace(folder, "data")) == 0  # the reply of another folder
