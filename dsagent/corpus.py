"""The synthetic training corpus of the embedded default model (issue 11), record by record.

Owns: building one conversation per record in the shape the agent really produces
(DEFAULT_SYSTEM with every built-in tool schema, OpenAI-style messages, DSML tool calls
as `tool_calls`, tool results as `tool` messages, images as `sha256:` image blocks),
for six kinds:

  a  chat        short questions about this runtime and simple facts
  b  tools       calculator arithmetic, read_file / list_dir questions, a shell command,
                 view_image; the tools really run in a temporary workspace
  c  images      Pillow-drawn shapes (colour, kind, count) to describe or count
  d  recall      a `key: value` planted early in 2,000-6,000 tokens of filler, asked at the end
  e  multi_turn  sessions whose later turns depend on earlier answers or results
  f  mixed       2-8 turns of a-c's questions in random order, with facts the user tells and
                 later asks back and calculations that refer back ("and that times 3?"); every
                 other turn is answered from its own question and tool results; some replies
                 cut off (Ctrl-C, the token limit) before the next turn

Beside the kinds, ``echo_record`` makes drills a trainer joins to its steps: a request to repeat a
text of random letters, open words, file names and numbers — the copying every new name needs.

The default mixture (DEFAULT_KINDS, what make_corpus writes unless told otherwise) is a-e;
kind f is asked for by name (`make_corpus.py --kinds`, `train_default.py --schedule`), so
the records of a-e for a seed stay what they were.

Every record carries its ground truth (`truth`) so tests and evaluations can check it,
and `encode_record` turns one into token ids plus the mask of trained (assistant) ids
the way the agent appends turns. Each record draws from its own RNG seeded by
(CORPUS_VERSION, seed, index), so records are independent and the corpus is
byte-for-byte reproducible.

Does not own: writing shards and the manifest (scripts/make_corpus.py) or training
(model.training, scripts/train_default.py); `training_example` only lays a record out
as the agent's token log.
"""

from __future__ import annotations

import base64
import copy
import functools
import io
import json
import random
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from PIL import Image, ImageDraw

from dsagent.lexicon import LEXICONS, Lexicon
from dsagent.prompt import DEFAULT_SYSTEM
from model.args import ModelArgs
from model.chat import Conversation
from model.draft_training import reply_spans
from model.tokenizer import Tokenizer
from model.training import Example
from model.vision import decode_image, expand_spans, image_sha256, plan_image, span_length
from tools import ToolResult, ToolRunner, Workspace, builtin_toolbox

CORPUS_VERSION = 3  # 2: echo requests in (a), more calculator in (b); 3: recall values all digits
THINKING_MODE = "chat"  # the agent's default; every completion follows `</think>`
KINDS = {"a": "chat", "b": "tools", "c": "images", "d": "recall", "e": "multi_turn", "f": "mixed"}
DEFAULT_KINDS = "abcde"  # the mixture the default learnt from; f came later and is asked for by name
TRAIN_ROLES = ["assistant"]

COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 70, 220),
           "yellow": (240, 210, 20), "orange": (245, 130, 20), "purple": (140, 50, 170)}
BACKGROUNDS = [(255, 255, 255), (235, 235, 235), (20, 20, 20)]
SHAPES = ("circle", "square", "triangle")
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six"]
IMAGE_SIDE, GRID = 126, 3  # 3x3 cells of 42 px: shapes never touch
RECALL_TOKENS = (2000, 6000)
# how a recall log states a key: "colon" is this corpus version's; "is" says it in the answer's
# words (`badge id of lumen is UBE-2192`), an experiment's (docs/default-model-training.md, 2026-12-01)
RECALL_FORMS = {"colon": "{key}: {value}", "is": "{key} is {value}"}
# what a planted value looks like: "digits" (`4417-2192`) is this corpus version's, "mixed"
# (`UBE-2192`) version 2's. A model learns to look the digits up and not the capitals: no filler
# line holds a digit, while a capital starts every filler line's names and days, so a capital
# does not point at the value (docs/default-model-training.md, 2026-12-02)
RECALL_VALUES = ("digits", "mixed")
# where the asked key lies: "first" (this corpus version's) plants it in the log's first fifth and its
# decoys after it, so that a model answering with the first key of the asked kind passes; "any" plants
# the key and each decoy anywhere, so that decoys of the same kind often come first (issue 53: the
# default answered with the first planted value of the asked kind)
RECALL_PLACES = ("first", "any")


@dataclass(frozen=True)
class RecallStyle:
    """How a recall record is written. The default is this corpus version's; the others are
    trainers' experiments, and a record written otherwise names what differs in its truth
    (``style``)."""

    form: str = "colon"  # a key of RECALL_FORMS
    value: str = "digits"  # one of RECALL_VALUES
    decoys: bool = True  # keys of the same kind for other owners
    place: str = "first"  # one of RECALL_PLACES: where the asked key lies among its decoys

    def __post_init__(self) -> None:
        if self.form not in RECALL_FORMS or self.value not in RECALL_VALUES or self.place not in RECALL_PLACES:
            raise ValueError(f"unknown recall style {self}")

    def differences(self) -> dict[str, Any]:
        """The fields where this style is not the corpus's own."""
        return {f: v for f, v in vars(self).items() if v != getattr(RecallStyle(), f)}

    @classmethod
    def of(cls, a) -> RecallStyle:
        """The style that :func:`add_recall_style_arguments`' flags ask for."""
        return cls(a.recall_form, a.recall_value, a.recall_decoys, a.recall_place)


def add_recall_style_arguments(p) -> None:
    """The flags of a script that writes recall records in another style (the trainer, the
    probe): ``--recall-form``, ``--recall-value``, ``--no-recall-decoys``; read with
    ``RecallStyle.of``."""
    p.add_argument("--recall-form", choices=sorted(RECALL_FORMS), default=RecallStyle().form,
                   help="how a recall log states its keys: colon (the corpus's: `badge id of lumen: 4417-2192`) or "
                        "is (in the answer's words: `badge id of lumen is 4417-2192`), an experiment's")
    p.add_argument("--recall-value", choices=RECALL_VALUES, default=RecallStyle().value,
                   help="what a planted value looks like: digits (the corpus's: `4417-2192`) or mixed "
                        "(`UBE-2192`, corpus version 2's: capitals also start the filler's names), an experiment's")
    p.add_argument("--no-recall-decoys", dest="recall_decoys", action="store_false",
                   help="recall logs without the other owners' keys of the same kind (the lookup then needs "
                        "no key, as in a pass-key test), an experiment's")
    p.add_argument("--recall-place", choices=RECALL_PLACES, default=RecallStyle().place,
                   help="where the asked key lies: first (the corpus's: in the log's first fifth, its decoys "
                        "after) or any (the key and each decoy anywhere: decoys often come first)")


# -- one conversation -------------------------------------------------------------------

@functools.cache
def _schemas() -> list[dict[str, Any]]:
    """The built-in tools' schemas, built once a process (a toolbox from the functions' signatures
    took ~9% of a record's generation)."""
    return builtin_toolbox().schemas()


@dataclass
class Builder:
    """A conversation under construction; tool calls run for real in `workspace`."""

    rng: random.Random
    workspace: Path | None = None
    lex: Lexicon = field(default_factory=lambda: lexicon("closed"))  # where its names come from
    messages: list[dict[str, Any]] = field(default_factory=list)
    images: dict[str, bytes] = field(default_factory=dict)
    truth: dict[str, Any] = field(default_factory=dict)
    calls: int = 0
    tool_errors: bool = False  # its file question asks for a file or folder the workspace lacks
    folder_words: bool = False  # its folder is named by a word of its lexicon, not "data", and listed
    folder: str = "data"  # the workspace's folder (make_files)

    def __post_init__(self) -> None:
        self.messages.append({"role": "system", "content": DEFAULT_SYSTEM, "tools": copy.deepcopy(_schemas())})

    def user(self, text: str, image: bytes | None = None) -> None:
        if image is None:
            self.messages.append({"role": "user", "content": text})
            return
        blocks = [{"type": "text", "text": text}, self.image_block(image)]
        self.messages.append({"role": "user", "content": blocks if self.rng.random() < 0.5 else blocks[::-1]})

    def say(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})

    def image_block(self, data: bytes) -> dict[str, Any]:
        sha = image_sha256(data)
        self.images[sha] = data
        return {"type": "image_url", "image_url": {"url": f"sha256:{sha}"}}

    def call(self, *calls: tuple[str, dict[str, Any]]) -> list[ToolResult]:
        """One assistant step with these tool calls, then their real results."""
        ids = [f"call_{self.calls + i}" for i in range(len(calls))]
        self.calls += len(calls)
        self.messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            for cid, (name, args) in zip(ids, calls)]})
        results = [self.run(name, args) for name, args in calls]
        for cid, res in zip(ids, results):
            content = [{"type": "text", "text": res.text}] + [self.image_block(d) for d in res.images]
            self.messages.append({"role": "tool", "tool_call_id": cid,
                                  "content": content if res.images else res.text})
        return results

    def run(self, name: str, args: dict[str, Any]) -> ToolResult:
        assert self.workspace is not None, "tool calls need a workspace"
        return ToolRunner(builtin_toolbox(), Workspace(self.workspace), policy="yes").run(name, args)

    def record(self, rid: str, kind: str) -> dict[str, Any]:
        return {"id": rid, "kind": kind, "version": CORPUS_VERSION, "thinking_mode": THINKING_MODE,
                "messages": self.messages, "train_mask_roles": TRAIN_ROLES, "truth": self.truth,
                "images": {sha: base64.b64encode(d).decode("ascii") for sha, d in self.images.items()}}


def make_record(seed: int, index: int, kind: str, tokenizer: Tokenizer,
                recall_tokens: tuple[int, int] = RECALL_TOKENS, recall: RecallStyle = RecallStyle(),
                words: str = "closed", casual: bool = False, tool_errors: bool = False,
                folder_words: bool = False) -> dict[str, Any]:
    """Record `index` of the corpus for `seed`, of kind a-f; a recall record's log is drawn
    from ``recall_tokens`` (a trainer may start shorter; the evaluation keeps the default) and
    written in the ``recall`` style; its names from the lexicon ``words`` (LEXICONS: the
    closed lists, or a half of the open vocabulary, which the truth then names). ``casual``:
    its questions typed as people type them (:func:`casual_record`), the truth saying so.
    ``tool_errors``: a tool record's question (kind b), or a conversation's first file turn
    (kind f), asks for a file or folder the workspace lacks (:func:`missing_question`).
    ``folder_words``: the workspace's folder is named by a word of the lexicon, not ``data``
    (:func:`make_files`), and a tool record's question (kind b), or a conversation's first file
    turn (kind f), asks for that folder's files by its name (:func:`list_question`); the other
    questions about it say that name too."""
    rng = random.Random(f"dsagent-corpus:{CORPUS_VERSION}:{seed}:{index}")
    rid = f"{seed}-{index:07d}-{kind}"
    with tempfile.TemporaryDirectory(prefix="corpus-ws-") as tmp:
        b = Builder(rng, Path(tmp), lex=lexicon(words), tool_errors=tool_errors, folder_words=folder_words)
        if kind == "d":
            recall_conversation(b, tokenizer, recall_tokens, recall)
        else:
            {"a": chat_conversation, "b": tool_conversation, "c": image_conversation,
             "e": multi_turn_conversation, "f": mixed_conversation}[kind](b)
        if words != "closed":
            b.truth["words"] = words
        record = b.record(rid, kind)
    if casual:
        casual_record(record, random.Random(f"dsagent-casual:{seed}:{index}"))
    return record


# -- questions as people type them -----------------------------------------------------

CASUAL_MAX = 160  # longer user messages (documents, logs to recall from) are left as written
_SPACED_OP = re.compile(r"(?<=[\d)]) (\*\*|//|[-+*/%×]) (?=[\d(])")


def casual_text(rng: random.Random, text: str) -> str:
    """A question as a person types it: each of three slips with even odds — the first letter
    in lower case, no closing "?" or ".", an expression's operators without their spaces
    (``37 * 23`` -> ``37*23``) — at least one of them where it can apply. An echo request
    (ECHO_ASKS), a message of several lines or one over CASUAL_MAX characters is left as it
    is: what it asks to be copied must stay as written."""
    if "\n" in text or len(text) > CASUAL_MAX or text.startswith(_ECHO_OPENINGS):
        return text
    slips = [
        lambda t: t[0].lower() + t[1:] if t[:1].isupper() and t[1:2].islower() else t,
        lambda t: t[:-1] if t[-1:] in "?." and t[-2:-1] not in " ." else t,
        lambda t: _SPACED_OP.sub(r"\1", t),
    ]
    can = [slip for slip in slips if slip(text) != text]
    if not can:
        return text
    chosen = [slip for slip in can if rng.random() < 0.5] or [rng.choice(can)]
    for slip in chosen:
        text = slip(text)
    return text


def casual_record(record: dict[str, Any], rng: random.Random) -> None:
    """Every user message of ``record`` (its text, or its text blocks) through :func:`casual_text`,
    in place; the truth gets ``"casual": True``. The replies, tool calls and truth stay: the
    model must read ``what is 37*23`` as ``What is 37 * 23?``."""
    for m in record["messages"]:
        if m["role"] != "user":
            continue
        if isinstance(m["content"], str):
            m["content"] = casual_text(rng, m["content"])
        else:
            for block in m["content"]:
                if block.get("type") == "text":
                    block["text"] = casual_text(rng, block["text"])
    record["truth"]["casual"] = True


def casual_for(seed: int, index: int, share: float) -> bool:
    """Whether record ``index`` of a corpus with ``share`` of its records typed casually is one
    (a draw of its own, as :func:`words_for`'s)."""
    return share > 0 and random.Random(f"casual:{seed}:{index}").random() < share


def tool_errors_for(seed: int, index: int, share: float) -> bool:
    """Whether record ``index`` of a corpus with ``share`` of its tool and conversation records
    asking for what the workspace lacks is one (a draw of its own, as :func:`casual_for`'s)."""
    return share > 0 and random.Random(f"tool-errors:{seed}:{index}").random() < share


def folder_words_for(seed: int, index: int, share: float) -> bool:
    """Whether record ``index`` of a corpus with ``share`` of its workspaces' folders named by a
    word of the lexicon is one (a draw of its own, as :func:`casual_for`'s)."""
    return share > 0 and random.Random(f"folder-words:{seed}:{index}").random() < share


def words_for(seed: int, index: int, open_share: float) -> str:
    """The lexicon of record ``index`` of a corpus that draws ``open_share`` of its records'
    names from the open vocabulary: "open" (its training half) or "closed", by a draw of its
    own (the record's own draws are the same either way)."""
    return "open" if open_share > 0 and random.Random(f"words:{seed}:{index}").random() < open_share else "closed"


# The per-record shares a corpus writer or a trainer draws (scripts/make_corpus.py, train_default.py):
# a share's name (its flag: --open-words) -> (make_record's keyword, the draw of record i of a seed at a
# share, what its share is of).
RECORD_SHARES: dict[str, tuple[str, Callable[[int, int, float], Any], str]] = {
    "open_words": ("words", words_for, "share of records whose names, files and keys are generated words of the open "
                                       "vocabulary's training half (dsagent.lexicon), not the corpus's word lists"),
    "casual": ("casual", casual_for, "share of records whose questions are typed as people type them: lower case "
                                     "first, no closing ? or ., 37*23 for 37 * 23 (casual_text)"),
    "tool_errors": ("tool_errors", tool_errors_for, "share of tool records (b) and conversations (f) whose file "
                                                    "question asks for a file or folder the workspace lacks: the "
                                                    "tool's error, then a reply that says so (missing_question)"),
    "folder_words": ("folder_words", folder_words_for, "share of records whose workspace folder is named by a word "
                                                       "of their lexicon, not data; their tool question (b) and a "
                                                       "conversation's (f) first file question list it by that name"),
}


def add_record_share_arguments(p) -> None:
    """The flags of a script that draws records with per-record shares (the corpus writer, the
    trainer): ``--open-words``, ``--casual``, ... one per RECORD_SHARES name; read with
    :func:`record_shares`."""
    for name, (_, _, help_text) in RECORD_SHARES.items():
        p.add_argument("--" + name.replace("_", "-"), type=float, default=0.0, metavar="SHARE", help=help_text)


def record_shares(args) -> dict[str, float]:
    """The shares :func:`add_record_share_arguments`' flags parsed into ``args``, by name."""
    return {name: getattr(args, name) for name in RECORD_SHARES}


def record_options(seed: int, index: int, shares: dict[str, float]) -> dict[str, Any]:
    """make_record's keywords for record ``index`` of a ``seed``'s corpus drawn with ``shares``
    (names of RECORD_SHARES; a share absent or 0 draws nothing: make_record's default)."""
    return {RECORD_SHARES[name][0]: RECORD_SHARES[name][1](seed, index, share)
            for name, share in shares.items() if share}


@functools.cache
def lexicon(name: str) -> Lexicon:
    """The lexicon ``name`` (one of LEXICONS): the closed lists WORDS and NAMES; "open", the
    open vocabulary's training half; "held-out", its other half (the evaluation's)."""
    if name not in LEXICONS:
        raise ValueError(f"unknown lexicon {name!r}: use one of {', '.join(LEXICONS)}")
    return Lexicon(name, WORDS, NAMES, {"closed": None, "open": "train", "held-out": "held-out"}[name])


def encode_record(record: dict[str, Any], tokenizer: Tokenizer) -> tuple[Conversation, list[bool]]:
    """Append the record's messages as the agent does (system+user, each assistant reply,
    the tool results of a step); returns the conversation and a per-id trained mask."""
    conv = Conversation(tokenizer, thinking_mode=record["thinking_mode"])
    mask: list[bool] = []
    for group in turn_groups(record["messages"]):  # a reply cut off (its stop saved) is context, never a target
        trained = group[0]["role"] in record["train_mask_roles"] and group[0].get("stop", "eos") == "eos"
        mask += [trained] * len(conv.append(group))
    return conv, mask


def bare_record(record: dict[str, Any]) -> dict[str, Any]:
    """The record without its system message (the ~2.3K-token prompt with every tool
    schema): the setting of the trainer's first recall phase and of the drills."""
    assert record["messages"][0]["role"] == "system", record["id"]
    return dict(record, messages=record["messages"][1:])


def training_example(record: dict[str, Any], tokenizer: Tokenizer, args: ModelArgs) -> Example:
    """The record's ids as the agent logs them — each image placeholder expanded to its
    span of image tokens, as ``Agent._append`` does — with the trained mask and images."""
    conv, mask = encode_record(record, tokenizer)
    images = [decode_image(base64.b64decode(record["images"][ref["url"].removeprefix("sha256:")]))
              for ref in conv.images]
    lengths = [span_length(plan_image(image.width, image.height, args.vision)) for image in images]
    ids, starts = expand_spans(conv.ids, conv.image_positions, lengths, args.image_token_id)
    trained, _ = expand_spans(mask, conv.image_positions, lengths, False)
    return Example(ids, trained, list(zip(starts, images)))


def focus_example(record: dict[str, Any], tokenizer: Tokenizer, args: ModelArgs, words: list[str],
                  laid_out: Example | None = None) -> Example:
    """``record`` as ``training_example`` lays it out, trained only on the tokens of its last
    reply that spell one of ``words`` (whole words; a token may also hold the space before
    one: " 4" of " 4417-2192"): the one skill's own signal, not diluted by the reply's words
    around it — a fresh model learns the recall lookup from the value's tokens alone, and not
    in as many steps from the whole reply (docs/default-model-training.md, 2026-11-30).
    ``laid_out``: the record's ``training_example`` where the caller has it (not encoded again)."""
    ex = laid_out or training_example(record, tokenizer, args)
    ids, trained = list(ex.ids), list(ex.trained)
    last = max(i for i, t in enumerate(trained) if t)
    first = last
    while first > 0 and trained[first - 1]:
        first -= 1
    reply = list(range(first, last + 1))
    text = [tokenizer.decode([ids[i] for i in reply[:k]]) for k in range(len(reply) + 1)]
    spans = [(m.start(), m.end()) for w in words
             for m in re.finditer(rf"(?<![\w-]){re.escape(w)}(?![\w-])", text[-1])]
    if not spans:
        raise ValueError(f"record {record['id']}: the reply spells none of {words}")
    scored = {reply[k] for k in range(len(reply)) for lo, hi in spans if len(text[k]) < hi and len(text[k + 1]) > lo}
    return Example(ids, [i in scored for i in range(len(ids))], ex.images)


def value_example(record: dict[str, Any], tokenizer: Tokenizer, args: ModelArgs,
                  laid_out: Example | None = None) -> Example:
    """A recall record trained on its reply's planted value alone (see ``focus_example``)."""
    return focus_example(record, tokenizer, args, [record["truth"]["value"]], laid_out)


def echo_example(record: dict[str, Any], tokenizer: Tokenizer, args: ModelArgs) -> Example:
    """An ``echo_record`` trained on its reply's copy alone (see ``focus_example``)."""
    return focus_example(record, tokenizer, args, [record["truth"]["answer"]])


WORKSPACE_WORDS = {"notes", "todo", "logs", "run", "log", "data"}  # make_files' fixed paths, in every record


def copy_example(record: dict[str, Any], tokenizer: Tokenizer, args: ModelArgs,
                 laid_out: Example | None = None) -> Example | None:
    """``record`` as ``training_example`` lays it out, trained only on the tokens of its replies
    that copy a name or a number from earlier in the conversation: a word of the record's
    lexicon (``Lexicon.drew``) that an earlier message holds and neither the system prompt nor
    the workspace's fixed paths (``WORKSPACE_WORDS``) do, or a run of two or more digits an earlier message holds. The copy is the skill a new name
    asks for (issue 53: `hazel.csv` answered as `harbor.csv`, "Elena" as "Mira"), and in a
    whole reply a few tokens among the template's words. None where no reply copies.
    ``laid_out``: the record's ``training_example`` where the caller has it."""
    ex = laid_out or training_example(record, tokenizer, args)
    lex = lexicon(record["truth"].get("words", "closed"))
    messages = record["messages"]
    fixed = set(re.findall(r"[A-Za-z]+", json.dumps(messages[0]).lower())) | WORKSPACE_WORDS
    runs = reply_spans(ex.trained)
    answered = [k for k, m in enumerate(messages) if m["role"] == "assistant" and m.get("stop", "eos") == "eos"]
    if len(runs) != len(answered):  # the encoding's replies are the record's, one for one
        raise ValueError(f"record {record['id']}: {len(runs)} trained runs for {len(answered)} replies")
    scored: set[int] = set()
    for (first, end), k in zip(runs, answered):
        before = " ".join(_message_text(m) for m in messages[1:k])
        words = {w.lower() for w in re.findall(r"[A-Za-z]+", before)}
        copies = [rf"(?<![A-Za-z]){re.escape(w)}(?![A-Za-z])" for w in sorted(words)
                  if w not in fixed and lex.drew(w)]
        copies += [rf"(?<!\d){n}(?!\d)" for n in sorted(set(re.findall(r"\d{2,}", before)))]
        if copies:
            scored |= _spelling(tokenizer, ex.ids, range(first, end), copies, re.IGNORECASE)
    if not scored:
        return None
    return Example(ex.ids, [i in scored for i in range(len(ex.ids))], ex.images)  # the same ids, not a copy


def _message_text(m: dict[str, Any]) -> str:
    """What a message says: its text (blocks' text too) and its tool calls' arguments."""
    content = m.get("content") or ""
    text = content if isinstance(content, str) else " ".join(b.get("text", "") for b in content)
    return " ".join([text, *(c["function"]["arguments"] for c in m.get("tool_calls", ()))])


def _spelling(tokenizer: Tokenizer, ids, positions: range, patterns: list[str], flags: int = 0) -> set[int]:
    """The positions among ``positions`` whose tokens spell a match of one of ``patterns`` in the
    text they decode to (a token also holding a character beside the match counts)."""
    span = list(positions)
    text = [tokenizer.decode([int(ids[i]) for i in span[:k]]) for k in range(len(span) + 1)]
    spans = [(m.start(), m.end()) for p in patterns for m in re.finditer(p, text[-1], flags)]
    return {span[k] for k in range(len(span)) for lo, hi in spans if len(text[k]) < hi and len(text[k + 1]) > lo}


def form_example(record: dict[str, Any], tokenizer: Tokenizer, args: ModelArgs) -> Example:
    """An image record trained on the words of its reply that name the shapes' kind and
    count alone (not their colour, which a model learns first)."""
    truth = record["truth"]["image"]
    kind, count = truth["kind"], truth["count"]
    words = [str(count), NUMBER_WORDS[count], kind, _plural(2, kind).split(" ", 1)[1]]
    return focus_example(record, tokenizer, args, words + [w.capitalize() for w in words[2:]])


def turn_groups(messages: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Each assistant message alone; runs of other messages together."""
    groups: list[list[dict[str, Any]]] = []
    for msg in messages:
        if msg["role"] == "assistant" or not groups or groups[-1][0]["role"] == "assistant":
            groups.append([msg])
        else:
            groups[-1].append(msg)
    return groups


# -- (a) short chat ---------------------------------------------------------------------

def _runtime_facts() -> list[tuple[str, str]]:
    tools = ", ".join(builtin_toolbox().names())
    return [
        ("Who are you?", "I am dsagent, a local assistant running a DeepSeek-V4.1-style model."),
        ("What model do you run?", "A small DeepSeek-V4.1-style model, running locally on this machine."),
        ("Do you need the internet?", "No. I run locally; the model and the tools work offline."),
        ("Which tools can you use?", f"I can use these tools: {tools}."),
        ("Can you look at pictures?", "Yes. Attach an image and I can describe it, or I can open one with view_image."),
        ("Do you remember our earlier sessions?", "Yes. Sessions are saved on disk, so a session can be resumed later."),
        ("How do I ask you a single question from the shell?", 'Run: dsagent run "your question"'),
        ("How do I start a chat with you?", "Run: dsagent chat"),
        ("Can you do arithmetic?", "Yes. I use the calculator tool for exact results."),
        ("Can you run shell commands?", "Yes, with run_shell, inside the workspace, after you approve it."),
    ]


FACTS = [
    ("What colour is the sky on a clear day?", "Blue."), ("What colour is grass?", "Green."),
    ("What colour is snow?", "White."), ("How many days are in a week?", "Seven."),
    ("How many months are in a year?", "Twelve."), ("How many legs does a spider have?", "Eight."),
    ("How many sides does a triangle have?", "Three."), ("How many sides does a square have?", "Four."),
    ("What is the opposite of hot?", "Cold."), ("What is the opposite of up?", "Down."),
    ("What is the capital of France?", "Paris."), ("What is the capital of Japan?", "Tokyo."),
    ("What is the capital of Italy?", "Rome."), ("Which planet do we live on?", "Earth."),
    ("What do bees make?", "Honey."), ("At what temperature does water freeze, in Celsius?", "0 °C."),
]
GREETINGS = [("Hello!", "Hello! How can I help?"), ("Hi", "Hi! What can I do for you?"),
             ("Thanks!", "You're welcome."), ("Good morning.", "Good morning! How can I help?")]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def _sequence_fact(rng: random.Random, wide: bool = False) -> tuple[str, str]:
    """A day or a number and the one after it; ``wide`` (an open lexicon's records): numbers of
    one to five digits, each length as likely, so that adding one is learnt as carrying digits
    rather than as a table of the first hundred."""
    if rng.random() < 0.5:
        i = rng.randrange(7)
        return f"What day comes after {DAYS[i]}?", f"{DAYS[(i + 1) % 7]}."
    if wide:
        digits = rng.randrange(5)
        n = rng.randrange(10 ** digits, 10 ** (digits + 1))
    else:
        n = rng.randrange(1, 99)
    return f"What number comes after {n}?", f"{n + 1}."


ECHO_ASKS = (  # the corpus's echo requests are the first three
    "Repeat after me: {}", "Say exactly this: {}", "Copy this: {}", "Echo this back: {}",
    "Please repeat: {}", "Type this back to me: {}", "Write exactly: {}", "Say it back: {}")
_ECHO_OPENINGS = tuple(ask.split("{}")[0] for ask in ECHO_ASKS)  # what casual_text leaves as written


def _echo(rng: random.Random, lex: Lexicon) -> tuple[str, str]:
    """Repeat a text exactly: the copying that quoting names, numbers and expressions needs."""
    parts = [secret(rng), str(rng.randint(1, 99999)), lex.word(rng), lex.person(rng), arithmetic(rng),
             f"{lex.word(rng)}.{rng.choice(['txt', 'csv', 'py'])}"]
    text = " ".join(rng.sample(parts, rng.randint(1, 3)))
    return rng.choice(ECHO_ASKS[:3]).format(text), text


_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _free_word(rng: random.Random, alphabet: str = _LETTERS) -> str:
    """A string of 2-10 characters of ``alphabet`` drawn at random — no syllables, no vocabulary —
    never a word of the open vocabulary's held-out half."""
    while True:
        w = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 10)))
        if not lexicon("held-out").drew(w):
            return w


def echo_text(rng: random.Random) -> str:
    """One to four things to repeat: strings of random letters (some capitalised, some with
    digits), words of the open vocabulary's training half, file names and numbers, joined by
    spaces or commas. Nothing in it can be predicted but by copying it."""
    lex, parts = lexicon("open"), []
    for _ in range(rng.randint(1, 4)):
        pick = rng.random()
        if pick < 0.35:
            parts.append(_free_word(rng))
        elif pick < 0.5:
            parts.append(_free_word(rng).capitalize())
        elif pick < 0.6:
            parts.append(_free_word(rng, _LETTERS + "0123456789"))
        elif pick < 0.75:
            parts.append(lex.word(rng) if rng.random() < 0.5 else lex.person(rng))
        elif pick < 0.9:
            parts.append(f"{_free_word(rng)}.{rng.choice(['txt', 'csv', 'py', 'md', 'json', 'log'])}")
        else:
            parts.append(str(rng.randrange(10 ** rng.randint(1, 9))))
    return rng.choice([" ", ", "]).join(parts)


def echo_record(seed: int, index: int) -> dict[str, Any]:
    """A drill of the copying every new name needs (issue 53): the system prompt, a request to
    repeat ``echo_text`` and the reply that repeats it. The default of 2026-12-06 copied the
    digits of such a text (0.84 of them, teacher-forced) and almost none of its letters (0.04):
    its corpus's names were few enough to learn by heart, its recall values digits alone.
    Not a record of the corpus (``make_record``): a trainer draws these beside it."""
    rng = random.Random(f"dsagent-echo:{CORPUS_VERSION}:{seed}:{index}")
    return echo_request(rng, echo_text(rng), f"{seed}-{index:07d}-echo")


def echo_request(rng: random.Random, text: str, rid: str = "echo") -> dict[str, Any]:
    """A record of the system prompt, a request (one of ECHO_ASKS) to repeat ``text`` and the reply."""
    b = Builder(rng, lex=lexicon("open"))
    b.user(rng.choice(ECHO_ASKS).format(text))
    b.say(text)
    b.truth = {"answer": text, "words": "open"}
    return b.record(rid, "a")


def chat_conversation(b: Builder) -> None:
    pick = b.rng.random()
    if pick < 0.75:
        pool = _runtime_facts() if pick < 0.3 else FACTS if pick < 0.55 else GREETINGS
        q, a = b.rng.choice(pool) if pick < 0.65 else _sequence_fact(b.rng, b.lex.split is not None)
    else:
        q, a = _echo(b.rng, b.lex)
    b.user(q)
    b.say(a)
    b.truth = {"answer": a}


# -- (b) tools --------------------------------------------------------------------------

WORDS = ["falcon", "maple", "orbit", "harbor", "cedar", "lumen", "quartz", "willow", "ember", "delta",
         "sable", "tundra", "meadow", "cobalt", "juniper", "nimbus"]
NAMES = ["Mira", "Tomas", "Ada", "Kenji", "Lena", "Omar", "Priya", "Jonas", "Sofia", "Ravi"]


def arithmetic(rng: random.Random) -> str:
    """A small expression the calculator evaluates exactly."""
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 12)
    return rng.choice([f"{a} + {b}", f"{a} - {b}", f"{a} * {b}", f"({a} + {b}) * {c}",
                       f"{a * c} / {c}", f"{a} ** 2", f"{a * b} // {b}", f"{a} % {c}",
                       f"sqrt({a * a})", f"{a} * {b} - {c}"])


def number_text(result: str) -> str:
    """The calculator's repr as a person writes it: 12.0 -> 12."""
    return result[:-2] if result.endswith(".0") else result


def ask_calculator(b: Builder, expr: str, question: str) -> str:
    b.user(question)
    value = number_text(b.call(("calculator", {"expression": expr}))[0].text)
    b.truth.setdefault("arithmetic", []).append({"expression": expr, "value": value})
    return value


def make_files(b: Builder) -> dict[str, str]:
    """A small workspace: notes, a todo list, a log and a folder of files (``data``, or with
    ``b.folder_words`` a word of the lexicon, ``truth["folder"]``); returns their text."""
    rng, root, lex = b.rng, b.workspace, b.lex
    owner, project, day = lex.person(rng), lex.word(rng), rng.choice(DAYS)
    todo = [f"- [ ] {w} the {v}" for w, v in zip(rng.sample(["fix", "test", "write", "check", "clean"], 3),
                                                 lex.words(rng, 3))][: rng.randint(1, 3)]
    log = [f"{rng.choice(['INFO', 'INFO', 'WARN', 'ERROR'])} step {i} {lex.word(rng)}" for i in range(rng.randint(3, 12))]
    files = {"notes.txt": f"owner: {owner}\nproject: {project}\nmeeting: {day}\n",
             "todo.md": "\n".join(todo) + "\n", "logs/run.log": "\n".join(log) + "\n"}
    # each file's number drawn before its extension: the corpus's order of draws, so that records
    # without folder words stay as they were
    names = [(name, rng.randint(1, 999), rng.choice(['txt', 'csv', 'py']))
             for name in lex.words(rng, rng.randint(1, 4))]
    if b.folder_words:  # a word that no fixed path, the project or a file of the folder is named by
        b.folder = lex.word(rng)
        while b.folder in WORKSPACE_WORDS or b.folder in (project, *(name for name, _, _ in names)):
            b.folder = lex.word(rng)
        b.truth["folder"] = b.folder
    for name, n, ext in names:
        files[f"{b.folder}/{name}.{ext}"] = f"{name} {n}\n"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    b.truth["files"] = files
    return files


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}es" if word.endswith("s") else f"{n} {word}s"


def read_question(b: Builder, files: dict[str, str]) -> None:
    key = b.rng.choice(["owner", "project", "meeting"])
    value = dict(line.split(": ") for line in files["notes.txt"].splitlines())[key]
    b.user(b.lex.phrase(b.rng, [f"What is the {key} in notes.txt?", f"Check notes.txt: what is the {key}?"],
                        {"train": [f"Read notes.txt and tell me the {key}.", f"What does notes.txt say the {key} is?",
                                   f"Find the {key} in notes.txt.", f"Open notes.txt: what's the {key}?",
                                   f"Which {key} does notes.txt name?"],
                         "held-out": [f"Look up the {key} in notes.txt.", f"In notes.txt, what is given as the {key}?"]}))
    b.call(("read_file", {"path": "notes.txt"}))
    b.say(f"The {key} in notes.txt is {value}.")
    b.truth["answer"] = value


def list_question(b: Builder, files: dict[str, str]) -> None:
    d = b.folder
    names = sorted(p.split("/", 1)[1] for p in files if p.startswith(f"{d}/"))
    b.user(b.lex.phrase(b.rng, [f"What files are in the {d} folder?", f"List the {d} directory."],
                        {"train": [f"What's in the {d} folder?", f"Show me the files in {d}.",
                                   f"What does the {d} folder contain?", f"Which files are in {d}?",
                                   f"Show the contents of the {d} folder."],
                         "held-out": [f"List the files in the {d} folder.", f"Which files does the {d} folder hold?"]}))
    b.call(("list_dir", {"path": d}))
    b.say(f"The {d} folder has {_plural(len(names), 'file')}: {', '.join(names)}.")
    b.truth["answer"] = len(names)


def missing_question(b: Builder, files: dict[str, str]) -> None:
    """A question about a folder or a file the workspace lacks: the tool's own error, then a
    reply that says it is not there (``truth["missing"]``: the path asked for)."""
    taken = {part.split(".")[0] for path in files for part in path.split("/")}
    name = b.lex.word(b.rng)
    while name in taken:
        name = b.lex.word(b.rng)
    if b.rng.random() < 0.5:
        b.user(b.lex.phrase(b.rng, [f"What files are in the {name} folder?", f"List the {name} directory."],
                            {"train": [f"What's in the {name} folder?", f"Show me the files in {name}.",
                                       f"Which files are in {name}?"],
                             "held-out": [f"List the files in the {name} folder.",
                                          f"Which files does the {name} folder hold?"]}))
        b.call(("list_dir", {"path": name}))
        b.say(f"There is no {name} folder in the workspace.")
    else:
        name = f"{name}.{b.rng.choice(['txt', 'md', 'csv'])}"
        b.user(b.lex.phrase(b.rng, [f"What does {name} say?", f"Read {name} for me."],
                            {"train": [f"Open {name}: what is in it?", f"What is written in {name}?",
                                       f"Show me {name}."],
                             "held-out": [f"Tell me what {name} contains.", f"Look inside {name}."]}))
        b.call(("read_file", {"path": name}))
        b.say(f"There is no file {name} in the workspace.")
    b.truth["missing"] = b.truth["answer"] = name


def shell_question(b: Builder, files: dict[str, str]) -> None:
    log = files["logs/run.log"].splitlines()
    if b.rng.random() < 0.5:
        b.user("How many lines does logs/run.log have? Use the shell.")
        out = b.call(("run_shell", {"command": "wc -l < logs/run.log"}))[0].text
        n, what = len(log), "lines"
    else:
        b.user("How many ERROR lines are in logs/run.log? Use a shell command.")
        out = b.call(("run_shell", {"command": "grep -c ERROR logs/run.log"}))[0].text
        n, what = sum("ERROR" in line for line in log), "ERROR lines"
    assert out.splitlines()[1].strip() == str(n), out
    b.say(f"logs/run.log has {n} {what}.")
    b.truth["answer"] = n


def view_question(b: Builder) -> None:
    shape = draw_shapes(b.rng)
    name = f"{b.lex.word(b.rng)}.png"
    (b.workspace / name).write_bytes(shape.png)
    b.user(b.lex.phrase(b.rng, [f"What is in {name}?", f"Look at {name} and tell me how many shapes it shows."],
                        {"train": [f"Describe {name}.", f"What does {name} show?", f"What can you see in {name}?",
                                   f"Count the shapes in {name}.", f"Open {name} and describe it."],
                         "held-out": [f"Open {name}: what shapes are in it?", f"Tell me what the picture {name} contains."]}))
    b.call(("view_image", {"path": name}))
    b.say(describe(shape))
    b.truth["image"] = shape.truth()


def calc_question(b: Builder) -> None:
    if b.rng.random() < 0.2:  # two independent sums in one step
        e1, e2 = arithmetic(b.rng), arithmetic(b.rng)
        b.user(f"Compute {e1} and {e2}.")
        v1, v2 = (number_text(r.text) for r in b.call(("calculator", {"expression": e1}),
                                                      ("calculator", {"expression": e2})))
        b.truth["arithmetic"] = [{"expression": e1, "value": v1}, {"expression": e2, "value": v2}]
        b.say(f"{e1} = {v1} and {e2} = {v2}.")
        return
    expr = arithmetic(b.rng)
    said = _spoken(b, expr)
    q = b.lex.phrase(b.rng, [f"What is {said}?", f"Calculate {said}.", f"Use the calculator: {said}"],
                     {"train": [f"Compute {said}.", f"What's {said}?", f"What does {said} come to?",
                                f"Can you calculate {said}?", f"Please compute {said}.", f"Find {said}."],
                      "held-out": [f"How much is {said}?", f"Work out {said}."]})
    b.say(f"{expr} = {ask_calculator(b, expr, q)}.")


# an operator in words, as an open lexicon's halves say it: both halves use every word (the
# training half also the symbol), the held-out half only in its own sentences; a word that no
# record teaches is not something a model can learn to read from this corpus
SPOKEN_OPS = {"+": ("plus", "added to"), "-": ("minus", "take away"),
              "*": ("times", "×", "multiplied by"), "/": ("divided by", "over")}


def _spoken(b: Builder, expr: str) -> str:
    """``expr`` as the user says it: as written with the closed lexicon, or where it is one
    operator between two numbers, in an open half's words for the operator (the calculator
    still gets ``expr``: the model turns the words into it)."""
    m = re.fullmatch(r"(\d+) ([-+*/]) (\d+)", expr)
    if b.lex.split is None or m is None:
        return expr
    a, op, c = m.groups()
    said = SPOKEN_OPS[op]
    return f"{a} {b.rng.choice((op, *said) if b.lex.split == 'train' else said)} {c}"


def tool_conversation(b: Builder) -> None:
    if b.tool_errors:
        missing_question(b, make_files(b))
        return
    if b.folder_words:
        list_question(b, make_files(b))
        return
    pick = b.rng.random()
    if pick < 0.45:
        calc_question(b)
    elif pick < 0.88:
        files = make_files(b)
        b.rng.choice([read_question, list_question, shell_question])(b, files)
    else:
        view_question(b)


# -- (c) images -------------------------------------------------------------------------

@dataclass(frozen=True)
class Shapes:
    png: bytes
    kind: str
    colour: str
    count: int

    def truth(self) -> dict[str, Any]:
        return {"kind": self.kind, "colour": self.colour, "count": self.count,
                "rgb": list(COLOURS[self.colour])}


def _draw_one(draw: ImageDraw.ImageDraw, kind: str, box: tuple[int, int, int, int], rgb) -> None:
    x0, y0, x1, y1 = box
    if kind == "circle":
        draw.ellipse(box, fill=rgb)
    elif kind == "square":
        draw.rectangle(box, fill=rgb)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=rgb)


def draw_shapes(rng: random.Random) -> Shapes:
    """1-5 same-coloured shapes of one kind in distinct grid cells on a plain background."""
    kind, colour, count = rng.choice(SHAPES), rng.choice(sorted(COLOURS)), rng.randint(1, 5)
    img = Image.new("RGB", (IMAGE_SIDE, IMAGE_SIDE), rng.choice(BACKGROUNDS))
    draw, cell = ImageDraw.Draw(img), IMAGE_SIDE // GRID
    for c in rng.sample(range(GRID * GRID), count):
        size = rng.randint(18, 30)
        x = (c % GRID) * cell + rng.randint(4, cell - size - 4)
        y = (c // GRID) * cell + rng.randint(4, cell - size - 4)
        _draw_one(draw, kind, (x, y, x + size, y + size), COLOURS[colour])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return Shapes(buf.getvalue(), kind, colour, count)


def describe(s: Shapes) -> str:
    verb = "is" if s.count == 1 else "are"
    return f"There {verb} {NUMBER_WORDS[s.count]} {s.colour} {_plural(s.count, s.kind).split(' ', 1)[1]}."


IMAGE_QUESTIONS = {
    "count": ["How many shapes are in this picture?", "Count the shapes."],
    "colour": ["What colour are the shapes?", "Which colour do you see?"],
    "kind": ["What kind of shapes are these?", "Which shape is drawn here?"],
    "describe": ["Describe this image.", "What do you see?"],
}


def image_answer(s: Shapes, aspect: str) -> str:
    lead = {"count": f"{s.count}.", "colour": f"{s.colour.capitalize()}.",
            "kind": f"{_plural(2, s.kind).split(' ', 1)[1].capitalize()}.", "describe": ""}[aspect]
    return f"{lead} {describe(s)}".strip()


def image_conversation(b: Builder) -> None:
    s = draw_shapes(b.rng)
    aspect = b.rng.choice(sorted(IMAGE_QUESTIONS))
    b.user(b.rng.choice(IMAGE_QUESTIONS[aspect]), image=s.png)
    b.say(image_answer(s, aspect))
    b.truth["image"] = s.truth()


# -- (d) long-context recall --------------------------------------------------------------

PLACES = ["the north hall", "the lab", "room four", "the garden", "the depot", "the archive", "the harbor"]
THINGS = ["lamp", "crate", "ladder", "kettle", "map", "bell", "rope", "barrel", "clock", "ledger"]
ADJS = ["old", "small", "heavy", "bright", "quiet", "dusty", "narrow", "round"]
KEY_KINDS = ["access code", "locker number", "password", "badge id"]


def filler_line(rng: random.Random, lex: Lexicon | None = None) -> str:
    lex = lex or lexicon("closed")
    if rng.random() < 0.5:
        return (f"On {rng.choice(DAYS)} {lex.person(rng)} moved the {rng.choice(ADJS)} "
                f"{rng.choice(THINGS)} to {rng.choice(PLACES)}.")
    return (f"Inventory: {rng.choice(ADJS)} {rng.choice(THINGS)}, shelf {lex.word(rng)}, "
            f"checked by {lex.person(rng)}.")


def secret(rng: random.Random, value: str = "mixed") -> str:
    """A value that no filler line can contain: letters, a dash, digits ("mixed"), or digits,
    a dash, digits ("digits"; see RECALL_VALUES)."""
    if value == "digits":
        return f"{rng.randint(1000, 9999)}-{rng.randint(1000, 9999)}"
    letters = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(3))
    return f"{letters}-{rng.randint(1000, 9999)}"


def recall_document(rng: random.Random, tokenizer: Tokenizer, key: str, value: str,
                    recall_tokens: tuple[int, int] = RECALL_TOKENS, form: str = "colon",
                    place: str = "first", lex: Lexicon | None = None) -> list[str]:
    """Filler lines up to the drawn length, the key planted in the first fifth (``place``
    "first") or anywhere after the first line ("any")."""
    target = rng.randint(*recall_tokens)
    lines, tokens = [], 0
    while tokens < target:
        lines.append(filler_line(rng, lex))
        tokens += len(tokenizer.encode_content(lines[-1] + "\n"))
    end = max(2, len(lines) // 5) if place == "first" else len(lines) + 1
    lines.insert(rng.randrange(1, end), RECALL_FORMS[form].format(key=key, value=value))
    return lines


def plant_decoys(rng: random.Random, lines: list[str], key_kind: str, owner: str,
                 style: RecallStyle = RecallStyle(), lex: Lexicon | None = None) -> None:
    """2-4 keys of the same kind for other owners: after the first fifth (style "first":
    always after the planted key) or anywhere (style "any")."""
    for other in (lex or lexicon("closed")).words(rng, rng.randint(2, 4), but=(owner,)):
        start = len(lines) // 5 if style.place == "first" else 0
        lines.insert(rng.randrange(start, len(lines)),
                     RECALL_FORMS[style.form].format(key=f"{key_kind} of {other}", value=secret(rng, style.value)))


def recall_conversation(b: Builder, tokenizer: Tokenizer, recall_tokens: tuple[int, int] = RECALL_TOKENS,
                        style: RecallStyle = RecallStyle()) -> None:
    """A log with a key planted early and (in the corpus's style) decoys of the same kind
    after, and the question for the key, written in ``style`` (the corpus's own unless a
    trainer asks for another)."""
    rng = b.rng
    key_kind, owner, value = rng.choice(KEY_KINDS), b.lex.word(rng), secret(rng, style.value)
    key = f"{key_kind} of {owner}"
    lines = recall_document(rng, tokenizer, key, value, recall_tokens, style.form, style.place, b.lex)
    if style.decoys:
        plant_decoys(rng, lines, key_kind, owner, style, b.lex)
    planted = RECALL_FORMS[style.form].format(key=key, value=value)
    before = sum(line.startswith(f"{key_kind} of ") for line in lines[:lines.index(planted)])
    document = "\n".join(lines)
    question = b.lex.phrase(rng, [f"What is the {key}?"],
                            {"train": [f"Which {key} does the log give?", f"Find the {key} in the log.",
                                       f"From the log above, what is the {key}?"],
                             "held-out": [f"Tell me the {key} from the log."]})
    if rng.random() < 0.5:
        b.user(f"Here is a log.\n\n{document}\n\n{question}")
    else:
        b.user(f"Read this log; I will ask about it.\n\n{document}")
        b.say("I have read the log. What would you like to know?")
        b.user(question)
    b.say(f"The {key} is {value}.")
    b.truth = {"key": key, "value": value, "question": question}
    if style.place != "first":  # the corpus's own puts none before
        b.truth["decoys_before"] = before
    if differences := style.differences():
        b.truth["style"] = differences


# -- (e) multi-turn ------------------------------------------------------------------------

def remember_session(b: Builder) -> None:
    name, pet, colour = b.lex.person(b.rng), b.lex.word(b.rng).capitalize(), b.rng.choice(sorted(COLOURS))
    b.user(f"My name is {name}, my cat is called {pet} and my favourite colour is {colour}.")
    b.say(f"Nice to meet you, {name}. I'll remember that.")
    q, a = b.rng.choice(FACTS)
    b.user(q)
    b.say(a)
    ask = b.rng.choice([("What is my cat called?", f"Your cat is called {pet}.", pet),
                        ("What is my name?", f"Your name is {name}.", name),
                        ("What is my favourite colour?", f"Your favourite colour is {colour}.", colour)])
    b.user(ask[0])
    b.say(ask[1])
    b.truth = {"answer": ask[2]}


def calc_session(b: Builder) -> None:
    expr = arithmetic(b.rng)
    value = ask_calculator(b, expr, f"What is {expr}?")
    b.say(f"{expr} = {value}.")
    for _ in range(b.rng.randint(1, 2)):
        n, op, word = b.rng.randint(2, 50), *b.rng.choice([("+", "Add {} to that."), ("*", "Multiply that by {}."),
                                                           ("-", "Subtract {} from that.")])
        expr = f"{value} {op} {n}"
        value = ask_calculator(b, expr, word.format(n))
        b.say(f"{expr} = {value}.")
    b.truth["answer"] = value


def file_session(b: Builder) -> None:
    files = make_files(b)
    d = b.folder
    names = sorted(p.split("/", 1)[1] for p in files if p.startswith(f"{d}/"))
    b.user(f"What is in the {d} folder?")
    b.call(("list_dir", {"path": d}))
    b.say(f"The {d} folder has {_plural(len(names), 'file')}: {', '.join(names)}.")
    b.user("Show me the first one." if b.rng.random() < 0.5 else f"Read {names[0]}.")
    text = b.call(("read_file", {"path": f"{d}/{names[0]}"}))[0].text
    b.say(f"{d}/{names[0]} contains: {text.strip()}")
    b.truth["answer"] = text.strip()


def image_session(b: Builder) -> None:
    s = draw_shapes(b.rng)
    aspects = b.rng.sample(sorted(IMAGE_QUESTIONS), 2)
    b.user(b.rng.choice(IMAGE_QUESTIONS[aspects[0]]), image=s.png)
    b.say(image_answer(s, aspects[0]))
    follow = {"count": "And how many are there?", "colour": "And their colour?",
              "kind": "And what shape are they?", "describe": "Describe it in one sentence."}[aspects[1]]
    b.user(follow)
    b.say(image_answer(s, aspects[1]))
    b.truth["image"] = s.truth()


def multi_turn_conversation(b: Builder) -> None:
    b.rng.choice([remember_session, calc_session, file_session, image_session])(b)


# -- (f) mixed conversations ----------------------------------------------------------------

MIXED_TURNS = (2, 8)
CUT_SKILLS, CUT_SHARE = ("chat", "file", "image"), 0.2  # replies a user may cut off (a later turn draws on none)


@dataclass(frozen=True)
class Fact:
    """A fact the user tells in a mixed conversation and may ask back turns later."""

    tell: str  # the user saying it; "{}" is the value
    ack: str
    asks: tuple[str, ...]  # ways of asking it back
    answer: str
    draw: Any  # (rng, lexicon) -> the value


TOLD = {
    "name": Fact("My name is {}.", "Nice to meet you, {}. I'll remember that.",
                 ("What did I tell you my name was?", "What is my name?"), "Your name is {}.",
                 lambda rng, lex: lex.person(rng)),
    "cat": Fact("My cat is called {}.", "Got it: your cat is called {}.",
                ("What did I say my cat is called?", "What is my cat called?"), "Your cat is called {}.",
                lambda rng, lex: lex.word(rng).capitalize()),
    "colour": Fact("My favourite colour is {}.", "Noted: your favourite colour is {}.",
                   ("What did I tell you my favourite colour was?", "Which colour did I say I like best?"),
                   "Your favourite colour is {}.", lambda rng, lex: rng.choice(sorted(COLOURS))),
    "number": Fact("My lucky number is {}.", "Noted: your lucky number is {}.",
                   ("What did I say my lucky number was?", "What is my lucky number?"),
                   "Your lucky number is {}.", lambda rng, lex: str(rng.randint(2, 999))),
}
# a calculation on an earlier result: of the turn just before it says "that"; of an earlier
# one it names that turn's expression
BACK_THAT = {"*": ("And that times {n}?", "Multiply that by {n}."), "+": ("Add {n} to that.", "And that plus {n}?"),
             "-": ("Subtract {n} from that.", "And that minus {n}?")}
BACK_NAMED = {"*": "Multiply the result of {expr} by {n}.", "+": "Add {n} to the result of {expr}.",
              "-": "Subtract {n} from the result of {expr}."}


def _own_truth(b: Builder, build, *args) -> dict[str, Any]:
    """Run one skill's builder as a turn of a longer conversation: what it records as truth
    is that turn's, not the record's."""
    kept, b.truth = b.truth, {}
    build(b, *args)
    turn, b.truth = b.truth, kept
    return turn


def _told(turns: list[dict[str, Any]]) -> dict[str, int]:
    """Fact -> the index of the turn that told it."""
    return {t["fact"]: i for i, t in enumerate(turns) if t["skill"] == "tell"}


def _valued(turns: list[dict[str, Any]]) -> list[int]:
    """The turns whose one calculator value a later turn may calculate on."""
    return [i for i, t in enumerate(turns) if t["skill"] in ("calc", "back") and "answer" in t]


def _chat_turn(b: Builder, turns: list[dict[str, Any]]) -> dict[str, Any]:
    return _own_truth(b, chat_conversation)


def _calc_turn(b: Builder, turns: list[dict[str, Any]]) -> dict[str, Any]:
    truth = _own_truth(b, calc_question)
    if len(truth["arithmetic"]) == 1:  # two sums leave no single "that"
        truth["answer"] = truth["arithmetic"][0]["value"]
    return truth


def _file_turn(b: Builder, turns: list[dict[str, Any]]) -> dict[str, Any]:
    if "files" not in b.truth:  # one workspace a conversation, made when first asked about
        make_files(b)
        if b.tool_errors:  # its first file question asks for what the workspace lacks
            return _own_truth(b, missing_question, b.truth["files"])
        if b.folder_words:  # its first file question lists the folder by its name
            return _own_truth(b, list_question, b.truth["files"])
    return _own_truth(b, b.rng.choice([read_question, list_question]), b.truth["files"])


def _image_turn(b: Builder, turns: list[dict[str, Any]]) -> dict[str, Any]:
    """An attached picture, or one opened with view_image (once a conversation: two pictures
    could draw the same file name)."""
    viewed = any(c["function"]["name"] == "view_image" for m in b.messages for c in m.get("tool_calls", ()))
    if viewed or b.rng.random() < 0.5:
        return _own_truth(b, image_conversation)
    return _own_truth(b, view_question)


def _tell_turn(b: Builder, turns: list[dict[str, Any]]) -> dict[str, Any]:
    name = b.rng.choice([f for f in TOLD if f not in _told(turns)])
    fact = TOLD[name]
    value = fact.draw(b.rng, b.lex)
    b.user(fact.tell.format(value))
    b.say(fact.ack.format(value))
    return {"fact": name, "answer": value}


def _recall_turn(b: Builder, turns: list[dict[str, Any]]) -> dict[str, Any]:
    told = _told(turns)
    name = b.rng.choice(sorted(told))
    value = turns[told[name]]["answer"]
    b.user(b.rng.choice(TOLD[name].asks))
    b.say(TOLD[name].answer.format(value))
    return {"fact": name, "answer": value, "refers_to": told[name] + 1}


def _back_turn(b: Builder, turns: list[dict[str, Any]]) -> dict[str, Any]:
    """A calculation on an earlier turn's result: "that" when it is the turn just before,
    else that turn's expression named."""
    valued, last = _valued(turns), len(turns) - 1
    i = last if last in valued and b.rng.random() < 0.6 else b.rng.choice(valued)
    op, n = b.rng.choice(sorted(BACK_THAT)), b.rng.randint(2, 12)
    earlier = turns[i]
    if i == last:
        question = b.rng.choice(BACK_THAT[op]).format(n=n)
    else:
        question = BACK_NAMED[op].format(n=n, expr=earlier["arithmetic"][-1]["expression"])
    expr = f"{earlier['answer']} {op} {n}"
    truth = _own_truth(b, ask_calculator, expr, question)
    value = truth["arithmetic"][0]["value"]
    b.say(f"{expr} = {value}.")
    return {**truth, "answer": value, "refers_to": i + 1}


# each skill of a mixed turn: its builder, whether the turns before allow it, its weight (a
# turn that refers back can only follow others, so it weighs double where it can be asked)
MIXED_SKILLS = {
    "chat": (_chat_turn, lambda turns: True, 1),
    "calc": (_calc_turn, lambda turns: True, 1),
    "file": (_file_turn, lambda turns: True, 1),
    "image": (_image_turn, lambda turns: True, 1),
    "tell": (_tell_turn, lambda turns: len(_told(turns)) < len(TOLD), 1),
    "recall": (_recall_turn, lambda turns: bool(_told(turns)), 2),
    "back": (_back_turn, lambda turns: bool(_valued(turns)), 2),
}


def _cut_reply(b: Builder) -> dict[str, Any]:
    """The turn's final reply cut off as the agent saves one the user stopped (Ctrl-C) or the
    token limit ended: the words before a random point — none, where it stopped before its
    first token — with its ``stop``; its tokens are closed as any reply's and never trained
    (``encode_record``)."""
    reply = b.messages[-1]
    words = reply["content"].split(" ")
    kept = b.rng.randrange(len(words))  # never the whole reply
    stop = "interrupted" if kept == 0 else b.rng.choice(["interrupted", "max_tokens"])
    full, reply["content"], reply["stop"] = reply["content"], " ".join(words[:kept]), stop
    return {"words": kept, "stop": stop, "reply": full}


def mixed_conversation(b: Builder) -> None:
    """2-8 turns, each of a skill drawn from those the turns before allow, two skills at
    least. ``truth["turns"]`` holds each turn's truth: its skill, ``refers_to`` (the 1-based
    turn a recall or a calculation on an earlier result draws on; None for the others),
    and its builder's own keys (``answer``, ``image``, ``arithmetic``); ``truth["files"]``
    the workspace when a turn asked about files. A turn but the last of the skills no later
    turn draws on (CUT_SKILLS) has its reply cut off one time in CUT_SHARE^-1 (``cut``: the
    words kept, the stop and the whole reply): the turn after it starts from a reply that
    never finished."""
    turns: list[dict[str, Any]] = []
    b.truth = {"turns": turns}
    count = b.rng.randint(*MIXED_TURNS)
    for t in range(count):
        skills = [s for s, (_, allowed, _) in MIXED_SKILLS.items() if allowed(turns)]
        if t == count - 1 and len({turn["skill"] for turn in turns}) == 1:
            skills = [s for s in skills if s != turns[0]["skill"]]
        skill = b.rng.choices(skills, [MIXED_SKILLS[s][2] for s in skills])[0]
        turn = {"skill": skill, "refers_to": None, **MIXED_SKILLS[skill][0](b, turns)}
        if skill in CUT_SKILLS and t < count - 1 and b.rng.random() < CUT_SHARE:
            turn["cut"] = _cut_reply(b)
        turns.append(turn)
