"""The shared-prefix benchmark (`dsagent bench prefix`): a new session's first turn with and
without the KV that another session stored for the same system prompt and tool schemas,
side by side in one run.

Owns: the sessions of the measurement (in a temporary store that goes with it), their
timing and the figures returned. Does not own the reuse itself (`dsagent.agent`,
`sessions.Store.prefix_chunks`) or printing (`dsagent bench prefix` prints the dict).

One session ("Hello.") stores the prompt's chunks first; then rounds of two new sessions
with the same question, one with the prefix cache off and one with it on, alternate, so
that whatever else loads the machine falls on both. Each is timed to its first generated
token (the prompt's prefill, and for the reusing one the lookup, import and replay), and
its first save is read for the KV bytes it wrote.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dsagent.agent import Agent, AgentOptions
from dsagent.runtime import Runtime
from model.engine import Sampling
from sessions import Store


@dataclass
class _Run:
    first_token_s: float
    reply: list[int]
    usage: dict
    kv_bytes_written: int


def _first_turn(rt: Runtime, store: Store, name: str, prompt: str, reuse: bool, max_new_tokens: int) -> _Run:
    opts = AgentOptions(session=name, workspace=store.home, policy="deny", speculative=False, prefix_cache=reuse,
                        sampling=Sampling(max_new_tokens=max_new_tokens))
    first: list[float] = []

    def on_event(event: dict) -> None:
        if event["event"] == "generating" and not first:
            first.append(time.perf_counter())

    with Agent(rt, store, opts, on_event=on_event) as agent:
        start = len(agent.log)
        t0 = time.perf_counter()
        result = agent.turn(prompt)
        reply = agent.log[start:]
    return _Run(first[0] - t0, reply, asdict(result.usage), agent.last_save.kv_bytes_written)


def bench_prefix(rt: Runtime, *, prompt: str = "What is 48 * 12?", rounds: int = 3,
                 max_new_tokens: int = 16) -> dict:
    """Figures of a new session's first turn with the prefix cache off and on (medians of ``rounds``)."""
    with tempfile.TemporaryDirectory(prefix="dsagent-bench-") as home, Store.open(Path(home)) as store:
        _first_turn(rt, store, "stored", "Hello.", False, 1)
        runs: dict[bool, list[_Run]] = {False: [], True: []}
        for i in range(rounds):
            for reuse in (False, True):
                runs[reuse].append(_first_turn(rt, store, f"{'on' if reuse else 'off'}-{i}", prompt, reuse,
                                               max_new_tokens))
        kv = store.db.execute("select count(distinct key), sum(stored_bytes) from kv_chunks").fetchone()
    off, on = (statistics.median(r.first_token_s for r in runs[reuse]) for reuse in (False, True))
    reusing = runs[True][0].usage
    return {"bench": "prefix", "rounds": rounds, "prompt_tokens": runs[False][0].usage["prompt_tokens"],
            "reused_tokens": reusing["cached_tokens"], "replayed_tokens": reusing["replayed_tokens"],
            "prefilled_tokens_with_reuse": reusing["prompt_tokens"],
            "first_token_s_without": off, "first_token_s_with": on, "speedup": off / on,
            "same_reply": all(r.reply == runs[False][0].reply for r in runs[False] + runs[True]),
            "kv_bytes_written_without": runs[False][0].kv_bytes_written,
            "kv_bytes_written_with": runs[True][0].kv_bytes_written,
            "store_kv_chunks": kv[0], "store_kv_bytes": kv[1]}
