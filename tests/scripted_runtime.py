"""TEST DOUBLE: a runtime whose "model" replies with scripted completions.

`ScriptedRuntime` stands in for `dsagent.runtime.Runtime` in tests of the agent loop and
the CLI: the real bundled tokenizer, the real `tiny` ModelArgs (no weights), and
`ScriptedEngine`, which consumes prompts without computing anything and "generates" the
token ids of the next scripted completion (DSML tool calls included), then EOS. It keeps
no KV, so saves store the transcript and token log only. Not a model: never use it to
test model numerics.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from model.args import ModelArgs
from model.engine import ContextLimitError, Sampling, State
from model.tokenizer import Tokenizer


def tool_call(name: str, **params: str) -> str:
    """A completion that calls one tool, in the V4.1 DSML spelling."""
    body = "".join(f'<｜DSML｜ parameter name="{k}" string="true">{v}</｜DSML｜ parameter>\n' for k, v in params.items())
    return f'Let me check.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="{name}">\n{body}</｜DSML｜ invoke>\n</｜DSML｜ calls>'


class _NoKV:
    """The cache of the double: a length and nothing stored."""

    def __init__(self):
        self.length = 0

    def stored_tokens(self, multiple: int) -> int:
        return 0

    def global_bytes(self) -> int:
        return 0

    def local_bytes(self) -> int:
        return 0


class ScriptedEngine:
    """TEST DOUBLE of `model.engine.Engine`: replies are taken from ``script`` in order."""

    def __init__(self, tokenizer: Tokenizer, script: list[str]):
        self.tok, self.script = tokenizer, list(script)
        self.prompts: list[list[int]] = []  # every prefilled id run, for assertions
        self.max_context = 1 << 20  # a test lowers it to hit the limit, refused as Engine does

    def new_state(self) -> State:
        return State(cache=_NoKV())

    def prefill(self, state: State, ids: torch.Tensor, images=None, progress=None):
        if state.cache.length + ids.shape[1] > self.max_context:
            raise ContextLimitError(f"over the context limit of {self.max_context} tokens")
        self.prompts.append(ids[0].tolist())
        state.cache.length += ids.shape[1]
        if progress is not None:
            progress(ids.shape[1], ids.shape[1])

    def replay(self, state: State, log_ids: torch.Tensor, images=None, tokens=None):
        return None

    def generate(self, state: State, params: Sampling):
        reply = self.script.pop(0) if self.script else "(script exhausted)"
        ids = self.tok.encode_content(reply) + [self.tok.eos_id]
        for i, token in enumerate(ids[: params.max_new_tokens]):
            yield token
            if token in params.stop_ids or i == params.max_new_tokens - 1:
                return
            state.cache.length += 1


class ScriptedRuntime:
    """TEST DOUBLE of `dsagent.runtime.Runtime` over a `ScriptedEngine`."""

    def __init__(self, script: list[str]):
        self.tokenizer = Tokenizer.bundled()
        self.engine = ScriptedEngine(self.tokenizer, script)
        self.args = ModelArgs.preset("tiny")
        self.model = SimpleNamespace(device=torch.device("cpu"))
        self.fingerprint, self.source = "scripted-test-double", "scripted"

    def image_span(self, data: bytes):
        raise ValueError("the scripted test double has no vision tower")

    def close(self) -> None:  # as Runtime's: no other ranks to stop
        pass

    def __enter__(self) -> "ScriptedRuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def prompt_text(self, i: int) -> str:
        return self.tokenizer.decode(self.engine.prompts[i])
