"""Start-up: commands that run no model import neither torch nor the network.

Each case runs in a fresh interpreter (a test process has torch loaded already) and reads
`sys.modules` after the command; timings are a measurement in the README, never a test.
"""
import json
import os
import subprocess
import sys

import pytest

CHILD = """
import json, sys
from dsagent.cli import app
try:
    app(prog_name="dsagent", args=sys.argv[1:])
except SystemExit as e:
    code = e.code
heavy = sorted(m for m in ("torch", "model.model", "model.loading", "model.engine", "dsagent.agent")
               if m in sys.modules)
print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
"""


def _run(tmp_path, *args) -> dict:
    env = {**os.environ, "DSAGENT_HOME": str(tmp_path / "home"), "COLUMNS": "100"}
    r = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, env=env, timeout=120,
                       stdin=subprocess.DEVNULL, cwd=tmp_path)
    return json.loads(r.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("args, code", [
    (["--help"], 0),
    (["run", "--help"], 0),
    (["sessions", "list"], 0),
    (["run", "--bogus", "hi"], 2),  # a flag the command does not have
    (["run", "--thinking", "maybe", "hi"], 2),  # a value the flag refuses
    (["run", "--image", "nope.png", "hi"], 2),
    (["run", "--thinking", "thinking", "hi"], 2),  # the embedded default never learnt it
    (["run", "--tool", "nosuch", "hi"], 2),
    (["chat", "--policy", "sometimes"], 2),
    (["run", ""], 2),  # an empty prompt, nothing on stdin
])
def test_commands_that_run_no_model_do_not_import_torch(tmp_path, args, code):
    out = _run(tmp_path, *args)
    assert out == {"code": code, "heavy": []}
    assert not (tmp_path / "home" / "sessions.db").exists() or args == ["sessions", "list"]


def test_eval_flag_defaults_are_the_evaluations_own():
    """`dsagent eval` writes its defaults out (importing dsagent.evaluate would import torch)."""
    from dsagent.commands import eval as eval_cmd
    from dsagent.corpus import RECALL_TOKENS
    from dsagent.evaluate import HELD_OUT_SEED, MAX_NEW_TOKENS, MODES, SKILLS

    assert (eval_cmd.HELD_OUT_SEED, eval_cmd.MODES, eval_cmd.SKILLS, eval_cmd.MAX_NEW_TOKENS,
            eval_cmd.RECALL_TOKENS) == (HELD_OUT_SEED, MODES, SKILLS, MAX_NEW_TOKENS, RECALL_TOKENS)


# What the `dsagent` console script runs, with Ctrl-C arriving while dsagent.cli imports typer:
# a finder placed first on sys.meta_path raises KeyboardInterrupt as a real SIGINT would there.
INTERRUPTED_IMPORT = """
import sys

class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == "typer":
            raise KeyboardInterrupt
        return None

sys.meta_path.insert(0, CtrlC())
from dsagent.cli import app
sys.exit(app())
"""


def test_ctrl_c_while_importing_exits_130_without_a_traceback(tmp_path):
    env = {**os.environ, "DSAGENT_HOME": str(tmp_path / "home")}
    r = subprocess.run([sys.executable, "-c", INTERRUPTED_IMPORT, "--help"], capture_output=True, text=True,
                       env=env, timeout=120, stdin=subprocess.DEVNULL, cwd=tmp_path)
    assert (r.returncode, r.stdout, r.stderr) == (130, "", "interrupted\n")
