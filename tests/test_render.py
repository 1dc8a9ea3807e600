"""What the terminal is told while a turn runs (`dsagent.render`): the status line's words,
the load bar's unit, JSON lines, and a stdout whose reader left.

The status line is read through `Activity.status()` with a hand-driven clock, so no test
waits for a timer or depends on speed.
"""
import io

import pytest
from rich.console import Console

from dsagent.failures import OutputClosed
from dsagent.render import Activity, JsonlWriter, load_progress, stop_note


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _activity(seen=None, **kw):
    clock = Clock()
    err = Console(file=io.StringIO(), force_terminal=False)
    act = Activity(err, (seen.append if seen is not None else (lambda e: None)), clock=clock,
                   stdout_is_terminal=kw.pop("stdout_is_terminal", False), **kw)
    return act, clock


def test_prefilling_says_tokens_and_tokens_per_second():
    act, clock = _activity()
    act.start()
    assert act.status() == "prefilling"
    clock.t += 2.0
    act({"event": "prefill", "done": 1024, "total": 2204})
    assert act.status() == "prefilling 1,024/2,204 tokens · 512 tokens/s"
    clock.t += 2.0
    act({"event": "prefill", "done": 2204, "total": 2204})
    clock.t += 5.0
    assert act.status() == "generating · 5 s"  # the prompt is in: no rate left to decay


def test_generating_counts_tokens_and_a_tool_is_named():
    act, clock = _activity()
    act.start()
    act({"event": "generating", "tokens": 37})
    assert act.status() == "generating · 37 tokens"
    act({"event": "tool_call", "id": "c", "name": "read_file", "arguments": {}})
    clock.t += 3.2
    assert act.status() == "calling read_file · 3 s"
    act({"event": "tool_result", "id": "c", "name": "read_file", "arguments": {}, "ok": True, "result": "x",
         "denied": False, "images": 0})
    assert act.status() == "prefilling"  # the result is prefilled next


def test_generating_without_a_count_says_how_long():
    act, clock = _activity()
    act.start()
    act({"event": "token", "text": "Hi"})
    clock.t += 4
    assert act.status() == "generating · 4 s"


def test_the_line_is_only_drawn_on_a_terminal():
    act, _ = _activity()
    assert act.show is False  # a StringIO console is no terminal
    act.start()
    act._appear()  # what the timer would do
    assert act._live is None


def test_text_streaming_to_the_same_terminal_holds_the_line_down():
    act, _ = _activity(stdout_is_terminal=True)
    act.start()
    act({"event": "token", "text": "Hello"})
    assert act._held
    act({"event": "tool_call", "id": "c", "name": "calculator", "arguments": {}})
    assert not act._held  # a whole line was printed: the line may come back


def test_paused_prints_the_note_in_the_lines_place():
    act, _ = _activity()
    with act.paused("waiting for approval: run_shell(ls)"):
        pass
    assert "waiting for approval: run_shell(ls)" in act.err.file.getvalue()


def test_a_closed_stdout_becomes_output_closed_once(monkeypatch):
    def writer(event):
        raise BrokenPipeError

    silenced = []
    monkeypatch.setattr("dsagent.render.silence_stdout", lambda: silenced.append(1))  # not pytest's own stdout
    act, _ = _activity()
    act.on_event = writer
    with pytest.raises(OutputClosed):
        act({"event": "token", "text": "x"})
    assert act.closed
    act({"event": "token", "text": "y"})  # later events are dropped, not raised again
    assert silenced == [1]


def test_jsonl_leaves_the_running_count_out():
    buf = io.StringIO()
    w = JsonlWriter(buf)
    w({"event": "generating", "tokens": 3})
    w({"event": "prefill", "done": 512, "total": 2204})
    assert buf.getvalue() == '{"event": "prefill", "done": 512, "total": 2204}\n'


def test_the_load_bar_counts_tensors():
    err = Console(file=io.StringIO(), force_terminal=True, width=100, no_color=True, record=True)
    with load_progress(err, "loading model") as progress:
        progress(41, 519)
    assert "41/519 tensors" in err.export_text()


@pytest.mark.parametrize("stop, said", [("max_steps", "stopped at --max-steps 8"),
                                        ("max_tokens", "cut short at --max-new-tokens 256"),
                                        ("eos", None), ("interrupted", None)])
def test_stop_notes(stop, said):
    note = stop_note(stop, 8, 256)
    assert (note is None) if said is None else (said in note)
