"""Skill evaluation of a model on held-out corpus records, in five cache modes.

Owns: cutting held-out records of the synthetic corpus (``dsagent.corpus``) into cases,
generating each case's reply in every mode, scoring replies, and the result (accuracy
per skill and mode, agreement with the ``ced`` replies, seconds).
Does not own the corpus, the engine or the store, and prints nothing (`dsagent eval`
renders the result).

Cases. Records come from ``HELD_OUT_SEED`` (7919) by default and never from the
training seeds (``TRAIN_SEEDS``), so no case is a record the model was trained on (kind a
draws its questions from a small fixed pool, so it tests what was learnt by heart). A case is a
record cut before one assistant message, its target:

  b (tools)       the first assistant step, which calls tools: choosing the tool and its
                  arguments is the skill
  r (read back)   the same tool records (kind b), cut after the tool results: the final
                  reply, which must carry what the results said
  e (multi-turn)  the last tool-call step when the session uses tools (its arguments carry
                  an earlier answer: "add 7 to that", "read the first file"), else the
                  final reply (a name, colour or image fact said turns earlier)
  a, c, d         the final assistant reply
  f (mixed)       a case per turn: a record of T turns is cut before each turn's first
                  assistant step (its tool call, or its reply when it calls none), scored
                  against that turn's own truth; the result also counts the cases by turn
                  index (1, 2, 3+) and those right after a reply cut off (Ctrl-C, the token
                  limit; ``dsagent.corpus``). ``n`` counts records here, so a skill-f run has about
                  5n cases. Not in the default skills (SKILLS): asked for by name

Records of kinds a-e for a seed never change when a kind is added (``dsagent.corpus``), so
the default skills' cases stay the same.

Generation is greedy (temperature 0) and stops at EOS or after
``min(max_new_tokens, target tokens + SLACK)`` new tokens; a reply cut there is closed
with EOS, as the agent closes it. Speculative decoding is off in every mode but
``speculative``.

Scoring (0 or 1 per case):

  tool-call target  the completion parses (``model.dsml.parse_completion``) and its tool
                    calls, in order, have the target's names and JSON-equal arguments;
                    text before the calls is ignored
  text target       the reply text (the parsed content, or the raw completion up to EOS
                    when it does not parse) mentions every key fact of ``truth``, case-
                    and whitespace-insensitive, as whole words:
                    - ``truth["image"]`` (c, image sessions of e): its colour, its shape
                      kind (singular or plural) and its count (digit or word), and no other
                      colour, kind or count of the corpus vocabulary
                    - ``truth["value"]`` (d): the recalled value
                    - ``truth["answer"]`` (a, e, f): the answer, without trailing . ! ?
                    - ``truth["read"]`` (r; ``read_back_truth``): each value, name or
                      word of the reply that came from a tool result, with the
                      question's own expressions (``truth["unsaid"]``) cut out of the
                      reply first, so ``10 % 11 = 1`` does not pass for 10 by its 10;
                      a ``view_image`` result is scored as an image case

Modes, one column each:

  exact     Engine exact prefill: every prompt token through every layer
  ced       CED prefill with bounded decoder replay, the product default
  float-kv  CED with a ``KVFormat.FLOAT`` cache (unquantised): the reference the FP4
            cache is compared against
  resume    the prompt is logged into a sessions Store (a temporary home) by a real
            Agent (``add_history``: CED prefill, save point with KV chunks), that Agent
            is closed without a RAM pool (the local state is gone), a new Agent resumes
            the session from disk (stored global KV chunks + replay of the last window
            tokens) and generates the target (``reply``). A per-turn case (f) is saved
            between turns: the prompt without its turn's user message is logged, and the
            resumed Agent logs that message before it replies, as a chat resumed for its
            next question does
  speculative  CED prefill, then DSpark speculative decoding (greedy: the same tokens as
            ``ced`` but for float rounding flips, which ``identical_to_ced`` counts); per case
            its verify forwards, proposals drafted and accepted. Not in the default modes
            (MODES): asked for by name, of a checkpoint with draft stages
  prefix    another session (its prompt the case's system message and tools, then "Hello.")
            is stored first, once per system message, in a store the generator keeps; the
            case is then logged by a new Agent in that store, whose first prefill starts
            from that session's stored chunks of the shared prefix (whole chunks, 2,048
            tokens of the corpus's 2.2K-token system prompt) with the window before them
            replayed, and prefills only the rest; it generates the target in the same Agent,
            and its session is removed (no case reuses another case's chunks)

Beside the accuracy, the result reports per mode the fraction of cases whose reply is
identical to the ``ced`` reply (for ``float-kv``: FP4 vs float KV) and the seconds spent
(for resume: prefill, save, load, replay and generation; for prefix: the lookup, import,
replay, prefill, save and generation, without the one stored session each system message needs).
"""
from __future__ import annotations

import base64
import json
import re
import secrets
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Collection, Protocol, Sequence

import torch

from dsagent.agent import Agent, AgentOptions
from dsagent.corpus import (COLOURS, DEFAULT_KINDS, KINDS, NUMBER_WORDS, RECALL_PLACES, RECALL_TOKENS, SHAPES,
                            RecallStyle, make_record)
from dsagent.runtime import Runtime
from model.chat import EOS, encode_messages
from model.dsml import DSMLError, parse_completion
from model.dspark import Speculator, has_draft_stages
from model.engine import Engine, Sampling
from model.quant import KVFormat
from model.tokenizer import Tokenizer
from model.vision import expand_spans, image_inputs
from sessions import Store

HELD_OUT_SEED = 7919
# the corpus seeds the embedded default learnt from (model/assets/default/TRAINING.json)
TRAIN_SEEDS = (31, 34, 60, 74, 80, 82, 84, 90, 92, 94, 96, 97, 103, 137, 139, 151, 157, 163)
MODES = ("exact", "ced", "float-kv", "resume", "prefix")
SPECULATIVE = "speculative"  # asked for by name: CED with DSpark (a checkpoint with draft stages)
KNOWN_MODES = MODES + (SPECULATIVE,)
SKILLS = (*DEFAULT_KINDS, "r")  # the default: the corpus kinds a-e, and r: kind b's records cut after the tool results
TURN_SKILLS = ("f",)  # a case per turn (about five a record), asked for by name
KNOWN_SKILLS = (*SKILLS, *TURN_SKILLS)
SKILL_NAMES = {**KINDS, "r": "read_back"}
TURN_BUCKETS = ("1", "2", "3+")  # the turn indices a per-turn skill is reported by
SLACK = 16  # new tokens allowed beyond the target's length
MAX_NEW_TOKENS = 128


class EvalConfigError(ValueError):
    """Skills, modes or seed the evaluation cannot run with."""


# -- cases ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """A held-out record cut before its target assistant message."""
    id: str
    skill: str  # a-f, the record's kind, or r (a kind-b record's final reply)
    prompt: list[dict]  # the messages before the target
    target: dict  # the assistant message the model should produce
    truth: dict  # the record's ground truth
    images: dict[str, bytes]  # sha256 -> bytes of the prompt's image blocks
    thinking_mode: str
    expected: str  # the target rendered as the completion it was trained to be
    expected_tokens: int
    turn: int | None = None  # the 1-based turn of a per-turn case (skill f)
    after_cut: bool = False  # a per-turn case whose turn before ended in a reply cut off


def target_index(record: dict, skill: str) -> int:
    """Index of the target message in ``record["messages"]`` for ``skill`` (see the module docstring)."""
    messages = record["messages"]
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    calls = [i for i in replies if messages[i].get("tool_calls")]
    if skill == "b":
        return calls[0]
    if skill == "e" and calls:
        return calls[-1]
    return replies[-1]


def case_from_record(record: dict, tokenizer: Tokenizer, skill: str | None = None) -> Case:
    """``record`` cut before its target for ``skill`` (default its kind; r takes a kind-b record)."""
    skill = skill or record["kind"]
    cut = target_index(record, skill)
    prompt, target = record["messages"][:cut], record["messages"][cut]
    case_id = record["id"] if skill == record["kind"] else f"{record['id']}-{skill}"
    truth = read_back_truth(prompt, target, record["truth"]) if skill == "r" else record["truth"]
    return _cut(record, cut, tokenizer, case_id, skill, truth)


def turn_cases(record: dict, tokenizer: Tokenizer) -> list[Case]:
    """A mixed record (kind f) as a case per turn: cut before the turn's first assistant
    step, with that turn's own truth (``truth["turns"]``)."""
    messages = record["messages"]
    asked = [i for i, m in enumerate(messages) if m["role"] == "user"]
    assert len(asked) == len(record["truth"]["turns"]), record["id"]
    cuts = [next(i for i in range(start, len(messages)) if messages[i]["role"] == "assistant") for start in asked]
    turns = record["truth"]["turns"]
    return [_cut(record, cut, tokenizer, f"{record['id']}-t{t}", record["kind"], truth, t,
                 after_cut=t > 1 and "cut" in turns[t - 2], whole=_whole_reply(messages[cut], truth))
            for t, (cut, truth) in enumerate(zip(cuts, turns), 1)]


def _whole_reply(message: dict, truth: dict) -> dict | None:
    """The reply a turn's case targets where the record cut it off (its truth's ``cut``): the
    whole one, as it would have ended."""
    if "cut" not in truth or message.get("stop", "eos") == "eos":
        return None
    return {k: v for k, v in message.items() if k != "stop"} | {"content": truth["cut"]["reply"]}


def _cut(record: dict, cut: int, tokenizer: Tokenizer, case_id: str, skill: str, truth: dict,
         turn: int | None = None, after_cut: bool = False, whole: dict | None = None) -> Case:
    prompt, target = record["messages"][:cut], whole or record["messages"][cut]
    rendered = encode_messages([target], context=prompt, thinking_mode=record["thinking_mode"])
    images = {sha: base64.b64decode(data) for sha, data in record["images"].items()}
    return Case(case_id, skill, prompt, target, truth, images,
                record["thinking_mode"], rendered.text, len(rendered.tokenize(tokenizer).ids), turn, after_cut)


def read_back_truth(prompt: list[dict], reply: dict, truth: dict) -> dict:
    """What a reply after tool results must say (skill r): a picture's facts for a
    ``view_image`` result; else the words of ``reply`` that came from the results and not
    from the question (a calculator's value, a file's names, a count), beside the record's
    own answer and the folder it names where the record's folder has a name of its own
    (``truth["folder"]``: "The data folder has ..." does not answer for another folder), with
    the question's expressions as ``unsaid``."""
    if "image" in truth:
        return truth
    question = next(m for m in reversed(prompt) if m["role"] == "user")
    results = [m for m in prompt[max(i for i, m in enumerate(prompt) if m.get("tool_calls")):] if m["role"] == "tool"]
    said = set(_word_list(" ".join(m["content"] for m in results))) - set(_word_list(question["content"]))
    read = [w for w in dict.fromkeys(_word_list(reply["content"])) if w in said]
    if "answer" in truth and str(truth["answer"]) not in read:
        read.insert(0, str(truth["answer"]))
    for item in truth.get("arithmetic", []):  # "59.0" in the result is 59 in the reply
        if item["value"] not in read:
            read.append(item["value"])
    if truth.get("folder") in _word_list(reply["content"]):  # a folder named by a new word: the one asked for
        read.append(truth["folder"])
    return {"read": read, "unsaid": [item["expression"] for item in truth.get("arithmetic", [])]}


def _word_list(text: str) -> list[str]:
    return [w for w in (w.strip(".,:;!?()[]\"'") for w in text.split()) if w]


def make_cases(tokenizer: Tokenizer, *, n: int = 10, seed: int = HELD_OUT_SEED,
               skills: Sequence[str] = SKILLS, recall_tokens: tuple[int, int] = RECALL_TOKENS,
               recall_place: str = "first", words: str = "closed", casual: bool = False,
               tool_errors: bool = False, folder_words: bool = False) -> list[Case]:
    """``n`` cases per skill from records 0..n-1 of ``seed`` (a per-turn skill: a case for
    every turn of those records); recall logs drawn from ``recall_tokens`` tokens (the
    corpus default unless probing by length), their keys placed as ``recall_place`` says
    (``corpus.RECALL_PLACES``); names, files and phrasings from the lexicon ``words``
    ("closed", the corpus's, or "held-out", the generalisation split); with ``casual`` every
    question typed as people type them (``corpus.casual_text``: lower case, no closing
    punctuation, operators unspaced); with ``tool_errors`` every tool case (b, r) and each
    conversation's first file turn (f) asks for a file or folder the workspace lacks
    (``corpus.missing_question``); with ``folder_words`` the workspace's folder is named by a
    word of the lexicon, not ``data``, and every tool case (b, r) and each conversation's first
    file turn (f) lists it by that name (``corpus.make_files``)."""
    check_config(skills=skills, seed=seed, recall_tokens=recall_tokens, recall_place=recall_place, words=words)
    style = RecallStyle(place=recall_place)
    cases = []
    for skill in skills:
        for i in range(n):
            record = make_record(seed, i, "b" if skill == "r" else skill, tokenizer, tuple(recall_tokens), style,
                                 words, casual, tool_errors, folder_words)
            cases += turn_cases(record, tokenizer) if skill in TURN_SKILLS else [case_from_record(record, tokenizer, skill)]
    return cases


def check_config(*, skills: Sequence[str] = SKILLS, modes: Sequence[str] = MODES, seed: int = HELD_OUT_SEED,
                 recall_tokens: tuple[int, int] = RECALL_TOKENS, recall_place: str = "first",
                 words: str = "closed") -> None:
    """Raise EvalConfigError for an unknown skill or mode, an empty list, the training seed,
    a recall length range that is not 1 <= LO <= HI, an unknown recall place, or words other
    than closed or held-out."""
    if len(recall_tokens) != 2 or not 1 <= recall_tokens[0] <= recall_tokens[1]:
        raise EvalConfigError(f"recall tokens must be LO,HI with 1 <= LO <= HI, not {recall_tokens}")
    if recall_place not in RECALL_PLACES:
        raise EvalConfigError(f"unknown recall place {recall_place!r}: use one of {','.join(RECALL_PLACES)}")
    if words not in ("closed", "held-out"):  # the open vocabulary's training half is never evaluated
        raise EvalConfigError(f"unknown words {words!r}: use closed (the corpus's lists) or held-out (the open "
                              f"vocabulary's half that training never draws from)")
    for what, given, known in (("skill", skills, KNOWN_SKILLS), ("mode", modes, KNOWN_MODES)):
        bad = [x for x in given if x not in known]
        if bad or not given:
            raise EvalConfigError(f"unknown {what}(s) {bad}: use some of {','.join(known)}")
    if seed in TRAIN_SEEDS:
        raise EvalConfigError(f"seed {seed} is a training corpus; pick a held-out seed "
                              f"(default {HELD_OUT_SEED})")


# -- scoring ----------------------------------------------------------------------------

def score(case: Case, completion: str) -> int:
    """1 when ``completion`` (the decoded reply, EOS included) meets the case's rule."""
    if case.target.get("tool_calls"):
        return score_tool_calls(case.target["tool_calls"], completion, case.thinking_mode)
    return score_text(case.truth, reply_text(completion, case.thinking_mode))


def score_tool_calls(expected: list[dict], completion: str, thinking_mode: str = "chat") -> int:
    try:
        got = parse_completion(completion, thinking_mode)["tool_calls"]
    except DSMLError:
        return 0
    return int(bool(got) and [_call_key(c) for c in got] == [_call_key(c) for c in expected])


def _call_key(call: dict) -> tuple[str, Any]:
    function, args = call["function"], call["function"]["arguments"]
    try:
        return function["name"], json.loads(args) if isinstance(args, str) else args
    except ValueError:
        return function["name"], None  # not JSON: equal to no target


def reply_text(completion: str, thinking_mode: str = "chat") -> str:
    """The reply's content; the raw text up to EOS when it does not parse."""
    try:
        return parse_completion(completion, thinking_mode)["content"]
    except DSMLError:
        return completion.split(EOS, 1)[0]


def score_text(truth: dict, text: str) -> int:
    for phrase in truth.get("unsaid", ()):
        text = _whole(phrase).sub(" ", " ".join(text.split()))
    required, forbidden = key_facts(truth)
    return int(all(any(_mentions(text, p) for p in group) for group in required)
               and not any(_mentions(text, p) for p in forbidden))


def key_facts(truth: dict) -> tuple[list[list[str]], list[str]]:
    """(groups of phrases, one of each must be mentioned; phrases none may be mentioned)."""
    if "image" in truth:
        colour, kind, count = truth["image"]["colour"], truth["image"]["kind"], truth["image"]["count"]
        counts = [[str(k), word] for k, word in enumerate(NUMBER_WORDS)]
        required = [[colour], [kind, kind + "s"], counts[count]]
        forbidden = [c for c in COLOURS if c != colour] + [f"{s}{p}" for s in SHAPES if s != kind for p in ("", "s")] \
            + [w for k, pair in enumerate(counts) if k != count for w in pair]
        return required, forbidden
    if "value" in truth:
        return [[truth["value"]]], []
    if "read" in truth:
        return [[w] for w in truth["read"]], []
    return [[str(truth["answer"]).rstrip(".!?")]], []


def _mentions(text: str, phrase: str) -> bool:
    return _whole(phrase).search(" ".join(text.split())) is not None


def _whole(phrase: str) -> re.Pattern:
    """``phrase`` as whole words, any case, its whitespace as single spaces (the texts it
    is matched in are joined so too)."""
    return re.compile(rf"(?<!\w){re.escape(' '.join(phrase.split()))}(?!\w)", re.IGNORECASE)


# -- generation -------------------------------------------------------------------------

@dataclass
class Completion:
    text: str  # the decoded reply, EOS included
    stats: dict = field(default_factory=dict)  # mode-specific counts (tokens, cache use)


class Generator(Protocol):
    def complete(self, case: Case, mode: str) -> Completion: ...


def prompt_inputs(rt: Runtime, case: Case) -> tuple[torch.Tensor, tuple | None]:
    """The prompt as the agent logs it: ids [1, N] with every image placeholder expanded to
    its span, and (embeds [1, N, D], mask [1, N]) of the spans, or None without images."""
    rendered = encode_messages(case.prompt, thinking_mode=case.thinking_mode, literal_placeholders=True)
    tokens = rendered.tokenize(rt.tokenizer)
    spans = [rt.image_span(case.images[image["url"].removeprefix("sha256:")])[1] for image in rendered.images]
    ids, _ = expand_spans(tokens.ids, tokens.image_positions, [s.shape[0] for s in spans], rt.args.image_token_id)
    ids = torch.tensor([ids], device=rt.model.device)
    return ids, image_inputs(ids, rt.args.image_token_id, spans) if spans else None


class ModelGenerator:
    """The real model in the five modes; greedy, budget per case (module docstring).
    ``store_home``: where resume and prefix sessions are stored (kept); default temporary
    homes (the prefix mode's lives until :meth:`close`)."""

    def __init__(self, runtime: Runtime, *, max_new_tokens: int = MAX_NEW_TOKENS, store_home: Path | None = None):
        model, chunk, limit = runtime.model, runtime.engine.chunk, runtime.engine.max_context
        self.engines = {mode: Engine(model, mode=mode, chunk=chunk, max_context=limit) for mode in ("exact", "ced")}
        self.rt = Runtime(model, runtime.tokenizer, self.engines["ced"], runtime.fingerprint, runtime.source)
        self.max_new_tokens, self.store_home = max_new_tokens, store_home
        self._kept = ExitStack()  # the prefix mode's store, open across cases
        self._prefix_store: Store | None = None
        self._stored_prefixes: set[str] = set()

    def close(self) -> None:
        self._kept.close()
        self._prefix_store = None

    def budget(self, case: Case) -> int:
        return min(self.max_new_tokens, case.expected_tokens + SLACK)

    def complete(self, case: Case, mode: str) -> Completion:
        if mode == "resume":
            return self._resumed(case)
        if mode == "prefix":
            return self._prefixed(case)
        kv = KVFormat.FLOAT if mode == "float-kv" else KVFormat.PACKED
        engine = self.engines["exact" if mode == "exact" else "ced"]
        state = engine.new_state(kv=kv)
        ids, images = prompt_inputs(self.rt, case)
        engine.prefill(state, ids, images=images)
        eos = self.rt.tokenizer.eos_id
        params = Sampling(max_new_tokens=self.budget(case), stop_ids=(eos,))
        stats = {"prompt_tokens": ids.shape[1]}
        if mode == SPECULATIVE:  # a drafter of its own per case: no context carried from another
            spec = Speculator(self.rt.model, engine)
            out = list(spec.generate(state, params, ids[0]))
            stats |= {"verify_forwards": spec.stats.forwards, "drafted": spec.stats.drafted,
                      "accepted": spec.stats.accepted, "emitted": spec.stats.emitted}
        else:
            out = list(engine.generate(state, params))
        stats["completion_tokens"] = len(out)
        if not out or out[-1] != eos:
            out.append(eos)  # closed as the agent closes a cut reply
        return Completion(self.rt.tokenizer.decode(out), stats)

    def _resumed(self, case: Case) -> Completion:
        """Log the prompt in a store, drop the live state, resume from disk, then reply; a
        per-turn case is saved before its turn's user message, which the resumed Agent logs."""
        split = len(case.prompt) - 1 if case.turn else len(case.prompt)
        with ExitStack() as stack:
            home = self.store_home or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dsagent-eval-")))
            store = stack.enter_context(Store.open(home))
            opts = self._options(case, home, prefix_cache=False)  # its own KV only: the yardstick
            with Agent(self.rt, store, opts) as agent:
                agent.add_history(case.prompt[:split], case.images)
            with Agent(self.rt, store, opts) as agent:  # no RAM pool: resumed from disk
                resumed = len(agent.log)
                if split < len(case.prompt):
                    agent.add_history(case.prompt[split:], case.images)
                start = len(agent.log)
                agent.reply()
                out, usage = agent.log[start:], asdict(agent.usage)
        return Completion(self.rt.tokenizer.decode(out),
                          {**usage, "session": opts.session, "log_tokens": start, "resumed_tokens": resumed})

    def _options(self, case: Case, home: Path, **kw) -> AgentOptions:
        return AgentOptions(session=f"eval-{case.id}-{secrets.token_hex(3)}", thinking_mode=case.thinking_mode,
                            workspace=home, sampling=Sampling(max_new_tokens=self.budget(case)), speculative=False,
                            **kw)

    def _prefixed(self, case: Case) -> Completion:
        """A new session over a store where another session already holds the case's system prompt.
        The case's session is removed after it, so that no case reuses another case's chunks."""
        store = self._store_for_prefix(case)
        with Agent(self.rt, store, self._options(case, store.home)) as agent:
            agent.add_history(case.prompt, case.images)
            start = len(agent.log)
            agent.reply()
            out, usage = agent.log[start:], asdict(agent.usage)
        store.rm(agent.name)
        return Completion(self.rt.tokenizer.decode(out), {**usage, "log_tokens": start})

    def _store_for_prefix(self, case: Case) -> Store:
        """The kept store, holding a session that began with the case's system message (stored once)."""
        if self._prefix_store is None:
            home = self.store_home or self._kept.enter_context(tempfile.TemporaryDirectory(prefix="dsagent-eval-"))
            self._prefix_store = self._kept.enter_context(Store.open(Path(home)))
        system = case.prompt[0]
        key = json.dumps([system, case.thinking_mode], sort_keys=True)
        if key not in self._stored_prefixes:
            opts = replace(self._options(case, self._prefix_store.home), session=f"eval-system-{secrets.token_hex(3)}")
            with Agent(self.rt, self._prefix_store, opts) as agent:
                agent.add_history([system, {"role": "user", "content": "Hello."}])
            self._stored_prefixes.add(key)
        return self._prefix_store


# -- the evaluation ---------------------------------------------------------------------

@dataclass
class CaseResult:
    case: str
    skill: str
    mode: str
    score: int
    reply: str
    seconds: float
    stats: dict
    turn: int | None = None  # the case's turn (per-turn skills)
    after_cut: bool = False  # the turn before it ended in a reply cut off
    asks: str | None = None  # what the turn asks (its truth's skill: chat, calc, file, back, ...; per-turn skills)


def in_turns(turn: int | None, key: str) -> bool:
    """Whether a case of ``turn`` counts under ``key``: a turn index ("2") or that index and
    every later one ("3+")."""
    if turn is None:
        return False
    return turn >= int(key[:-1]) if key.endswith("+") else turn == int(key)


@dataclass
class EvalResult:
    skills: list[str]
    modes: list[str]
    results: list[CaseResult]
    seed: int | None = None
    recall_tokens: tuple[int, int] = RECALL_TOKENS
    recall_place: str = "first"  # where the recall cases' asked key lies among its decoys (corpus.RECALL_PLACES)
    words: str = "closed"  # the lexicon the cases' names come from (closed or held-out)
    casual: bool = False  # the questions typed casually (corpus.casual_text)
    tool_errors: bool = False  # the file questions ask for what the workspace lacks (corpus.missing_question)
    folder_words: bool = False  # the workspace's folder named by a word of the lexicon, and listed by it

    def cell(self, skill: str, mode: str) -> tuple[int, int]:
        """(correct, n) of one skill in one mode."""
        rs = [r for r in self.results if r.skill == skill and r.mode == mode]
        return sum(r.score for r in rs), len(rs)

    def turn_cell(self, skill: str, mode: str, turns: str, asks: Collection[str] | None = None) -> tuple[int, int]:
        """(correct, n) of one per-turn skill's cases of ``turns`` (see :func:`in_turns`) in one
        mode; with ``asks``, only the turns that ask one of those (:attr:`CaseResult.asks`)."""
        rs = [r for r in self.results if r.skill == skill and r.mode == mode and in_turns(r.turn, turns)
              and (asks is None or r.asks in asks)]
        return sum(r.score for r in rs), len(rs)

    def turn_asks(self, skill: str, turn: int | None = None) -> list[str]:
        """What a per-turn skill's cases ask (of turn ``turn`` only, if given). A later turn may
        also refer back (to a result or a fact told earlier), which no first turn can: counting
        the later turns over what turn 1 asks compares like with like."""
        return sorted({r.asks for r in self.results if r.skill == skill and r.asks is not None
                       and turn in (None, r.turn)})

    def after_cut_cell(self, skill: str, mode: str) -> tuple[int, int]:
        """(correct, n) of one per-turn skill's cases that follow a reply cut off, in one mode."""
        rs = [r for r in self.results if r.skill == skill and r.mode == mode and r.after_cut]
        return sum(r.score for r in rs), len(rs)

    def turn_skills(self) -> list[str]:
        """The skills whose cases are turns."""
        return [s for s in self.skills if any(r.skill == s and r.turn is not None for r in self.results)]

    def turn_indices(self, skill: str) -> list[int]:
        return sorted({r.turn for r in self.results if r.skill == skill and r.turn is not None})

    def accuracy(self, skill: str, mode: str) -> float:
        correct, n = self.cell(skill, mode)
        return correct / n if n else 0.0

    def seconds(self, mode: str) -> float:
        return sum(r.seconds for r in self.results if r.mode == mode)

    def speculation(self, mode: str = SPECULATIVE) -> dict | None:
        """DSpark over ``mode``'s cases (None where it did not run): per verify forward the
        proposals accepted and the tokens emitted (accepted + the bonus token), the
        proposals the confidence head chose to verify, and the share of them accepted."""
        stats = [r.stats for r in self.results if r.mode == mode and "verify_forwards" in r.stats]
        if not stats:
            return None
        total = {k: sum(s[k] for s in stats) for k in ("verify_forwards", "drafted", "accepted", "emitted")}
        n = max(1, total["verify_forwards"])
        return total | {"accepted_per_verify": total["accepted"] / n, "tokens_per_verify": total["emitted"] / n,
                        "block_length": total["drafted"] / n,
                        "acceptance_rate": total["accepted"] / max(1, total["drafted"])}

    def identical_to_ced(self, mode: str) -> float | None:
        """Fraction of cases whose ``mode`` reply equals the ``ced`` reply (None without ced)."""
        ced = {r.case: r.reply for r in self.results if r.mode == "ced"}
        pairs = [(r.reply, ced[r.case]) for r in self.results if r.mode == mode and r.case in ced]
        return sum(a == b for a, b in pairs) / len(pairs) if pairs else None

    def to_json(self) -> dict:
        """The result; with per-turn skills also ``turns`` (their cases by TURN_BUCKETS),
        ``turn_index`` (by each turn index), ``after_cut`` (the cases after a reply cut
        off), ``turns_first_asks`` (by TURN_BUCKETS, only the turns that ask what a first turn
        asks: :meth:`turn_asks`) and ``turn_asks`` (by what a turn asks, then
        TURN_BUCKETS), per skill and mode."""
        cells = {s: {m: _cell_json(*self.cell(s, m)) for m in self.modes} for s in self.skills}
        out = {"seed": self.seed, "recall_tokens": list(self.recall_tokens), "recall_place": self.recall_place,
               "words": self.words, "casual": self.casual, "tool_errors": self.tool_errors,
               "folder_words": self.folder_words, "skills": self.skills,
               "modes": self.modes, "accuracy": cells}
        if self.turn_skills():
            out["turns"] = self._turns_json(lambda s: TURN_BUCKETS)
            out["turn_index"] = self._turns_json(lambda s: [str(t) for t in self.turn_indices(s)])
            out["after_cut"] = {s: {m: _cell_json(*self.after_cut_cell(s, m)) for m in self.modes}
                                for s in self.turn_skills()}
            out["turns_first_asks"] = self._turns_json(lambda s: TURN_BUCKETS, lambda s: self.turn_asks(s, turn=1))
            out["turn_asks"] = {s: {m: {a: {k: _cell_json(*self.turn_cell(s, m, k, (a,))) for k in TURN_BUCKETS}
                                        for a in self.turn_asks(s)} for m in self.modes}
                                for s in self.turn_skills()}
        if SPECULATIVE in self.modes:
            out["speculation"] = self.speculation()
        return out | {"identical_to_ced": {m: self.identical_to_ced(m) for m in self.modes if m != "ced"},
                      "seconds": {m: round(self.seconds(m), 3) for m in self.modes},
                      "cases": [asdict(r) for r in self.results]}

    def _turns_json(self, keys: Callable[[str], Sequence[str]],
                    asks: Callable[[str], Collection[str] | None] = lambda s: None) -> dict:
        return {s: {m: {k: _cell_json(*self.turn_cell(s, m, k, asks(s))) for k in keys(s)} for m in self.modes}
                for s in self.turn_skills()}


def _cell_json(correct: int, n: int) -> dict:
    return {"correct": correct, "n": n, "accuracy": correct / n if n else 0.0}


def evaluate(generator: Generator, cases: Sequence[Case], modes: Sequence[str] = MODES, *,
             progress: Callable[[int, int], None] | None = None) -> EvalResult:
    """Every case in every mode, scored. ``progress(done, total)`` after each reply."""
    check_config(modes=modes)
    results, total = [], len(cases) * len(modes)
    for case in cases:
        for mode in modes:
            start = time.perf_counter()
            c = generator.complete(case, mode)
            results.append(CaseResult(case.id, case.skill, mode, score(case, c.text), c.text,
                                      time.perf_counter() - start, c.stats, case.turn, case.after_cut,
                                      case.truth.get("skill") if case.turn is not None else None))
            if progress is not None:
                progress(len(results), total)
    skills = list(dict.fromkeys(c.skill for c in cases))
    return EvalResult(skills, list(modes), results)


def run_eval(runtime: Runtime, *, n: int = 10, seed: int = HELD_OUT_SEED, skills: Sequence[str] = SKILLS,
             modes: Sequence[str] = MODES, max_new_tokens: int = MAX_NEW_TOKENS,
             recall_tokens: tuple[int, int] = RECALL_TOKENS, recall_place: str = "first", words: str = "closed",
             casual: bool = False, tool_errors: bool = False, folder_words: bool = False,
             progress: Callable[[int, int], None] | None = None) -> EvalResult:
    """The held-out evaluation of ``runtime``'s model: ``n`` cases per skill, every mode."""
    if SPECULATIVE in modes and not has_draft_stages(runtime.model):
        raise EvalConfigError("the speculative mode needs a checkpoint with DSpark draft stages (mtp.*); "
                              "this one has none")
    cases = make_cases(runtime.tokenizer, n=n, seed=seed, skills=skills, recall_tokens=recall_tokens,
                       recall_place=recall_place, words=words, casual=casual, tool_errors=tool_errors,
                       folder_words=folder_words)
    generator = ModelGenerator(runtime, max_new_tokens=max_new_tokens)
    try:
        result = evaluate(generator, cases, modes, progress=progress)
    finally:
        generator.close()
    result.seed, result.recall_tokens, result.recall_place = seed, tuple(recall_tokens), recall_place
    result.words, result.casual, result.tool_errors, result.folder_words = words, casual, tool_errors, folder_words
    return result
