"""The skill evaluation (dsagent/evaluate.py) and `dsagent eval`.

Scoring rules are checked on hand-made completions; two scripted test doubles (one
answering with the ground truth, one always wrong) go through the same `evaluate` code;
the real embedded model runs the resume mode through a real Store on a short hand-made
case, and the CLI on one held-out case of skill a (the prefix mode there starts from the
system prompt another session stored).
"""
import io
import json
import random

import pytest
from rich.console import Console
from typer.testing import CliRunner

import dsagent.cli as cli
from dsagent.commands.eval import result_table
from dsagent.corpus import Builder, describe, draw_shapes
from dsagent.evaluate import (MODES, SKILLS, TRAIN_SEEDS, Case, Completion, EvalConfigError, ModelGenerator,
                              case_from_record, evaluate, make_cases, prompt_inputs, read_back_truth, score, score_text,
                              score_tool_calls)
from dsagent.runtime import Runtime, Settings
from model.chat import EOS
from model.quant import KVFormat
from sessions import Store
from tests.scripted_runtime import tool_call


@pytest.fixture(scope="module")
def runtime() -> Runtime:
    return Runtime.load(Settings())


@pytest.fixture(scope="module")
def cases(runtime) -> list[Case]:
    return make_cases(runtime.tokenizer, n=2)


def _call(name: str, **args) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


# ---------------------------------------------------------------------------- scoring
def test_tool_call_scoring():
    want = [_call("calculator", expression="12 + 5")]
    assert score_tool_calls(want, tool_call("calculator", expression="12 + 5") + EOS) == 1
    assert score_tool_calls(want, tool_call("calculator", expression="12+5") + EOS) == 0  # other arguments
    assert score_tool_calls(want, tool_call("run_shell", expression="12 + 5") + EOS) == 0  # other tool
    assert score_tool_calls(want, "12 + 5 = 17." + EOS) == 0  # an answer, no call
    assert score_tool_calls(want, tool_call("calculator", expression="12 + 5").replace("invoke>", "invoke")) == 0
    two = [_call("read_file", path="a.txt"), _call("read_file", path="b.txt")]
    assert score_tool_calls(two, tool_call("read_file", path="a.txt") + EOS) == 0  # one call of two


def test_text_scoring():
    assert score_text({"answer": "Cold."}, "It is cold here.") == 1
    assert score_text({"answer": "Cold."}, "It is colder.") == 0  # whole words only
    assert score_text({"answer": "42."}, "The answer is 420.") == 0
    assert score_text({"value": "HUJ-1094"}, "The password of sable is HUJ-1094.") == 1
    assert score_text({"value": "HUJ-1094"}, "The password of sable is KGX-7140.") == 0
    image = {"image": {"kind": "circle", "colour": "red", "count": 3}}
    assert score_text(image, "There are three red circles.") == 1
    assert score_text(image, "3 red circles") == 1
    assert score_text(image, "There are three red squares.") == 0  # wrong kind
    assert score_text(image, "Three red circles and a blue one.") == 0  # another colour named


def test_read_back_scoring_needs_what_the_results_said():
    """Skill r: the words a reply takes from tool results; the question's expression is cut
    out of the reply first, so it cannot supply the value."""
    question = {"role": "user", "content": "What is 10 % 11?"}
    call = {"role": "assistant", "content": "", "tool_calls": [_call("calculator", expression="10 % 11")]}
    truth = read_back_truth([question, call, {"role": "tool", "content": "10"}], {"content": "10 % 11 = 10."},
                            {"arithmetic": [{"expression": "10 % 11", "value": "10"}]})
    assert truth == {"read": ["10"], "unsaid": ["10 % 11"]}
    assert score_text(truth, "10 % 11 = 10.") == 1 and score_text(truth, "10 % 11 = 1.") == 0
    truth = read_back_truth([question, call, {"role": "tool", "content": "59.0"}], {"content": "sqrt(3481) = 59."},
                            {"arithmetic": [{"expression": "sqrt(3481)", "value": "59"}]})
    assert truth["read"] == ["59"]  # the value, as the reply writes it
    ask = {"role": "user", "content": "What files are in the data folder?"}
    listed = {"role": "tool", "content": "maple.csv  0 bytes\nnotes.txt  25 bytes"}
    truth = read_back_truth([ask, {**call, "tool_calls": [_call("list_dir", path="data")]}, listed],
                            {"content": "The data folder has 2 files: maple.csv, notes.txt."}, {"answer": 2})
    assert truth == {"read": ["2", "maple.csv", "notes.txt"], "unsaid": []}  # not "data", "folder": asked
    assert score_text(truth, "The data folder has 2 files: maple.csv, notes.txt.") == 1
    assert score_text(truth, "The data folder has 2 files: juniper.csv, juniper.csv.") == 0


def test_text_target_scores_the_reply_content(cases):
    a = next(c for c in cases if c.skill == "a")
    fact = a.truth["answer"].rstrip(".!?")
    assert score(a, f"Sure: {fact}." + EOS) == 1
    assert score(a, f"{fact} (cut off") == 1  # no EOS: the raw text is read
    assert score(a, "I don't know." + EOS) == 0


# ---------------------------------------------------------------------------- cases
def test_cases_are_held_out_and_cut_before_their_target(cases):
    assert [c.skill for c in cases] == [s for s in "abcder" for _ in range(2)]
    assert all(c.id.startswith("7919-") for c in cases)
    for c in cases:
        assert c.target["role"] == "assistant" and c.prompt[-1]["role"] in ("user", "tool")
        assert score(c, c.expected) == 1  # the trained completion meets its own rule
    for b in (c for c in cases if c.skill == "b"):
        assert b.target.get("tool_calls") and not any(m.get("tool_calls") for m in b.prompt)  # the first call
    for e in (c for c in cases if c.skill == "e" and c.target.get("tool_calls")):
        assert any(m.get("tool_calls") for m in e.prompt)  # a later call, after earlier results
    b, r = ([c for c in cases if c.skill == k] for k in "br")
    for b_case, r_case in zip(b, r):  # the same tool records, cut after their results
        assert r_case.id == f"{b_case.id}-r" and r_case.prompt[: len(b_case.prompt)] == b_case.prompt
        assert r_case.prompt[-1]["role"] == "tool" and not r_case.target.get("tool_calls")
        assert r_case.truth.get("read") or "image" in r_case.truth


def test_read_back_cases_have_facts_from_the_results(runtime):
    """Every r case of a larger sample needs at least one fact, met by its own target and
    not by a reply that names the question's words alone."""
    for c in make_cases(runtime.tokenizer, n=60, seed=7921, skills=["r"]):
        assert score(c, c.expected) == 1, c.id
        if "read" in c.truth:
            question = next(m for m in reversed(c.prompt) if m["role"] == "user")["content"]
            assert c.truth["read"] and score(c, question + EOS) == 0, c.id


def test_bad_configuration_is_refused(runtime):
    with pytest.raises(EvalConfigError, match="training"):
        make_cases(runtime.tokenizer, n=1, seed=TRAIN_SEEDS[0])
    with pytest.raises(EvalConfigError, match="skill"):
        make_cases(runtime.tokenizer, n=1, skills=["x"])
    with pytest.raises(EvalConfigError, match="mode"):
        evaluate(TruthScriptedGenerator(), [], ["fast"])


# ---------------------------------------------------------------------------- test doubles
class TruthScriptedGenerator:
    """TEST DOUBLE: a scripted generator that answers every case with its ground-truth completion."""

    def complete(self, case: Case, mode: str) -> Completion:
        return Completion(case.expected)


class WrongScriptedGenerator:
    """TEST DOUBLE: a scripted generator whose every reply is wrong (same text in every mode)."""

    def complete(self, case: Case, mode: str) -> Completion:
        return Completion("I do not know." + EOS)


def test_truth_double_scores_one_and_wrong_double_zero(cases):
    done = []
    right = evaluate(TruthScriptedGenerator(), cases, progress=lambda i, n: done.append((i, n)))
    wrong = evaluate(WrongScriptedGenerator(), cases)
    assert done[-1] == (len(cases) * len(MODES), len(cases) * len(MODES))
    for skill in SKILLS:
        for mode in MODES:
            assert right.cell(skill, mode) == (2, 2) and wrong.cell(skill, mode) == (0, 2)
    assert right.identical_to_ced("float-kv") == 1.0 and wrong.identical_to_ced("resume") == 1.0
    out = right.to_json()
    assert out["accuracy"]["d"]["resume"] == {"correct": 2, "n": 2, "accuracy": 1.0}
    assert len(out["cases"]) == len(cases) * len(MODES)


def test_table_has_a_row_per_skill_and_a_column_per_mode(cases):
    result = evaluate(TruthScriptedGenerator(), cases)
    buf = io.StringIO()
    Console(file=buf, width=200, no_color=True).print(result_table(result))
    text = buf.getvalue()
    assert all(m in text for m in MODES) and "d recall" in text and "r read_back" in text and "12/12" in text
    assert "100%" in text


# ---------------------------------------------------------------------------- the real model
@pytest.fixture(scope="module")
def short_case(runtime) -> Case:
    """A hand-made image case of ~300 tokens: longer than the window, so resume has KV to load."""
    rng = random.Random(0)
    b = Builder(rng)
    b.messages[0] = {"role": "system", "content": "You are dsagent. Answer briefly."}
    shapes = draw_shapes(rng)
    filler = " ".join(f"Item {i} is on shelf {i % 7}." for i in range(40))
    b.user(f"{filler}\nHow many shapes are in this picture?", image=shapes.png)
    b.say(describe(shapes))
    b.truth["image"] = shapes.truth()
    return case_from_record(b.record("short-0", "c"), runtime.tokenizer)


def test_resume_goes_through_the_store(runtime, short_case, tmp_path):
    gen = ModelGenerator(runtime, max_new_tokens=3, store_home=tmp_path)
    stats = gen.complete(short_case, "resume").stats
    window = runtime.args.sliding_window
    ids, images = prompt_inputs(gen.rt, short_case)
    assert images is not None and stats["log_tokens"] == ids.shape[1] > window
    assert stats["cached_tokens"] > window and stats["replayed_tokens"] == window  # stored KV, then replay
    assert stats["prompt_tokens"] == stats["log_tokens"] - stats["cached_tokens"]  # no full re-prefill
    with Store.open(tmp_path) as store:
        loaded = store.load(stats["session"], fingerprint=runtime.fingerprint, chunk_tokens=256)
    assert loaded.tokens[: ids.shape[1]] == ids[0].tolist()  # the agent logged the same prompt
    assert loaded.kv and [m["role"] for m in loaded.messages] == ["system", "user", "assistant"]


def test_a_picture_in_a_tool_result_is_resumed_from_the_store(runtime, tmp_path):
    """An r case whose result is a view_image picture: its span is in the prompt, and the
    resume mode logs and resumes it through a real Store."""
    case = next(c for c in make_cases(runtime.tokenizer, n=40, skills=["r"]) if "image" in c.truth)
    assert isinstance(case.prompt[-1]["content"], list)  # the tool message carries the picture
    gen = ModelGenerator(runtime, max_new_tokens=2, store_home=tmp_path)
    ids, images = prompt_inputs(gen.rt, case)
    stats = gen.complete(case, "resume").stats
    assert images is not None and stats["log_tokens"] == ids.shape[1] and stats["cached_tokens"] > 0


def test_float_kv_mode_uses_an_unquantised_cache(runtime, short_case, monkeypatch):
    gen = ModelGenerator(runtime, max_new_tokens=2)
    formats, new_cache = [], runtime.model.new_cache
    monkeypatch.setattr(runtime.model, "new_cache", lambda b, kv: formats.append(kv) or new_cache(b, kv=kv))
    replies = [gen.complete(short_case, mode).text for mode in ("ced", "float-kv")]
    assert formats == [KVFormat.PACKED, KVFormat.FLOAT]
    assert all(r.endswith(EOS) for r in replies)


def test_cli_eval_json_on_the_embedded_default(monkeypatch, tmp_path):
    monkeypatch.setenv("DSAGENT_HOME", str(tmp_path / "home"))
    r = CliRunner().invoke(cli.app, ["eval", "--n", "1", "--skills", "a", "--max-new-tokens", "2", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["seed"] == 7919 and out["skills"] == ["a"] and out["modes"] == list(MODES)
    assert set(out["accuracy"]["a"]) == set(MODES) and all(v["n"] == 1 for v in out["accuracy"]["a"].values())
    assert set(out["identical_to_ced"]) == {"exact", "float-kv", "resume", "prefix"}
    resumed = next(c for c in out["cases"] if c["mode"] == "resume")
    assert resumed["stats"]["cached_tokens"] > 0 and resumed["stats"]["completion_tokens"] <= 2
    prefixed = next(c for c in out["cases"] if c["mode"] == "prefix")["stats"]  # the system prompt's 8 chunks
    assert (prefixed["cached_tokens"], prefixed["replayed_tokens"]) == (2048, 128)
    assert prefixed["prompt_tokens"] == prefixed["log_tokens"] - 2048


def test_speculative_mode_replies_as_ced_does_and_counts_its_verifies(runtime):
    """The embedded default has trained draft stages: on held-out cases its speculative replies
    are ced's, token for token, and most verify forwards accept proposals."""
    cases = make_cases(runtime.tokenizer, n=1, skills=["a", "b", "r"])
    generator = ModelGenerator(runtime)
    result = evaluate(generator, cases, ["ced", "speculative"])
    assert result.identical_to_ced("speculative") == 1.0
    assert all(result.cell(s, "speculative") == result.cell(s, "ced") for s in ("a", "b", "r"))
    spec = result.speculation()
    assert spec["verify_forwards"] > 0 and spec["accepted_per_verify"] > 1.0
    assert spec["tokens_per_verify"] == pytest.approx(spec["accepted_per_verify"] + 1)
    assert result.to_json()["speculation"] == spec


def test_cli_eval_speculative_flag_and_a_model_without_draft_stages(monkeypatch, tmp_path):
    monkeypatch.setenv("DSAGENT_HOME", str(tmp_path / "home"))
    r = CliRunner().invoke(cli.app, ["eval", "--n", "1", "--skills", "b", "--modes", "ced", "--speculative",
                                     "--max-new-tokens", "8", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["modes"] == ["ced", "speculative"] and out["speculation"]["verify_forwards"] > 0
    r = CliRunner().invoke(cli.app, ["eval", "--preset", "tiny", "--n", "1", "--skills", "b", "--speculative"])
    assert r.exit_code == 2 and "draft stages" in r.output


def test_cli_eval_refuses_bad_flags_before_loading():
    assert CliRunner().invoke(cli.app, ["eval", "--skills", "a,x"]).exit_code == 2
    assert CliRunner().invoke(cli.app, ["eval", "--seed", str(TRAIN_SEEDS[0])]).exit_code == 2
    assert CliRunner().invoke(cli.app, ["eval", "--model", "m", "--preset", "tiny"]).exit_code == 2
    for bad in ("300", "a,b", "500,300", "0,10"):
        r = CliRunner().invoke(cli.app, ["eval", "--skills", "d", "--recall-tokens", bad])
        assert r.exit_code == 2 and "recall" in r.output.lower(), (bad, r.output)


def test_recall_cases_can_be_drawn_shorter(runtime):
    """--recall-tokens probes retrieval by distance: the same held-out records, shorter logs
    (the same key asked); the default stays the corpus's 2,000-6,000 tokens."""
    full = make_cases(runtime.tokenizer, n=2, skills=["d"])
    short = make_cases(runtime.tokenizer, n=2, skills=["d"], recall_tokens=(60, 120))
    assert all(s.truth["key"] == f.truth["key"] for s, f in zip(short, full))
    sizes = [sum(len(runtime.tokenizer.encode_content(m["content"])) for m in c.prompt if m["role"] == "user")
             for c in full + short]
    assert min(sizes[:2]) > 2000 and max(sizes[2:]) < 400, sizes


def test_recall_cases_can_place_the_key_anywhere_among_its_decoys(runtime):
    """--recall-place any: the same held-out records' keys, each planted anywhere and its
    decoys too, so that in most cases a key of the asked kind comes before it (what training
    never showed: issue 53's default answered with the first one); named in the JSON and the
    table's title; an unknown place is refused before loading."""
    first = make_cases(runtime.tokenizer, n=6, skills=["d"], recall_tokens=(300, 600))
    anywhere = make_cases(runtime.tokenizer, n=6, skills=["d"], recall_tokens=(300, 600), recall_place="any")
    assert all("decoys_before" not in c.truth for c in first)
    before = [c.truth["decoys_before"] for c in anywhere]
    assert sum(b > 0 for b in before) >= 2, before
    for c in anywhere:
        log = next(m["content"] for m in c.prompt if m["role"] == "user").split("\n")
        kind = c.truth["key"].split(" of ")[0]
        at = log.index(f"{c.truth['key']}: {c.truth['value']}")
        assert sum(line.startswith(f"{kind} of ") for line in log[:at]) == c.truth["decoys_before"]
        assert c.truth["style"] == {"place": "any"}
    result = evaluate(TruthScriptedGenerator(), anywhere, ["exact"])
    result.recall_place = "any"
    assert result.to_json()["recall_place"] == "any" and result.cell("d", "exact") == (6, 6)
    buf = io.StringIO()
    Console(file=buf, width=200, no_color=True).print(result_table(result))
    assert "recall keys placed any" in buf.getvalue()
    r = CliRunner().invoke(cli.app, ["eval", "--skills", "d", "--recall-place", "middle"])
    assert r.exit_code == 2 and "recall place" in r.output, r.output


def test_refused_seeds_are_the_ones_the_default_trained_on():
    """TRAIN_SEEDS must name every corpus seed in the shipped model's training record."""
    import json

    from dsagent.evaluate import HELD_OUT_SEED
    from dsagent.runtime import EMBEDDED_MODEL

    runs = json.loads((EMBEDDED_MODEL / "TRAINING.json").read_text())["runs"]
    assert sorted({r["seed"] for r in runs}) == sorted(TRAIN_SEEDS) and HELD_OUT_SEED not in TRAIN_SEEDS
