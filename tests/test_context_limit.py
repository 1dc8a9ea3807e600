"""The engine's context-limit error points at a remedy that exists: no flag of that name was
ever defined (it once advised raising a `--max-context`), so it says to start a new session."""
from types import SimpleNamespace

import pytest

from model.args import ModelArgs
from model.engine import ContextLimitError, Engine, State


def test_the_context_limit_error_names_no_missing_flag():
    engine = Engine(SimpleNamespace(args=ModelArgs.preset("tiny"), device="cpu"), max_context=40)
    state = State(cache=SimpleNamespace(length=30))
    with pytest.raises(ContextLimitError) as caught:
        engine._check_room(state, 11)
    message = str(caught.value)
    assert "context limit of 40" in message and "start a new session" in message
    assert "--" not in message  # the engine knows no command line; the agent adds the command's own advice
