"""Tests of the synthetic corpus generator (scripts/make_corpus.py, dsagent/corpus.py).

Checks reproducibility, that every kind is written, that every assistant turn renders
to a completion `parse_completion` reads back, that tool results are what the real
tools return, that arithmetic, image and recall answers match the stored ground truth,
and that a record's ids are append-only across turns.
"""

from __future__ import annotations

import base64
import json
import math
import re
import subprocess
import sys
from collections import deque
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import dsagent.corpus as corpus_gen  # noqa: E402
import make_corpus  # noqa: E402
from model.chat import encode_messages  # noqa: E402
from model.dsml import parse_completion  # noqa: E402
from model.tokenizer import Tokenizer  # noqa: E402
from model.vision import decode_image, image_sha256  # noqa: E402
from tools import ToolRunner, Workspace, builtin_toolbox  # noqa: E402

N, SEED = 30, 7


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.bundled()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corpus")
    make_corpus.main(["--out", str(out), "--n", str(N), "--seed", str(SEED)])
    return out


@pytest.fixture(scope="module")
def records(corpus) -> list[dict]:
    return [json.loads(line) for line in (corpus / "corpus-00000.jsonl").read_text().splitlines()]


def _of(records, *kinds):
    return [r for r in records if r["kind"] in kinds]


def _text(content) -> str:
    if isinstance(content, list):
        return "\n\n".join(b.get("text", "") for b in content if b.get("type") == "text")
    return content or ""


# -- the files -------------------------------------------------------------------------

def test_same_seed_same_bytes_other_seed_differs(corpus, tmp_path):
    make_corpus.main(["--out", str(tmp_path / "again"), "--n", str(N), "--seed", str(SEED)])
    make_corpus.main(["--out", str(tmp_path / "other"), "--n", str(N), "--seed", str(SEED + 1)])
    for name in ("manifest.json", "corpus-00000.jsonl"):
        assert (corpus / name).read_bytes() == (tmp_path / "again" / name).read_bytes()
    assert (corpus / "corpus-00000.jsonl").read_bytes() != (tmp_path / "other" / "corpus-00000.jsonl").read_bytes()


def test_manifest_and_every_kind_present(corpus, records):
    manifest = json.loads((corpus / "manifest.json").read_text())
    assert manifest["version"] == corpus_gen.CORPUS_VERSION and manifest["seed"] == SEED
    assert manifest["counts"] == {corpus_gen.KINDS[k]: N // 5 for k in corpus_gen.DEFAULT_KINDS}
    assert {r["kind"] for r in records} == set(corpus_gen.DEFAULT_KINDS) == set("abcde")  # f by name only
    assert all(s["min"] > 0 and s["trained"] > 0 for s in manifest["tokens"].values())
    assert len({r["id"] for r in records}) == N


def test_kinds_subset_and_bad_arguments(tmp_path):
    make_corpus.main(["--out", str(tmp_path), "--n", "4", "--seed", "1", "--kinds", "c,a"])
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "corpus-00000.jsonl").read_text().splitlines()]
    assert kinds == ["c", "a", "c", "a"]
    for bad in (["--n", "3", "--kinds", "a,z"], ["--n", "0"]):
        with pytest.raises(SystemExit):
            make_corpus.parse_args(["--out", str(tmp_path), *bad])


# -- the encoding ------------------------------------------------------------------------

def test_every_assistant_turn_parses_back(records):
    for r in records:
        for i, msg in enumerate(r["messages"]):
            if msg["role"] != "assistant":
                continue
            text = encode_messages([msg], context=r["messages"][:i], thinking_mode=r["thinking_mode"]).text
            parsed = parse_completion(text, r["thinking_mode"])
            assert parsed["content"] == msg["content"], r["id"]
            got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed["tool_calls"]]
            want = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", [])]
            assert got == want, r["id"]


def test_ids_are_append_only_across_turns(records, tokenizer):
    for r in records:
        conv, mask = corpus_gen.encode_record(r, tokenizer)
        full = encode_messages(r["messages"], thinking_mode=r["thinking_mode"]).tokenize(tokenizer)
        assert conv.ids == full.ids and conv.image_positions == full.image_positions, r["id"]
        assert len(mask) == len(conv.ids) and mask[-1] and conv.ids[-1] == tokenizer.eos_id
        assert len(full.image_positions) == sum(
            1 for m in r["messages"] if isinstance(m.get("content"), list)
            for b in m["content"] if b["type"] == "image_url")


def test_system_prompt_is_the_agents(records):
    for r in records:
        system = r["messages"][0]
        assert system["role"] == "system" and system["tools"] == builtin_toolbox().schemas()
        assert system["content"] == corpus_gen.DEFAULT_SYSTEM


# -- tools -------------------------------------------------------------------------------

def _replay_workspace(record: dict, root: Path) -> None:
    for rel, text in record["truth"].get("files", {}).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    for i, msg in enumerate(record["messages"]):
        for call in msg.get("tool_calls") or []:
            if call["function"]["name"] == "view_image":
                result = record["messages"][i + 1]["content"]
                sha = result[1]["image_url"]["url"].removeprefix("sha256:")
                path = json.loads(call["function"]["arguments"])["path"]
                (root / path).write_bytes(base64.b64decode(record["images"][sha]))


def test_tool_results_are_what_the_real_tools_return(records, tmp_path):
    checked = set()
    for n, r in enumerate(_of(records, "b", "e")):
        root = tmp_path / str(n)
        root.mkdir()
        _replay_workspace(r, root)
        runner = ToolRunner(builtin_toolbox(), Workspace(root), policy="yes")
        results = {m["tool_call_id"]: m["content"] for m in r["messages"] if m["role"] == "tool"}
        for msg in r["messages"]:
            for call in msg.get("tool_calls") or []:
                res = runner.run(call["function"]["name"], call["function"]["arguments"])
                content = results[call["id"]]
                assert res.ok and res.text == _text(content), r["id"]
                shown = [b["image_url"]["url"] for b in content if b["type"] == "image_url"] \
                    if isinstance(content, list) else []
                assert shown == [f"sha256:{image_sha256(d)}" for d in res.images], r["id"]
                checked.add(call["function"]["name"])
    assert "calculator" in checked and checked & {"read_file", "list_dir", "run_shell", "view_image"}


def _python_value(expression: str) -> str:
    value = eval(expression, {"__builtins__": {}}, {"sqrt": math.sqrt})  # noqa: S307 - our own expressions
    return corpus_gen.number_text(repr(value))


def test_arithmetic_answers_are_correct(records):
    sums = [(r, a) for r in records for a in r["truth"].get("arithmetic", [])]
    assert sums
    for r, a in sums:
        assert a["value"] == _python_value(a["expression"]), r["id"]
        assert any(f"{a['expression']} = {a['value']}" in m["content"] for m in r["messages"]
                   if m["role"] == "assistant"), r["id"]


def test_every_tool_and_generator_branch_is_reachable(tokenizer):
    names = set()
    for i in range(60):
        r = corpus_gen.make_record(11, i, "b", tokenizer)
        names |= {c["function"]["name"] for m in r["messages"] for c in m.get("tool_calls") or []}
    assert {"calculator", "read_file", "list_dir", "run_shell", "view_image"} <= names


# -- images ------------------------------------------------------------------------------

def _components(mask: np.ndarray) -> int:
    seen, count = np.zeros_like(mask), 0
    for y, x in zip(*np.nonzero(mask)):
        if seen[y, x]:
            continue
        count += 1
        queue, seen[y, x] = deque([(y, x)]), True
        while queue:
            cy, cx = queue.popleft()
            for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                if 0 <= ny < mask.shape[0] and 0 <= nx < mask.shape[1] and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    queue.append((ny, nx))
    return count


def test_images_decode_and_answers_match_what_was_drawn(records):
    with_images = [r for r in records if "image" in r["truth"]]
    assert _of(with_images, "c")
    for r in with_images:
        truth = r["truth"]["image"]
        (data,) = [base64.b64decode(v) for v in r["images"].values()]
        pixels = np.asarray(decode_image(data))
        mask = np.any(pixels != pixels[0, 0], axis=-1)
        assert _components(mask) == truth["count"], r["id"]
        assert {tuple(p) for p in pixels[mask]} == {tuple(truth["rgb"])}, r["id"]
        answer = r["messages"][-1]["content"]
        assert truth["colour"] in answer and truth["kind"] in answer, r["id"]
        assert corpus_gen.NUMBER_WORDS[truth["count"]] in answer, r["id"]


# -- long context and multi-turn ----------------------------------------------------------

def test_recall_plants_the_value_once_in_a_long_context(records, tokenizer):
    for r in _of(records, "d"):
        truth, users = r["truth"], [m for m in r["messages"] if m["role"] == "user"]
        before = "\n".join(_text(m["content"]) for m in r["messages"][1:])
        before = before[:before.rindex(truth["question"])]
        assert len(tokenizer.encode_content(before)) > 2000, r["id"]
        assert before.count(truth["value"]) == 1, r["id"]
        assert before.index(truth["value"]) < len(before) // 4, r["id"]
        assert users[-1]["content"].endswith(truth["question"])
        assert r["messages"][-1]["content"] == f"The {truth['key']} is {truth['value']}."


def test_recall_form_is_states_every_key_in_the_answers_words(tokenizer):
    """``RecallStyle(form="is")`` (the trainer's --recall-form experiment): the same record as the
    corpus's form — key, value, decoys, question and reply — with each key line saying
    ``<key> is <value>`` instead of ``<key>: <value>``, and the form named in its truth's style."""
    for i in (3, 13):
        colon = corpus_gen.make_record(5, i, "d", tokenizer, (150, 300))
        said = corpus_gen.make_record(5, i, "d", tokenizer, (150, 300), corpus_gen.RecallStyle(form="is"))
        truth = said["truth"]
        assert truth == colon["truth"] | {"style": {"form": "is"}} and "style" not in colon["truth"]
        assert said["messages"][-1] == colon["messages"][-1]
        log_colon, log_is = (_text(r["messages"][1]["content"]).splitlines() for r in (colon, said))
        keyed = [k for k, line in enumerate(log_colon) if re.fullmatch(r"[a-z ]+ of [a-z]+: \d{4}-\d{4}", line)]
        assert len(keyed) >= 3 and f"{truth['key']}: {truth['value']}" in log_colon
        assert [line.replace(": ", " is ", 1) if k in keyed else line for k, line in enumerate(log_colon)] == log_is
        assert f"{truth['key']} is {truth['value']}" in log_is


def test_recall_values_are_the_only_digits_of_the_log_and_styles_name_what_differs(tokenizer):
    """Recall values are ``1234-5678`` (corpus version 3) and the log's only digits are the
    planted key's and its decoys'; ``RecallStyle(decoys=False)`` (the trainer's
    --no-recall-decoys) leaves the planted line alone, ``value="mixed"`` writes version 2's
    ``ABC-1234``, and a record's truth names what its style changed; an unknown style is
    refused."""
    for i in (3, 13, 23):
        r = corpus_gen.make_record(5, i, "d", tokenizer, (150, 300))
        truth, log = r["truth"], _text(r["messages"][1]["content"]).splitlines()
        assert re.fullmatch(r"\d{4}-\d{4}", truth["value"]) and "style" not in truth
        keyed = [line for line in log if re.search(r"\d", line)]
        assert len(keyed) >= 3 and all(re.fullmatch(r"[a-z ]+ of [a-z]+: \d{4}-\d{4}", line) for line in keyed)
        assert f"{truth['key']}: {truth['value']}" in keyed
        assert r["messages"][-1]["content"] == f"The {truth['key']} is {truth['value']}."
        alone = corpus_gen.make_record(5, i, "d", tokenizer, (150, 300), corpus_gen.RecallStyle(decoys=False))
        assert alone["truth"]["style"] == {"decoys": False}
        assert ([line for line in _text(alone["messages"][1]["content"]).splitlines() if re.search(r"\d", line)]
                == [f"{alone['truth']['key']}: {alone['truth']['value']}"])
        mixed = corpus_gen.make_record(5, i, "d", tokenizer, (150, 300), corpus_gen.RecallStyle(value="mixed"))
        assert re.fullmatch(r"[A-Z]{3}-\d{4}", mixed["truth"]["value"]) and mixed["truth"]["style"] == {"value": "mixed"}
    with pytest.raises(ValueError):
        corpus_gen.RecallStyle(value="words")
    with pytest.raises(ValueError):
        corpus_gen.RecallStyle(place="middle")


def test_recall_keys_placed_anywhere_have_decoys_before_them_as_often_as_not(tokenizer):
    """``RecallStyle(place="any")`` (the trainer's --recall-place any): the asked key and each
    decoy anywhere in the log, so keys of the asked kind often come first (``decoys_before``);
    the corpus's own style, at its lengths, plants the key in the log's first fifth and every
    decoy after it."""
    def placed(r: dict) -> tuple[int, list[int], int]:
        truth, log = r["truth"], _text(r["messages"][1]["content"]).split("\n")
        kind, at = truth["key"].split(" of ")[0], log.index(f"{truth['key']}: {truth['value']}")
        return at, [j for j, line in enumerate(log) if line.startswith(f"{kind} of ") and j != at], len(log)

    for i in range(6):
        own = corpus_gen.make_record(9, i, "d", tokenizer)
        at, same_kind, lines = placed(own)
        assert at <= lines // 5 + 2 and all(j > at for j in same_kind) and "decoys_before" not in own["truth"]
    late, before = 0, []
    for i in range(40):
        r = corpus_gen.make_record(9, i, "d", tokenizer, (150, 300), corpus_gen.RecallStyle(place="any"))
        at, same_kind, lines = placed(r)
        assert r["truth"]["decoys_before"] == sum(j < at for j in same_kind) and r["truth"]["style"] == {"place": "any"}
        before.append(r["truth"]["decoys_before"])
        late += at > lines // 2
    assert late >= 10 and 0.3 < sum(b > 0 for b in before) / 40 < 0.9, (late, before)


def test_multi_turn_final_answers_depend_on_earlier_turns(records):
    for r in _of(records, "e"):
        assert sum(m["role"] == "user" for m in r["messages"]) >= 2, r["id"]
        final = r["messages"][-1]["content"]
        last_user = [m for m in r["messages"] if m["role"] == "user"][-1]
        answer = str(r["truth"]["answer"]) if "answer" in r["truth"] else r["truth"]["image"]["colour"]
        assert answer in final and answer not in _text(last_user["content"]), r["id"]


def test_focus_example_trains_whole_words_of_the_last_reply_alone():
    """focus_example scores the tokens spelling the words given, in the last reply only and
    as whole words (a value inside a longer word is not it); a reply without them is refused."""
    from model.args import ModelArgs

    tok, args = Tokenizer.bundled(), ModelArgs.preset("tiny")
    record = corpus_gen.make_record(5, 3, "d", tok, (40, 60))
    value = record["truth"]["value"]
    ex = corpus_gen.focus_example(record, tok, args, [value])
    said = [i for i, m in enumerate(ex.trained) if m]
    assert tok.decode([ex.ids[i] for i in said]).strip() == value
    assert said[0] > len(ex.ids) - 16  # the reply's copy, not the log's (the log spells it too)
    assert corpus_gen.value_example(record, tok, args).trained == ex.trained
    with pytest.raises(ValueError, match="spells none"):
        corpus_gen.focus_example(record, tok, args, [value[1:]])  # inside the value: not a whole word


def test_copy_example_trains_the_names_and_numbers_a_reply_copies_alone():
    """copy_example scores the reply tokens that spell a lexicon word or a number an earlier
    message holds — the listed files, the numbers put to the calculator — and nothing of the
    template around them, the system prompt's words or the workspace's fixed paths."""
    from model.args import ModelArgs
    from model.draft_training import reply_spans

    tok, args = Tokenizer.bundled(), ModelArgs.preset("tiny")
    record = corpus_gen.make_record(5, 11, "f", tok, words="open")
    ex = corpus_gen.copy_example(record, tok, args)
    whole = corpus_gen.training_example(record, tok, args)
    assert list(ex.ids) == list(whole.ids) and all(w for s, w in zip(ex.trained, whole.trained) if s)
    runs = [tok.decode([ex.ids[i] for i in range(a, b)]).strip(" ,") for a, b in reply_spans(ex.trained)]
    listed = sorted(p.removeprefix("data/").split(".")[0] for p in record["truth"]["files"] if p.startswith("data/"))
    assert runs == listed  # " besusvo", " falus", ...: not "data", "files" nor the colour told
    calc = corpus_gen.copy_example(corpus_gen.make_record(5, 4, "b", tok, words="open"), tok, args)
    said = [tok.decode([calc.ids[i] for i in range(a, b)]).strip() for a, b in reply_spans(calc.trained)]
    assert said == ["92", "22", "92", "22", "114"]  # the call's operands, then the reply's and the result
    chat = corpus_gen.make_record(5, 1, "a", tok, words="open")
    assert corpus_gen.copy_example(chat, tok, args) is None  # a reply that copies nothing


def test_echo_drills_ask_to_repeat_what_no_vocabulary_holds_and_train_the_copy_alone():
    """echo_record: the system prompt, a request to repeat a text and the reply that repeats it,
    the same for a seed and index; the text's words are never the open vocabulary's held-out
    half (the evaluation's); echo_example trains exactly the reply's tokens that spell it."""
    from dsagent.lexicon import split_of
    from model.args import ModelArgs
    from model.draft_training import reply_spans

    tok, args = Tokenizer.bundled(), ModelArgs.preset("tiny")
    records = [corpus_gen.echo_record(3, i) for i in range(300)]
    assert corpus_gen.echo_record(3, 7) == records[7] and corpus_gen.echo_record(4, 7) != records[7]
    held_out = corpus_gen.lexicon("held-out")
    words = [w for r in records for w in re.findall(r"[A-Za-z]+", r["truth"]["answer"])]
    assert len(set(words)) > 250 and not any(held_out.drew(w) for w in words)
    assert {split_of(w.lower()) for w in words} == {"train", "held-out"}  # random strings fall in both hashes,
    # but none is a word the held-out half generates
    for r in records[:20]:
        roles = [m["role"] for m in r["messages"]]
        assert roles == ["system", "user", "assistant"] and r["messages"][2]["content"] == r["truth"]["answer"]
        assert r["truth"]["answer"] in r["messages"][1]["content"]
        ex = corpus_gen.echo_example(r, tok, args)
        (a, b), = reply_spans(ex.trained)
        assert tok.decode([int(ex.ids[i]) for i in range(a, b)]).strip() == r["truth"]["answer"]


def test_corpus_and_training_scripts_import_without_the_session_store():
    """The GPU machine has no zstandard or sqlite-utils: the corpus generator and the
    training / probe scripts must not pull in the session store (they did, through the agent's
    system prompt, and a training run there stopped at its imports)."""
    root = Path(__file__).resolve().parents[1]
    code = ("import sys; sys.modules['zstandard'] = None; sys.modules['sqlite_utils'] = None; "
            f"sys.path.insert(0, {str(root / 'scripts')!r}); "
            "import dsagent.corpus, train_default, recall_probe, retrieval_drill, image_drill, copy_drill; "
            "assert 'sessions' not in sys.modules, 'the session store was imported'")
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


# -- the kinds before f, and the mixed conversations (f) -----------------------------------

# sha256 (first 16 hex) of json.dumps(record, sort_keys=True) for records 0-5 of each kind,
# made by this generator before kind f was added: adding a kind must not move another's draws
KIND_DIGESTS = {"7-a": "a5d0122455895332", "7-b": "69a1ac5ec1849d90", "7-c": "baa008bec491e810",
                "7-d": "764b0d34422b8de8", "7-e": "5931fc8f22fcfc99", "7919-a": "60356da8b89dba86",
                "7919-b": "a7868d56cfb11339", "7919-c": "209de3b84043f9a9", "7919-d": "8f641e1e81d5a720",
                "7919-e": "71d43c9698a8260d"}


def test_records_of_the_kinds_before_f_are_unchanged(tokenizer):
    import hashlib

    for key, digest in KIND_DIGESTS.items():
        seed, kind = key.split("-")
        h = hashlib.sha256()
        for i in range(6):
            h.update(json.dumps(corpus_gen.make_record(int(seed), i, kind, tokenizer), sort_keys=True).encode())
        assert h.hexdigest()[:16] == digest, key


@pytest.fixture(scope="module")
def mixed(tokenizer) -> list[dict]:
    return [corpus_gen.make_record(SEED, i, "f", tokenizer) for i in range(60)]


def _turns(record: dict) -> list[list[dict]]:
    """The record's messages after the system prompt, a list per turn (from its user message)."""
    turns: list[list[dict]] = []
    for m in record["messages"][1:]:
        if m["role"] == "user":
            turns.append([])
        turns[-1].append(m)
    return turns


def test_mixed_records_are_two_to_eight_turns_of_two_skills_or_more(mixed, tokenizer):
    lengths, skills = set(), set()
    for r in mixed:
        truths = r["truth"]["turns"]
        assert len(_turns(r)) == len(truths) and 2 <= len(truths) <= 8, r["id"]
        assert len({t["skill"] for t in truths}) >= 2, r["id"]
        assert r["kind"] == "f" and r["version"] == corpus_gen.CORPUS_VERSION
        lengths.add(len(truths))
        skills |= {t["skill"] for t in truths}
        conv, mask = corpus_gen.encode_record(r, tokenizer)
        assert conv.ids == encode_messages(r["messages"], thinking_mode=r["thinking_mode"]).tokenize(tokenizer).ids
        for i, msg in enumerate(r["messages"]):
            if msg["role"] == "assistant":
                text = encode_messages([msg], context=r["messages"][:i], thinking_mode=r["thinking_mode"]).text
                assert parse_completion(text, r["thinking_mode"])["content"] == msg["content"], r["id"]
    assert lengths == set(range(2, 9)) and skills == set(corpus_gen.MIXED_SKILLS)
    # four facts told, then the last turn: neither a fifth fact nor the same skill again
    told = corpus_gen.make_record(7921, 37, "f", tokenizer)["truth"]["turns"]
    assert [t["skill"] for t in told] == ["tell"] * 4 + ["recall"]


def test_mixed_tool_results_are_what_the_real_tools_return(mixed, tmp_path):
    for n, r in enumerate(mixed[:30]):
        root = tmp_path / str(n)
        root.mkdir()
        _replay_workspace(r, root)
        runner = ToolRunner(builtin_toolbox(), Workspace(root), policy="yes")
        results = {m["tool_call_id"]: _text(m["content"]) for m in r["messages"] if m["role"] == "tool"}
        for call in (c for m in r["messages"] for c in m.get("tool_calls") or []):
            res = runner.run(call["function"]["name"], call["function"]["arguments"])
            assert res.ok and res.text == results[call["id"]], r["id"]


def _own_image(turn: list[dict], record: dict) -> dict:
    """What the turn's one picture (attached or returned by view_image) shows."""
    (url,) = [b["image_url"]["url"] for m in turn if isinstance(m["content"], list)
              for b in m["content"] if b["type"] == "image_url"]
    pixels = np.asarray(decode_image(base64.b64decode(record["images"][url.removeprefix("sha256:")])))
    mask = np.any(pixels != pixels[0, 0], axis=-1)
    (rgb,) = {tuple(p) for p in pixels[mask]}
    return {"count": _components(mask), "rgb": list(rgb)}


def _chat_answer(question: str) -> str:
    """The answer to a chat question of kind a, from the question alone."""
    pool = dict(corpus_gen._runtime_facts() + corpus_gen.FACTS + corpus_gen.GREETINGS)
    after = re.fullmatch(r"What (?:day|number) comes after (\w+)\?", question)
    if question in pool:
        return pool[question]
    if after:
        w = after.group(1)
        return f"{int(w) + 1}." if w.isdigit() else f"{corpus_gen.DAYS[(corpus_gen.DAYS.index(w) + 1) % 7]}."
    return question.split(": ", 1)[1]  # an echo request


def _check_own_turn(skill: str, truth: dict, turn: list[dict], record: dict) -> None:
    """A turn that does not refer back: its truth follows from its question and its results."""
    question = _text(turn[0]["content"])
    results = "\n".join(_text(m["content"]) for m in turn if m["role"] == "tool")
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for m in turn for c in m.get("tool_calls") or []]
    if skill == "chat":
        assert truth["answer"] == _chat_answer(question) == truth.get("cut", turn[-1])["reply" if "cut" in truth
                                                                                    else "content"], question
    elif skill == "calc":
        assert [args["expression"] for _, args in calls] == [a["expression"] for a in truth["arithmetic"]]
        assert all(a["expression"] in question and a["value"] == _python_value(a["expression"])
                   for a in truth["arithmetic"])
    elif skill == "file":
        ((name, args),) = calls
        assert args["path"] in question or (args["path"] == "data" and "data" in question)
        listed = len(results.splitlines()) if name == "list_dir" else None
        assert truth["answer"] == listed or f": {truth['answer']}" in results
    elif skill == "image":
        assert all(args["path"] in question for _, args in calls)
        assert _own_image(turn, record) == {k: truth["image"][k] for k in ("count", "rgb")}
    else:
        assert skill == "tell" and not calls and truth["answer"] in question
    assert turn[-1]["role"] == "assistant" and not turn[-1].get("tool_calls")


def test_mixed_turns_answer_from_their_own_question_and_results(mixed):
    """Every turn's truth comes from its own question and tool results; a turn that draws on
    an earlier one (a told fact asked back, a calculation on an earlier result) says so in
    its question, names the turn in ``refers_to``, and gets its value from that turn."""
    referring = 0
    for r in mixed:
        turns, truths = _turns(r), r["truth"]["turns"]
        for t, (turn, truth) in enumerate(zip(turns, truths), 1):
            skill, question = truth["skill"], _text(turn[0]["content"])
            if skill not in ("recall", "back"):
                assert truth["refers_to"] is None, (r["id"], t)
                _check_own_turn(skill, truth, turn, r)
                continue
            referring += 1
            earlier = truths[truth["refers_to"] - 1]
            assert 1 <= truth["refers_to"] < t, (r["id"], t)
            if skill == "recall":
                assert question in corpus_gen.TOLD[truth["fact"]].asks and earlier["fact"] == truth["fact"]
                assert truth["answer"] not in question
                assert truth["answer"] == earlier["answer"] and truth["answer"] in turn[-1]["content"]
                continue
            (item,) = truth["arithmetic"]
            said = "that" if truth["refers_to"] == t - 1 else f"the result of {earlier['arithmetic'][-1]['expression']}"
            assert said in question and item["expression"].startswith(f"{earlier['answer']} "), (r["id"], t)
            assert item["expression"].rsplit(" ", 1)[1] in question and item["value"] == _python_value(item["expression"])
    assert referring > 20


def test_some_mixed_replies_are_cut_off_as_the_agent_saves_them_and_never_trained(mixed, tokenizer):
    """A turn of a skill no later turn draws on, never the last, may end in a reply cut off
    (Ctrl-C, the token limit): the first words of the whole reply, its stop saved as the
    agent saves it; its tokens are in the log (closed as any reply's) but not trained, and the
    turns after it keep their own truths (the test above)."""
    cut, cuttable = 0, 0
    for r in mixed:
        turns, truths = _turns(r), r["truth"]["turns"]
        conv, mask = corpus_gen.encode_record(r, tokenizer)
        spans = _assistant_spans(r, tokenizer)
        for t, (turn, truth) in enumerate(zip(turns, truths), 1):
            cuttable += truth["skill"] in corpus_gen.CUT_SKILLS and t < len(truths)
            reply = turn[-1]
            if "cut" not in truth:
                assert "stop" not in reply, (r["id"], t)
                continue
            cut += 1
            assert truth["skill"] in corpus_gen.CUT_SKILLS and t < len(truths), (r["id"], t)
            words, stop, whole = truth["cut"]["words"], truth["cut"]["stop"], truth["cut"]["reply"]
            assert reply["stop"] == stop and (stop == "interrupted" or words > 0)
            assert reply["content"] == " ".join(whole.split(" ")[:words]) and words < len(whole.split(" "))
        for message, (lo, hi) in spans:
            assert all(mask[lo:hi]) == ("stop" not in message) and any(mask[lo:hi]) == ("stop" not in message)
    assert 0.1 < cut / cuttable < 0.3, (cut, cuttable)


def _assistant_spans(record: dict, tokenizer) -> list[tuple[dict, tuple[int, int]]]:
    """Each assistant message of the record and the span of its ids in the encoded record."""
    spans = []
    for i, m in enumerate(record["messages"]):
        before = len(encode_messages(record["messages"][:i], thinking_mode=record["thinking_mode"])
                     .tokenize(tokenizer).ids) if i else 0
        after = len(encode_messages(record["messages"][:i + 1], thinking_mode=record["thinking_mode"])
                    .tokenize(tokenizer).ids)
        if m["role"] == "assistant":
            spans.append((m, (before, after)))
    return spans


def test_make_corpus_writes_f_when_asked_and_the_trainer_schedules_it(tmp_path):
    """f is in no default mixture: make_corpus writes it for --kinds naming it, and the
    trainer's --schedule (default the default model's) lays its records out."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import train_default
    from model.args import ModelArgs

    make_corpus.main(["--out", str(tmp_path), "--n", "4", "--seed", "1", "--kinds", "a,f"])
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "corpus-00000.jsonl").read_text().splitlines()]
    assert kinds == ["a", "f", "a", "f"] and make_corpus.parse_args(["--out", "x", "--n", "1"]).kinds == list("abcde")
    assert train_default.parse_args(["--out", "x"]).schedule == train_default.SCHEDULE == "aabbbccdee"
    pools = train_default.make_examples(6, 1, ModelArgs.preset("tiny"), workers=1, kinds="af", schedule="aff")
    assert len(pools["short"]) == 6 and not pools["long"]
    for bad in (["--schedule", "aabz"], ["--kinds", "abcdef"]):  # refused before anything is trained
        with pytest.raises(SystemExit, match="schedule"):
            train_default.main(["--out", str(tmp_path / "run"), *bad])
