"""The agent turn loop (RUNTIME.md §4-§5): one session, its token log, its live state.

Owns: opening or resuming a session (fingerprint check, stored KV chunks, RAM-pool hit
or bounded replay), starting a new session's first prefill from the KV other sessions
stored for the same leading tokens (the system prompt and tools; a resume's bounded replay
before it), appending user input to the token log with the V4.1 encoding (never
re-rendering history), prefill, streamed generation parsed for DSML tool calls, running
tools under the approval policy, feeding results and images back, and one save point
per turn; also logging a given history without generating (``add_history``) and
answering the log as it stands (``reply``), as imports and evaluations need. Each reply
is saved with why it stopped (``stop``: eos, max_tokens, max_steps, interrupted). Emits
events to a callback instead of printing; the CLI renders them.

Invariant: ``self.log`` holds every token the session has, and the model state covers
its first ``state.length`` tokens; the rest (at most a turn's worth) is prefilled next.
A turn is all or nothing: it is saved in one transaction at its end, and a turn that
fails (an engine error, a full context, a full disk during the save) is dropped from the
log, the transcript and the model state, so that the next turn starts from the last save
point exactly as a run that never tried it would. Ctrl-C is not a failure: during
generation it ends the reply where it stands; elsewhere (a long prefill, a tool) the turn
so far is kept with an empty reply, so the log still ends at a closed turn.
"""
from __future__ import annotations

import math
import secrets
import time
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from dsagent.prompt import DEFAULT_SYSTEM
from dsagent.runtime import Runtime
from model.cache import CacheFormatError
from model.chat import encode_messages
from model.dspark import speculator_for
from model.dsml import DSMLError, StreamParser, TextDelta, ReasoningDelta, parse_completion
from model.engine import ContextLimitError, Sampling
from model.vision import expand_spans
from sessions import ImageSpan, KVChunk, LocalStatePool, SaveResult, Store
from tools import ToolRunner, Workspace, builtin_toolbox


Event = dict


class ContextFullError(ContextLimitError):
    """The session's next input does not fit in the model's context: only a new session helps."""


@dataclass
class Usage:
    prompt_tokens: int = 0  # tokens prefilled by this run (new input and un-cached log)
    completion_tokens: int = 0  # tokens generated
    cached_tokens: int = 0  # tokens whose state came from disk or the RAM pool
    replayed_tokens: int = 0  # tokens re-run to rebuild the sliding-window state


@dataclass
class AgentOptions:
    session: str | None = None
    thinking_mode: str = "chat"
    reasoning_effort: str | int | None = None
    system_prompt: str = DEFAULT_SYSTEM
    tools: list[str] | None = None  # None: every built-in tool; []: none
    policy: str = "ask"
    workspace: Path = field(default_factory=Path.cwd)
    max_steps: int = 8
    sampling: Sampling = field(default_factory=Sampling)
    chunk_tokens: int = 256
    replay_tokens: int | None = None  # None: the sliding window
    tool_timeout_s: float = 30.0
    tool_output_cap: int = 16_000
    speculative: bool | None = None  # DSpark when the checkpoint has draft stages (None: where it pays, on the CPU)
    prefix_cache: bool = True  # a new session starts from KV stored for the same prefix (system prompt, tools)


@dataclass
class TurnResult:
    session: str
    text: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    steps: int = 0
    stop: str = "eos"  # eos | max_tokens | max_steps | interrupted

    def to_json(self) -> dict:
        return {"session": self.session, "text": self.text, "reasoning": self.reasoning,
                "tool_calls": self.tool_calls, "usage": asdict(self.usage), "steps": self.steps, "stop": self.stop}


class Agent:
    def __init__(self, runtime: Runtime, store: Store, options: AgentOptions, *,
                 pool: LocalStatePool | None = None, on_event: Callable[[Event], None] | None = None,
                 approver=None):
        self.rt, self.store, self.opts, self.pool = runtime, store, options, pool
        self.emit = on_event or (lambda e: None)
        toolbox = builtin_toolbox() if options.tools is None else builtin_toolbox().select(options.tools)
        self.runner = ToolRunner(toolbox, Workspace(options.workspace), policy=options.policy,
                                 approver=approver, timeout_s=options.tool_timeout_s,
                                 output_cap=options.tool_output_cap)
        self.speculator = speculator_for(runtime.model, runtime.engine, requested=options.speculative)
        self.usage = Usage()
        self.kv_refused: list[str] = []  # why stored KV was dropped on resume (rebuilt from the log)
        self._stack = ExitStack()
        self.name = ""
        self.last_save: SaveResult | None = None  # what the newest save point wrote
        self._touched = False  # the engine ran on the state during the turn in progress

    # ------------------------------------------------------------------ open / resume
    def open(self) -> "Agent":
        """Create the session or resume it from disk (or from the RAM pool)."""
        name = self.opts.session or time.strftime("s-%Y%m%d-%H%M%S-") + secrets.token_hex(2)
        self.name = name
        self._stack.enter_context(self.store.lock(name))
        try:
            if _exists(self.store, name):
                self._resume(name)
            else:
                self.store.create_session(name, fingerprint=self.rt.fingerprint,
                                          meta={"model": self.rt.source, "thinking_mode": self.opts.thinking_mode})
                self._fresh()
        except BaseException:
            self._stack.close()
            raise
        return self

    def _fresh(self) -> None:
        self.messages, self.log, self.spans = [], [], []
        self.saved_messages = self.saved_tokens = self.saved_spans = self.next_chunk = 0
        self.shared_tokens = 0  # leading tokens whose KV came from chunks stored by other sessions
        self.new_images: dict[str, bytes] = {}
        self.state = self.rt.engine.new_state()

    def _resume(self, name: str) -> None:
        self._fresh()
        loaded = self.store.load(name, fingerprint=self.rt.fingerprint, chunk_tokens=self.opts.chunk_tokens)
        for w in loaded.warnings:
            self.emit({"event": "warning", "message": w})
        self.kv_refused += loaded.warnings
        self.messages, self.log, self.spans = list(loaded.messages), list(loaded.tokens), list(loaded.image_spans)
        self.saved_messages, self.saved_tokens, self.saved_spans = len(self.messages), len(self.log), len(self.spans)
        pooled = self.pool.get(name, position=len(self.log)) if self.pool else None
        if pooled is not None:
            self.state = pooled
            self.usage.cached_tokens = self.state.length
            self.next_chunk = loaded.next_chunk_start
            return
        self._restore_kv(loaded)

    def _restore_kv(self, loaded, *, own: bool = True) -> None:
        """Import the stored global KV, then replay the window before it. ``own``: the KV is
        the session's (a refusal is a cache refused); else it is another session's prefix."""
        k = loaded.kv_tokens
        try:  # through the engine: over several ranks every rank makes the same state
            self.state = self.rt.engine.state_from_chunks([c.blobs for c in loaded.kv], k) if k \
                else self.rt.engine.new_state()
        except CacheFormatError as e:
            message = f"stored KV refused ({e}); " + ("rebuilding from the token log" if own else
                                                     "prefilling the whole prompt")
            self.emit({"event": "warning", "message": message})
            if own:
                self.kv_refused.append(message)
            self.state, k = self.rt.engine.new_state(), 0
        self.next_chunk = loaded.next_chunk_start if k else 0
        self.usage.cached_tokens += k
        if k:
            log = torch.tensor([self.log[:k]])
            self.rt.engine.replay(self.state, log, images=self._images, tokens=self.opts.replay_tokens)
            self.usage.replayed_tokens += min(k, self.opts.replay_tokens or self.rt.args.sliding_window)

    # ------------------------------------------------------------------ all or nothing
    @contextmanager
    def _atomic(self, *, keep_interrupted: bool = True) -> Iterator[None]:
        """Save what the body adds in one transaction at its end, or nothing of it: when the
        body or the save fails, put the log, transcript and state back to the last save.
        ``keep_interrupted``: Ctrl-C keeps the turn so far (else it drops it as a failure)."""
        self._touched = False
        try:
            yield
        except KeyboardInterrupt:
            if keep_interrupted:
                self._keep_interrupted()
            else:
                self._roll_back()
            raise
        except BaseException:
            self._roll_back()
            raise
        try:
            self.save()
        except BaseException:
            self._roll_back()
            raise

    def _keep_interrupted(self) -> None:
        """Ctrl-C outside generation: keep the turn so far, its open prompt answered by an
        empty reply (as a reply interrupted before its first token is), and save it without
        KV, since the state may stop inside a prefill; then reload the state from the store."""
        try:
            if len(self.messages) > self.saved_messages and self.messages[-1].get("role") != "assistant":
                self.messages.append(_unparsed("", self.rt.tokenizer))
                self.log.append(self.rt.tokenizer.eos_id)
            if len(self.messages) > self.saved_messages:  # a reply whose tool calls never ran, or the empty one
                self.messages[-1]["stop"] = "interrupted"
            self.save(kv=False)
        except BaseException:  # not even that could be saved: drop the turn as a failure would
            self._roll_back()
            return
        if self._touched:
            self._reload_state()

    def _roll_back(self) -> None:
        del self.messages[self.saved_messages:]
        del self.log[self.saved_tokens:]
        del self.spans[self.saved_spans:]
        self.new_images = {}
        if self._touched:
            self._reload_state()

    def _reload_state(self) -> None:
        """The state has seen tokens the log no longer holds, and a cache rolls back only a
        few positions: load the last save point's state as a resume from disk does. (The
        RAM pool's copy, if any, is this same object, so it cannot serve.)"""
        if self.pool is not None:
            self.pool.pop(self.name)
        self.state, self.shared_tokens = self.rt.engine.new_state(), 0
        try:
            loaded = self.store.load(self.name, fingerprint=self.rt.fingerprint, chunk_tokens=self.opts.chunk_tokens)
            if loaded.tokens != self.log:  # the store is the truth: what it holds is what comes next
                self.messages, self.log, self.spans = list(loaded.messages), list(loaded.tokens), list(loaded.image_spans)
                self.saved_messages, self.saved_tokens = len(self.messages), len(self.log)
                self.saved_spans = len(self.spans)
            if loaded.kv_tokens:
                self._restore_kv(loaded)
            else:
                self.next_chunk = 0
        except Exception:
            # Whatever failed (the store, the replay), a fresh state is always right: the
            # next turn prefills the whole log, and the stored chunks before next_chunk stay valid.
            self.state = self.rt.engine.new_state()

    # ------------------------------------------------------------------ the turn
    def turn(self, text: str, images: list[bytes] = ()) -> TurnResult:
        """One user turn: prompt, generate, run tools until an answer or the step limit; save."""
        result = TurnResult(session=self.name, usage=self.usage)
        with self._atomic():
            content = self._user_content(text, images)
            pending = self._opening_messages() + [{"role": "user", "content": content}]
            for result.steps in range(1, self.opts.max_steps + 1):
                self._append(pending)
                message, calls, stop = self._respond()
                result.text, result.reasoning, result.stop = message["content"], message["reasoning_content"], stop
                if stop == "interrupted" or not calls:
                    break
                if result.steps == self.opts.max_steps:  # results could not be fed back: don't run
                    result.stop = message["stop"] = "max_steps"
                    break
                pending = self._run_tools(calls, result)
        self.emit({"event": "usage", **asdict(self.usage)})
        return result

    def _opening_messages(self) -> list[dict]:
        if self.log:
            return []
        system = {"role": "system", "content": self.opts.system_prompt}
        schemas = self.runner.schemas()
        if schemas:
            system["tools"] = schemas
        return [system]

    def _user_content(self, text: str, images: list[bytes]):
        if not images:
            return text
        blocks = [{"type": "text", "text": text}] if text else []
        for data in images:
            blocks.append(self._image_block(data))
        return blocks

    def _image_block(self, data: bytes) -> dict:
        sha, _ = self.rt.image_span(data)  # decodes and checks; raises ImageError on bad input
        self.new_images[sha] = data
        return {"type": "image_url", "image_url": {"url": f"sha256:{sha}"}}

    def _append(self, messages: list[dict]) -> None:
        """Render ``messages`` after the logged ones and append their ids, expanding images."""
        rendered = encode_messages(messages, context=self.messages, thinking_mode=self.opts.thinking_mode,
                                   reasoning_effort=self.opts.reasoning_effort, literal_placeholders=True)
        tokens = rendered.tokenize(self.rt.tokenizer)
        shas = [r["url"].removeprefix("sha256:") for r in rendered.images]
        lengths = [self._image_embeds(sha).shape[0] for sha in shas]
        ids, starts = expand_spans(tokens.ids, tokens.image_positions, lengths, self.rt.args.image_token_id)
        base = len(self.log)
        self.spans += [ImageSpan(base + a, base + a + n, sha) for a, n, sha in zip(starts, lengths, shas)]
        self.log += ids
        self.messages += messages

    # ------------------------------------------------------------------ history
    def add_history(self, messages: list[dict], images: dict[str, bytes] | None = None) -> None:
        """Log messages this session did not generate (an imported transcript, an evaluation
        prompt) after the log, prefill them and save; nothing is generated. ``images`` holds
        the bytes of their ``sha256:`` image blocks. When the last message is a user or tool
        turn the log ends at the generation header, which :meth:`reply` answers."""
        with self._atomic(keep_interrupted=False):  # a history is logged whole or not at all
            self.new_images.update(images or {})
            self._append(messages)
            self._prefill_pending()

    def reply(self) -> dict:
        """Generate one assistant message for the log as it stands and save; its tool calls
        are parsed, not run."""
        with self._atomic():
            message, _, _ = self._respond()
        return message

    # ------------------------------------------------------------------ model I/O
    def _prefill_pending(self) -> None:
        if self.opts.prefix_cache and self.saved_tokens == 0 and self.state.length == 0:
            self._reuse_prefix()
        start, end = self.state.length, len(self.log)
        if start == end:
            return
        ids = torch.tensor([self.log[start:end]])
        touched, self._touched = self._touched, True
        try:
            self.rt.engine.prefill(self.state, ids, images=self._images(start, end),
                                   progress=lambda done, total: self.emit({"event": "prefill", "done": done,
                                                                           "total": total}))
        except ContextLimitError:  # the engine's own advice names no flag this command has
            self._touched = touched  # refused before the state was touched (Engine._check_room)
            raise ContextFullError(f"session {self.name}: {start} tokens so far + {end - start} new exceed the "
                                   f"model's context of {self.rt.engine.max_context} tokens; start a new session "
                                   "(run without --session or with a new name; /clear in chat)") from None
        self.usage.prompt_tokens += end - start

    def _reuse_prefix(self) -> None:
        """A new session's first prompt: take the global KV that other sessions stored for the
        same leading tokens (the system prompt and tool schemas, in whole chunks), replay the
        window before it as a resume does, and leave the rest to the prefill. The first save
        links those chunks instead of writing them again."""
        prefix = self.store.prefix_chunks(self.log, self.spans, fingerprint=self.rt.fingerprint,
                                          chunk_tokens=self.opts.chunk_tokens)
        for w in prefix.warnings:
            self.emit({"event": "warning", "message": w})
        if prefix.kv_tokens:
            self._touched = True
            self._restore_kv(prefix, own=False)
            self.shared_tokens = self.next_chunk

    def _respond(self) -> tuple[dict, list[dict], str]:
        """Prefill what is pending, stream the reply, parse it into a message and calls."""
        self._prefill_pending()
        ids, stop = self._generate()
        text = self.rt.tokenizer.decode(ids)
        try:
            message = parse_completion(text, self.opts.thinking_mode)
            error = None
        except DSMLError as e:
            message, error = _unparsed(text, self.rt.tokenizer), str(e)
        calls = [{**c, "id": f"call_{len(self.log)}_{i}"} for i, c in enumerate(message.get("tool_calls", []))]
        message["tool_calls"], message["stop"] = calls, stop  # the stop is saved with it (the export marks it)
        self.messages.append(message)
        if error and stop not in ("interrupted", "max_tokens"):  # a reply cut short is reported once, as cut short
            self.emit({"event": "tool_error", "message": error})
            calls = [{"id": None, "error": error}]
        elif error:
            calls = []
        return message, calls, stop

    def _generate(self) -> tuple[list[int], str]:
        """Generate until EOS / the limit / Ctrl-C; the ids go to the log. A reply that did not
        end in EOS gets one appended, so the next turn starts from a closed assistant turn."""
        eos, ids, stop = self.rt.tokenizer.eos_id, [], "max_tokens"
        params = Sampling(**{**asdict(self.opts.sampling), "stop_ids": (eos,)})
        stream = _TextStream(self.rt.tokenizer, StreamParser(self.opts.thinking_mode), self.emit)
        self._touched = True
        tokens = self.speculator.generate(self.state, params, list(self.log)) if self.speculator \
            else self.rt.engine.generate(self.state, params)
        try:
            for token in tokens:
                ids.append(token)
                self.log.append(token)
                stream.push(ids)
                self.emit({"event": "generating", "tokens": len(ids)})
                if token == eos:
                    stop = "eos"
        except KeyboardInterrupt:
            stop = "interrupted"
        self.usage.completion_tokens += len(ids)
        if stop != "eos":
            ids.append(eos)
            self.log.append(eos)
        return ids, stop

    def _images(self, begin: int, end: int):
        """(embeds [1, n, D], mask [1, n]) of the image spans in log[begin:end], or None."""
        spans = [s for s in self.spans if s.start < end and s.end > begin]
        if not spans:
            return None
        d = self.rt.args.hidden_size
        emb = torch.zeros(1, end - begin, d, dtype=self.rt.model.embed.weight.dtype, device=self.rt.model.device)
        mask = torch.zeros(1, end - begin, dtype=torch.bool, device=self.rt.model.device)
        for s in spans:
            rows = self._image_embeds(s.sha256)
            a, b = max(s.start, begin), min(s.end, end)
            emb[0, a - begin:b - begin] = rows[a - s.start:b - s.start]
            mask[0, a - begin:b - begin] = True
        return emb, mask

    def _image_embeds(self, sha: str) -> torch.Tensor:
        data = self.new_images.get(sha) or self.store.image(sha)
        return self.rt.image_span(data)[1]

    # ------------------------------------------------------------------ tools
    def _run_tools(self, calls: list[dict], result: TurnResult) -> list[dict]:
        """Run each call (or report its parse error) and return the tool messages to append."""
        out = []
        for call in calls:
            if call.get("error"):
                out.append({"role": "user", "content": f"Your tool call could not be parsed: {call['error']}. "
                                                       "Write tool calls in the DSML format."})
                continue
            name, raw = call["function"]["name"], call["function"]["arguments"]
            self.emit({"event": "tool_call", "id": call["id"], "name": name, "arguments": raw})
            res = self.runner.run(name, raw)
            record = {"id": call["id"], "name": name, "arguments": raw, "ok": res.ok, "result": res.text,
                      "denied": res.denied, "images": len(res.images)}
            result.tool_calls.append(record)
            self.emit({"event": "tool_result", **record})
            out.append({"role": "tool", "tool_call_id": call["id"], "content": self._tool_content(res)})
        return out

    def _tool_content(self, res):
        blocks = []
        for data in res.images:
            try:
                blocks.append(self._image_block(data))
            except Exception as e:  # a broken or unreadable image is reported, never fatal
                res.text += f"\n[image not shown: {e}]"
        return [{"type": "text", "text": res.text}] + blocks if blocks else res.text

    # ------------------------------------------------------------------ save / close
    def save(self, kv: bool = True) -> None:
        """One transaction: new messages, tokens, image spans, images and (unless ``kv`` is
        False) KV chunks. The log ends at a closed turn unless its newest message awaits a
        reply (``add_history``)."""
        mult = math.lcm(*(r for r in self.rt.args.ratios if r)) if any(self.rt.args.ratios) else 1
        k = self.state.cache.stored_tokens(mult) if kv else 0
        ct, chunks = self.opts.chunk_tokens, []
        for c in range(self.next_chunk, k, ct):
            chunks.append(KVChunk(c, min(c + ct, k), self.state.cache.export_range(c, min(c + ct, k))))
        res = self.store.save_point(
            self.name, messages=self.messages[self.saved_messages:], new_tokens=self.log[self.saved_tokens:],
            image_spans=self.spans[self.saved_spans:], images=self.new_images, kv_chunks=chunks,
            fingerprint=self.rt.fingerprint, chunk_tokens=ct, shared_tokens=self.shared_tokens if kv else 0,
            closed=not self.messages or self.messages[-1].get("role") == "assistant")
        self.saved_messages, self.saved_tokens, self.saved_spans = len(self.messages), len(self.log), len(self.spans)
        self.next_chunk, self.new_images, self.shared_tokens = res.next_chunk_start, {}, 0
        self.last_save = res

    def stats(self) -> dict:
        c = self.state.cache
        return {"session": self.name, "tokens": len(self.log), "state_tokens": self.state.length,
                "kv_global_bytes": c.global_bytes(), "local_state_bytes": c.local_bytes(),
                "images": len(self.spans), "usage": asdict(self.usage)}

    def close(self) -> None:
        if self.pool is not None and self.name:
            c = self.state.cache
            self.pool.put(self.name, self.state, c.global_bytes() + c.local_bytes(), position=len(self.log))
        self._stack.close()

    def __enter__(self) -> "Agent":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()


class _TextStream:
    """Incremental detokenisation into the DSML stream parser, holding back split UTF-8."""

    def __init__(self, tokenizer, parser: StreamParser, emit):
        self.tok, self.parser, self.emit, self.sent = tokenizer, parser, emit, 0

    def push(self, ids: list[int]) -> None:
        text = self.tok.decode(ids)
        if text.endswith("\ufffd"):
            return
        for ev in self.parser.feed(text[self.sent:]):
            if isinstance(ev, TextDelta):
                self.emit({"event": "token", "text": ev.text})
            elif isinstance(ev, ReasoningDelta):
                self.emit({"event": "reasoning", "text": ev.text})
        self.sent = len(text)


def _unparsed(text: str, tokenizer) -> dict:
    eos = tokenizer.decode([tokenizer.eos_id])
    return {"role": "assistant", "content": text.removesuffix(eos), "reasoning_content": "", "tool_calls": []}


def _exists(store: Store, name: str) -> bool:
    from sessions import SessionNotFound

    try:
        store.get_session(name)
        return True
    except SessionNotFound:
        return False

