"""Every `dsagent` command through typer's CliRunner.

`run` and `chat` go through the scripted test double (tests/scripted_runtime.py) so that
flags, output modes and exit codes are checked fast; `bench`, `model init` and `doctor`
use the real tiny model. The real model's turn loop is tests/test_e2e.py.
"""
import json
import os
import subprocess
import sys
import tempfile
import types

import pytest
from typer.testing import CliRunner

import dsagent.cli as cli
from dsagent.settings import resolve
from sessions import Store
from tests.scripted_runtime import ScriptedRuntime, tool_call


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DSAGENT_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    for var in ("DSAGENT_MODEL", "DSAGENT_PRESET", "DSAGENT_POLICY", "NO_COLOR"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path / "home"


@pytest.fixture
def script(monkeypatch):
    """Make `run`/`chat` load a ScriptedRuntime (a test double) replying with the given completions."""
    def use(*replies: str) -> ScriptedRuntime:
        rt = ScriptedRuntime(list(replies))
        monkeypatch.setattr(cli, "load_runtime", lambda d, device, weights="plain", gpus=1, engram="device": rt)
        return rt
    return use


def invoke(*args, input=None):
    return CliRunner().invoke(cli.app, list(args), input=input)


# ---------------------------------------------------------------------------- run
def test_run_json_has_result_and_usage(script):
    script(tool_call("calculator", expression="6*7"), "It is 42.")
    r = invoke("run", "6*7?", "--session", "a", "--tool", "calculator", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["session"] == "a" and out["text"] == "It is 42." and out["tool_calls"][0]["result"] == "42"
    assert set(out["usage"]) == {"prompt_tokens", "completion_tokens", "cached_tokens", "replayed_tokens"}


def test_run_jsonl_streams_events_then_the_result(script):
    script(tool_call("calculator", expression="1+2"), "3")
    r = invoke("run", "1+2?", "--tool", "calculator", "--jsonl")
    events = [json.loads(line) for line in r.stdout.splitlines()]
    kinds = [e["event"] for e in events]
    assert {"token", "tool_call", "tool_result", "usage"} <= set(kinds) and kinds[-1] == "result"
    assert events[-1]["text"] == "3"


def test_run_plain_streams_text_to_stdout(script):
    script("Hello there.")
    r = invoke("run", "hi", "--tool", "calculator")
    assert r.exit_code == 0 and "Hello there." in r.stdout and "session" in r.stderr


def test_run_exit_3_when_approval_is_needed(script, tmp_path):
    script(tool_call("write_file", path="x.txt", content="hi"), "Could not.")
    r = invoke("run", "write", "--tool", "write_file", "--json")
    assert r.exit_code == 3 and json.loads(r.stdout)["tool_calls"][0]["denied"]
    assert not (tmp_path / "x.txt").exists()


def test_run_yes_approves(script, tmp_path):
    script(tool_call("write_file", path="x.txt", content="hi"), "Done.")
    r = invoke("run", "write", "--tool", "write_file", "--yes", "--json")
    assert r.exit_code == 0 and (tmp_path / "x.txt").read_text() == "hi"


def test_run_policy_deny_is_not_exit_3(script):
    script(tool_call("write_file", path="x.txt", content="hi"), "Denied.")
    r = invoke("run", "write", "--tool", "write_file", "--policy", "deny", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["tool_calls"][0]["denied"]


@pytest.mark.parametrize("args", [["--json", "--jsonl"], ["--model", "x", "--preset", "tiny"],
                                  ["--image", "missing.png"], ["--policy", "sometimes"], ["--max-steps", "0"]])
def test_run_usage_errors_exit_2(script, args):
    script("unused")
    r = invoke("run", "hi", *args)
    assert r.exit_code == 2, r.output


@pytest.fixture
def never_loads(monkeypatch, home):
    """For flags refused up front: loading a model fails the test, and the store must stay unmade."""
    def load(d, device, weights="plain", gpus=1, engram="device"):
        raise AssertionError("the model was loaded before the flags were checked")
    monkeypatch.setattr(cli, "load_runtime", load)
    yield
    assert not (home / "sessions.db").exists()


@pytest.mark.parametrize("command", ["run", "chat"])
def test_unknown_tool_is_a_usage_error_listing_the_known_ones(never_loads, command):
    r = invoke(command, *(["hi"] if command == "run" else []), "--tool", "calculator", "--tool", "nosuch")
    assert r.exit_code == 2 and "unknown tool 'nosuch'" in r.stderr
    assert "known tools: read_file, list_dir" in r.stderr and "calculator" in r.stderr


@pytest.mark.parametrize("args, named", [
    (["--workspace", "no/such/dir"], "--workspace no/such/dir does not exist"),
    (["--workspace", "file.txt"], "--workspace file.txt is not a directory"),
    (["--policy", "deny", "--yes"], "--yes or --policy deny, not both"),
    (["--policy", "sometimes"], "--policy 'sometimes' is not one of ask, yes, deny"),
    (["--seed", str(2**64)], "--seed"),
    (["--seed", str(-2**63 - 1)], "--seed"),
    (["--temperature", "nan"], "--temperature"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--session", "no spaces"], "--session: invalid session name 'no spaces'"),
])
def test_bad_flags_exit_2_before_anything_loads(never_loads, tmp_path, args, named):
    (tmp_path / "file.txt").write_text("x")
    r = invoke("run", "hi", *args)
    assert r.exit_code == 2 and named in r.output, r.output
    assert "Traceback" not in r.output and "internal error" not in r.output


@pytest.mark.parametrize("var, value", [("DSAGENT_TEMPERATURE", "nan"), ("DSAGENT_TEMPERATURE", "-1"),
                                        ("DSAGENT_TEMPERATURE", "warm"), ("DSAGENT_MAX_NEW_TOKENS", "0"),
                                        ("DSAGENT_POLICY", "always")])
def test_a_setting_its_flag_would_refuse_exits_2(never_loads, monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    r = invoke("run", "hi")
    assert r.exit_code == 2 and r.stderr.startswith(f"error: {var}:"), r.output


def test_a_config_file_value_its_flag_would_refuse_exits_2(never_loads, home):
    home.mkdir(parents=True)
    (home / "config.toml").write_text("max_new_tokens = 0\n")
    r = invoke("chat")
    assert r.exit_code == 2 and "config.toml: max_new_tokens = 0 is not 1 or more" in r.stderr


def test_a_full_context_names_a_real_remedy(script):
    rt = script("unused")
    rt.engine.max_context = 50
    r = invoke("run", "hi", "--session", "full", "--tool", "calculator")
    assert r.exit_code == 1 and "exceed the model's context of 50 tokens" in r.stderr
    assert "start a new session" in r.stderr and "--max-context" not in r.stderr


def test_run_prompt_with_undecodable_bytes(script):
    """`dsagent run $'caf\\xe9 \\xff'`: Python hands argv over with surrogate escapes."""
    script("Noted.")
    r = invoke("run", "caf\udce9 \udcff", "--session", "u", "--tool", "calculator", "--json")
    assert r.exit_code == 0, r.output
    with Store.open() as st:
        assert st.messages("u")[1]["content"] == "caf\ufffd \ufffd"


def test_chat_input_with_undecodable_bytes(script):
    script("Noted.")
    r = invoke("chat", "--session", "c", "--tool", "calculator", input=b"caf\xe9 \xff\n")
    assert r.exit_code == 0, r.output
    with Store.open() as st:
        assert st.messages("c")[1]["content"] == "caf\ufffd \ufffd"


def test_run_lists_a_file_name_that_is_not_utf8(script, tmp_path):
    try:
        (tmp_path / os.fsdecode(b"caf\xe9.txt")).write_text("x")
    except OSError:
        pytest.skip("this file system refuses names that are not UTF-8")
    script(tool_call("list_dir", path="."), "One file.")
    r = invoke("run", "ls", "--tool", "list_dir", "--json")
    assert r.exit_code == 0, r.output
    assert "caf\ufffd.txt  1 bytes" in json.loads(r.stdout)["tool_calls"][0]["result"]


def test_run_bad_model_dir_exits_1():
    r = invoke("run", "hi", "--model", "/no/such/dir")  # the real loader
    assert r.exit_code == 1 and "error:" in r.stderr and "/no/such/dir" in r.stderr


def test_run_interrupted_exits_130(script, monkeypatch):
    rt = script("never")
    def interrupted(state, params):
        raise KeyboardInterrupt
        yield
    monkeypatch.setattr(rt.engine, "generate", interrupted)
    r = invoke("run", "hi", "--tool", "calculator", "--session", "k", "--json")
    assert r.exit_code == 130 and json.loads(r.stdout)["stop"] == "interrupted"
    with Store.open() as st:
        assert st.get_session("k").n_messages >= 2  # the session was kept


# ---------------------------------------------------------------------------- chat
def test_chat_slash_commands(script, home):
    script("Hi!", "Second.")
    text = "\n".join(["hello", "/tools", "/stats", "/session", "/image missing.png", "/bogus",
                      "/session other", "two \\", "lines", "/help", "/exit", ""])
    r = invoke("chat", "--session", "first", "--tool", "calculator", input=text)
    assert r.exit_code == 0, r.output
    assert "Hi!" in r.stdout and "Second." in r.stdout and "calculator" in r.stdout
    assert "tokens in the log" in r.stdout and "first:" in r.stdout
    assert "no such image: missing.png" in r.stderr and "Errno" not in r.stderr  # --image's words, not the OS's
    assert "unknown command /bogus" in r.stderr
    with Store.open() as st:
        assert st.messages("other")[1]["content"] == "two \nlines"
        assert [s.name for s in st.list_sessions()] == ["other", "first"]


def test_chat_block_input_clear_and_eof(script):
    script("ok", "ok2")
    r = invoke("chat", "--tool", "calculator", input='"""\na\nb\n"""\n/clear\nnext\n')
    assert r.exit_code == 0, r.output
    with Store.open() as st:
        sessions = st.list_sessions()
        assert len(sessions) == 2 and st.messages(sessions[1].name)[1]["content"] == "a\nb"


def test_chat_message_without_its_outer_whitespace(script):
    script("ok", "ok2")
    r = invoke("chat", "--session", "w", "--tool", "calculator", input='What is 2 + 3?  \n"""\n\n  a\n b\n\n"""\n')
    assert r.exit_code == 0, r.output
    with Store.open() as st:
        assert [m["content"] for m in st.messages("w") if m["role"] == "user"] == ["What is 2 + 3?", "a\n b"]


def test_chat_continue_without_sessions_starts_one(script):
    script("fresh")
    r = invoke("chat", "-c", "--tool", "calculator", input="hey\n")
    assert r.exit_code == 0 and "no session to continue" in r.stderr
    assert invoke("chat", "-c", "--session", "x", input="").exit_code == 2


# ---------------------------------------------------------------------------- settings
def test_config_file_env_and_flags(home, monkeypatch):
    home.mkdir(parents=True)
    (home / "config.toml").write_text('preset = "tiny"\npolicy = "deny"\nmax_new_tokens = 9\n')
    d = resolve()
    assert (d.preset, d.policy, d.max_new_tokens) == ("tiny", "deny", 9)
    monkeypatch.setenv("DSAGENT_POLICY", "yes")
    assert resolve().policy == "yes" and resolve(policy="ask").policy == "ask"
    assert resolve(model="/m").preset is None  # a model flag overrides a configured preset
    (home / "config.toml").write_text("colour = 1\n")
    with pytest.raises(ValueError, match="unknown key"):
        resolve()


def test_no_color_is_honoured(monkeypatch):
    from dsagent.render import consoles
    monkeypatch.setenv("NO_COLOR", "1")
    assert all(c.no_color for c in consoles())


# ---------------------------------------------------------------------------- other commands
def test_doctor_json():
    r = invoke("doctor", "--json")
    checks = json.loads(r.stdout)
    assert r.exit_code == 0 and checks["packages"]["ok"] and "sessions.db" in checks["store"]["detail"]
    assert {"torch", "flash-attn", "embedded model"} <= set(checks)


def test_sessions_are_mounted(script):
    script("x")
    invoke("run", "hi", "--session", "kept", "--tool", "calculator")
    r = invoke("sessions", "list", "--json")
    assert [s["name"] for s in json.loads(r.stdout)] == ["kept"]


def test_model_init_writes_a_loadable_checkpoint(tmp_path):
    r = invoke("model", "init", str(tmp_path / "ck"), "--preset", "tiny", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["tensors"] > 0 and (tmp_path / "ck" / "config.json").is_file()
    assert invoke("model", "init", str(tmp_path / "ck")).exit_code == 1  # not empty: refused
    assert invoke("model", "init", str(tmp_path / "ck2"), "--seed", str(2**64)).exit_code == 2  # torch's range
    assert not (tmp_path / "ck2").exists()
    assert invoke("model", "info", "--model", str(tmp_path / "ck"), "--json").exit_code == 0  # mounted beside init


@pytest.mark.parametrize("which", ["prefill", "decode", "resume", "store"])
def test_bench_commands(which):
    r = invoke("bench", which, "--preset", "tiny", "--ctx", "32", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["bench"] == which
    if which == "decode":  # bytes a step reads over the step time, against the copy rate of this run
        assert out["read_bytes_long"]["total"] > out["read_bytes_long"]["weights"] > 0
        assert out["bandwidth_over_copy"] == pytest.approx(out["read_tb_per_s_long"] / out["copy_tb_per_s"])


def test_bench_decode_paths_turns_each_switch_off_in_turn(monkeypatch):
    monkeypatch.setenv("DSAGENT_GRAPHS", "1")
    monkeypatch.delenv("DSAGENT_KERNELS", raising=False)
    r = invoke("bench", "decode", "--paths", "--batch", "2", "--preset", "tiny", "--ctx", "32", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["batch"] == 2
    switches = {"graphs", "kernels", "fused_moe", "grouped_moe", "pdl", "mhc_overlap", "select", "gemv"}
    assert set(out["step_ms"]) == switches | {"all_on"} and set(out["slowdown_without"]) == switches
    assert all(v > 0 for v in out["step_ms"].values())
    assert os.environ["DSAGENT_GRAPHS"] == "1" and "DSAGENT_KERNELS" not in os.environ  # switches restored


def test_bench_knobs_times_each_variant_and_restores_the_knobs(monkeypatch):
    """``bench_knobs`` (``gpu_bench.py --knobs``) on the CPU's tiny preset, with three knobs of a
    stand-in module under ``model.kernels`` (two boolean, one given a value): every variant
    timed with its knobs set as named
    while its steps run (the control: all off again), the graphs dropped before each, the
    knobs as they were afterwards."""
    from model import load
    from model.bench import bench_knobs
    from model.engine import Engine

    fake = types.ModuleType("model.kernels.fake_knobs")
    fake.A, fake.B, fake.N = False, True, 16
    monkeypatch.setitem(sys.modules, "model.kernels.fake_knobs", fake)
    seen, decode = set(), Engine.decode
    monkeypatch.setattr(Engine, "decode",
                        lambda self, *a, **k: seen.add((fake.A, fake.B, fake.N)) or decode(self, *a, **k))
    out = bench_knobs(load("tiny"), 32, ["fake_knobs.A", "fake_knobs.B", "fake_knobs.N=8"], rounds=1, steps=2)
    assert set(out["step_ms"]) == {"all_off", "fake_knobs.A", "fake_knobs.B", "fake_knobs.N=8", "all_on", "control"}
    assert all(v > 0 for v in out["step_ms"].values()) and set(out["over_all_off"]) == set(out["step_ms"]) - {"all_off"}
    # a boolean knob is off as False; one given a value, off as the module had it
    assert seen == {(False, False, 16), (True, False, 16), (False, True, 16), (False, False, 8), (True, True, 8)}
    assert (fake.A, fake.B, fake.N) == (False, True, 16)
    # one constant at several values: a variant each, no "all on"
    seen.clear()
    out = bench_knobs(load("tiny"), 32, ["fake_knobs.N=8", "fake_knobs.N=4"], rounds=1, steps=2)
    assert set(out["step_ms"]) == {"all_off", "fake_knobs.N=8", "fake_knobs.N=4", "control"}
    assert {n for _, _, n in seen} == {16, 8, 4} and fake.N == 16


def test_bench_threads_prints_each_count_and_its_ratio_to_the_first():
    """Figures only, never timed here: that each count was run, beside one busy loop."""
    r = invoke("bench", "threads", "--preset", "tiny", "--ctx", "16", "--steps", "1", "--rounds", "1",
               "--counts", "2,1", "--co-load", "1", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["bench"] == "threads" and out["busy_loops"] == 1 and out["counts"] == [2, 1]
    assert set(out["prefill_s"]) == {"2", "1"} and out["prefill_time_over_2_threads"]["2"] == 1.0
    assert invoke("bench", "threads", "--counts", "2,x").exit_code == 2


def test_bench_linears_prints_the_ratio():
    r = invoke("bench", "linears", "--preset", "tiny", "--tokens", "32", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["bench"] == "linears" and out["tokens"] == 32 and out["moe_path"] == "grouped"
    assert {"attention", "routed_experts", "shared_experts", "head"} <= set(out["by_kind"])
    assert out["linear_flops"] > 0 and 0 < out["linear_over_matmul"] < float("inf")
    assert 0 < out["linear_share_of_prefill"] < 1


def test_bench_linears_of_a_packed_cut_preset_splits_the_flops_by_format():
    """``--weights packed --layers N`` as ``bench load`` takes them: the FP4 experts and the FP8
    projections apart; a checkpoint is not cut, and an unknown format is refused."""
    r = invoke("bench", "linears", "--preset", "tiny", "--weights", "packed", "--layers", "8", "--tokens", "32",
               "--json")
    assert r.exit_code == 0, r.output
    formats = json.loads(r.stdout)["by_format"]
    assert {"fp8", "fp4"} <= set(formats) and all(f["flops"] > 0 for f in formats.values())
    assert invoke("bench", "prefill", "--weights", "fp2", "--preset", "tiny").exit_code == 2
    assert invoke("bench", "decode", "--layers", "8").exit_code == 2  # the embedded checkpoint


def test_python_m_dsagent_help():
    r = subprocess.run([sys.executable, "-m", "dsagent", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "chat" in r.stdout and "sessions" in r.stdout


def test_bench_decode_host_sets_the_host_beside_the_step():
    """The host bench prints the step's time, the host's issue time and their ratio. (On the
    CPU the host runs the step itself, so the ratio is near 1, but it is two timings: no
    bound on it here — a CI run under load measured 0.44.)"""
    r = invoke("bench", "decode", "--host", "--preset", "tiny", "--ctx", "32", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["bench"] == "host" and out["ctx"] == 32 and out["step_ms"] > 0 and out["host_issue_ms"] > 0
    assert out["host_over_step"] == pytest.approx(out["host_issue_ms"] / out["step_ms"])


def test_bench_decode_tables_times_both_placements_of_the_engram_tables(monkeypatch):
    """``--tables``: a step and a step's gather with the Engram tables on the device and in host
    memory (the same memory on the CPU: two timings, no bound on their ratio here); refused
    over several ranks and, by name, for a model without Engram layers."""
    from model.args import ModelArgs

    r = invoke("bench", "decode", "--tables", "--preset", "tiny", "--ctx", "32", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["bench"] == "engram" and out["ctx"] == 32 and out["tables"] == len(ModelArgs.preset("tiny").engram_layer_ids)
    assert min(out["step_ms_device"], out["step_ms_host"], out["gather_us_device"], out["gather_us_host"]) > 0
    assert out["step_host_over_device"] == pytest.approx(out["step_ms_host"] / out["step_ms_device"])
    assert invoke("bench", "decode", "--tables", "--gpus", "2", "--preset", "tiny").exit_code == 2
    import model.bench

    monkeypatch.setattr(model.bench, "bench_engram", lambda m, ctx: {})  # what it gives a model without Engram
    r = invoke("bench", "decode", "--tables", "--preset", "tiny", "--ctx", "32")
    assert r.exit_code == 2 and "no Engram layers" in r.output


def test_bench_decode_profile_counts_what_a_step_launches(monkeypatch):
    monkeypatch.delenv("DSAGENT_PDL", raising=False)
    r = invoke("bench", "decode", "--profile", "--preset", "tiny", "--ctx", "32", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["bench"] == "profile" and out["unit"] == "operator"  # no CUDA here
    assert out["dependent_launches"] is False and "DSAGENT_PDL" not in os.environ  # plain launches, then restored
    assert out["launches_per_step"] > 100 and out["busy_ms_per_step"] > 0
    assert out["top"] and sum(t["share"] for t in out["top"]) <= 1.0 + 1e-9
    assert out["top"][0]["ms_per_step"] >= out["top"][-1]["ms_per_step"] and out["batch"] == 1
    r = invoke("bench", "decode", "--profile", "--batch", "2", "--chained", "--preset", "tiny", "--ctx", "32", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["batch"] == 2 and out["dependent_launches"] is True and "DSAGENT_PDL" not in os.environ


def test_a_profiles_advances_split_the_steps_span_among_its_kernels():
    """``span_advances``: a dependent launch that started inside the kernel before it advances
    the span only past that one's end; a split beside, only past the last end before its own;
    an idle device longer than HOST_GAP_US is the host's. Two steps of the same kernels: per
    step, half of each total."""
    from model.bench import HOST_GAP_US, span_advances

    assert HOST_GAP_US == 20.0
    step = [(0, 10, "a"), (5, 15, "b"), (12, 30, "split"), (60, 70, "c"), (70, 72, "b")]
    out = span_advances(step + [(s + 100, e + 100, n) for s, e, n in step], steps=2, top=3)
    assert out["advance_ms_per_step"] == pytest.approx((10 + 5 + 15 + 10 + 2) / 1e3)
    # the first step's 30 us before c, the 28 between the steps, the second's 30
    assert out["host_gaps_ms_per_step"] == pytest.approx((30 + 28 + 30) / 2 / 1e3)
    assert [t["name"] for t in out["top_advance"]] == ["split", "a", "c"]
    assert out["top_advance"][0]["ms_per_step"] == pytest.approx(15 / 1e3)
    assert out["top_advance"][0]["share"] == pytest.approx(15 / 42)


def test_a_steps_map_by_layer_splits_it_at_each_down_sum():
    """``layer_map``: a layer runs from one MoE down sum's end to the next; within it each
    kernel's advance is how far the layer's last end moved (a kernel inside another's span
    advances nothing); the spans come back grouped a step's layers at a time."""
    from model.bench import layer_map

    down = "_down_slots_kernel"
    spans = [(0, 5, down), (6, 10, "gemv"), (7, 9, "split"), (11, 25, down), (26, 40, "attn"), (41, 45, down),
             (46, 50, "gemv"), (50, 51, down)]
    out = layer_map(spans, layers=2)
    assert out["layer_us"] == [[20, 20], [6]]
    assert out["kernels"] == [[("split", 4), ("gemv", 1), (down, 15)], [("attn", 15), (down, 5)]]
    # a packed step's FP4 experts by pair: the slots' sum ends each layer, the row kernels before it
    packed = [(s, e, "_sum_slots_kernel" if n == down else n) for s, e, n in spans]
    packed.insert(1, (1, 3, "_down_rows_kernel"))
    out = layer_map(packed, layers=2)
    assert out["layer_us"] == [[20, 20], [6]]
    assert out["kernels"][0] == [("split", 4), ("gemv", 1), ("_sum_slots_kernel", 15)]


# ---------------------------------------------------------------------------- as people expect it
def test_piped_stdin_goes_before_the_prompt(script):
    """`echo hello | dsagent run "What does this say?"` (simonw/llm's convention: one space
    between); a file of several lines keeps its lines, the question on a line of its own."""
    script("It says hello.", "It says two things.")
    r = invoke("run", "What does this say?", "--session", "p", "--tool", "calculator", input="hello from a file\n")
    assert r.exit_code == 0, r.output
    r = invoke("run", "And now? ", "--session", "p2", "--tool", "calculator", input="  first line\nsecond\n\n")
    assert r.exit_code == 0, r.output
    with Store.open() as st:
        assert st.messages("p")[1]["content"] == "hello from a file What does this say?"
        assert st.messages("p2")[1]["content"] == "first line\nsecond\nAnd now?"


def test_piped_stdin_alone_is_the_prompt(script):
    """`echo "What is 12 * 13?" | dsagent run`: the message is the question, not its newline."""
    script("Noted.")
    r = invoke("run", "--session", "q", "--tool", "calculator", input="What is 12 * 13?\n")
    assert r.exit_code == 0, r.output
    with Store.open() as st:
        assert st.messages("q")[1]["content"] == "What is 12 * 13?"


def test_piped_stdin_past_the_cap_is_refused(never_loads):
    from dsagent.preflight import STDIN_CAP

    r = invoke("run", "summarise", input="x" * (STDIN_CAP + 1))
    assert r.exit_code == 2 and f"more than {STDIN_CAP:,} bytes" in r.stderr, r.output


@pytest.mark.parametrize("args", [["run", ""], ["run", "  \n"], ["run"]])
def test_an_empty_prompt_exits_2_unless_stdin_has_text(never_loads, args):
    r = invoke(*args)
    assert r.exit_code == 2 and "prompt is empty" in r.stderr, r.output


@pytest.mark.parametrize("args, said", [
    (["run", "hi", "--thinking", "maybe"], "--thinking 'maybe' is not one of chat, thinking"),
    (["chat", "--thinking", "maybe"], "--thinking 'maybe' is not one of chat, thinking"),
    (["run", "hi", "--image", "nope.png"], "no such image: nope.png"),
    (["run", "hi", "--image", "."], "is a directory"),
    (["run", "hi", "--thinking", "thinking"], "did not learn thinking mode"),
    (["chat", "--thinking", "thinking"], "did not learn thinking mode"),
    (["run", "hi", "--device", "tpu"], "--device 'tpu' is not cpu, cuda or cuda:N"),
    (["chat", "--device", "gpu"], "--device 'gpu' is not cpu, cuda or cuda:N"),
])
def test_a_command_that_fails_validation_creates_nothing(never_loads, args, said):
    """`never_loads` also checks that no store (so no empty session) was made."""
    r = invoke(*args)
    assert r.exit_code == 2 and said in r.stderr, r.output
    assert "Traceback" not in r.output


def test_cuda_without_a_cuda_build_is_a_usage_error(never_loads):
    import torch

    if torch.backends.cuda.is_built():
        pytest.skip("this torch has CUDA")
    r = invoke("run", "hi", "--device", "cuda")
    assert r.exit_code == 2 and "this torch build has no CUDA" in r.stderr, r.output


def test_a_checkpoint_declares_the_chat_modes_it_learnt(tmp_path):
    from dsagent.preflight import check_thinking, declared_chat_modes
    from dsagent.runtime import EMBEDDED_MODEL
    from dsagent.settings import FlagError

    plain, declared, trained = tmp_path / "plain", tmp_path / "declared", tmp_path / "trained"
    for d in (plain, declared, trained):
        d.mkdir()
        (d / "config.json").write_text("{}")
    (declared / "config.json").write_text('{"chat_modes": ["chat", "thinking"]}')
    (trained / "TRAINING.json").write_text('{"chat_modes": ["thinking"]}')
    assert declared_chat_modes(plain) == ("chat",) and declared_chat_modes(EMBEDDED_MODEL) == ("chat",)
    assert declared_chat_modes(declared) == ("chat", "thinking") and declared_chat_modes(trained) == ("thinking",)
    check_thinking("thinking", str(declared), None, str(EMBEDDED_MODEL))
    check_thinking("thinking", None, "tiny", str(EMBEDDED_MODEL))  # random weights: either mode
    with pytest.raises(FlagError, match="did not learn chat mode"):
        check_thinking("chat", str(trained), None, str(EMBEDDED_MODEL))


def test_a_run_stopped_at_max_steps_says_so_and_exits_0(script):
    script(tool_call("calculator", expression="1+1"), tool_call("calculator", expression="2+2"))
    r = invoke("run", "add", "--tool", "calculator", "--max-steps", "1")
    assert r.exit_code == 0 and "stopped at --max-steps 1" in r.stderr, r.output


def test_a_reply_cut_short_says_so_once(script):
    script("A reply that goes on for far longer than three tokens.")
    r = invoke("run", "talk", "--tool", "calculator", "--max-new-tokens", "3", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["stop"] == "max_tokens"
    assert r.stderr.count("cut short at --max-new-tokens 3") == 1, r.stderr


def test_a_tool_call_cut_short_is_reported_once_as_cut_short(script):
    script(*[tool_call("calculator", expression="12345 * 67890")] * 8)
    r = invoke("run", "multiply", "--tool", "calculator", "--max-new-tokens", "20")  # cut inside the markup
    assert "tool call not understood" not in r.stderr and r.stderr.count("cut short") == 1, r.stderr


def test_help_shows_switches_without_types_and_the_defaults(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    for command in ("run", "chat"):
        r = invoke(command, "--help")
        assert r.exit_code == 0
        assert "<bool>" not in r.stdout and "{prompt}" not in r.stdout
        for default in ("[default: ask]", "[default: 0]", "[default: 256]", "[default: 8]"):
            assert default in r.stdout, (command, default)
        assert "--threads" in r.stdout
    assert "Usage: root run [OPTIONS] [PROMPT]" in invoke("run", "--help").stdout


def test_model_info_fits_80_columns_and_names_the_model(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    for args in ([], ["--preset", "v41-flash"]):
        r = invoke("model", "info", *args)
        assert r.exit_code == 0, r.output
        lines = r.stdout.splitlines()
        assert max(map(len, lines)) <= 80 and "…" not in r.stdout
        named = "model: preset v41-flash" if args else f"model: the embedded default ({cli.EMBEDDED_MODEL})"
        assert lines[0] == named
    assert json.loads(invoke("model", "info", "--json").stdout)["model"].startswith("the embedded default")


def test_chat_help_lists_itself_and_tools_wrap_on_words(script, monkeypatch):
    monkeypatch.setenv("COLUMNS", "50")
    script("unused")
    r = invoke("chat", "--tool", "read_file", "--tool", "run_shell", input="/help\n/tools\n")
    assert r.exit_code == 0, r.output
    assert "/help           this list" in r.stderr
    from tools import builtin_toolbox

    words = {w for t in builtin_toolbox() for w in (t.name, *t.description.splitlines()[0].split(), "(asks", "first)")}
    tool_lines = [line for line in r.stdout.replace("› ", "").splitlines() if line.strip()]  # input()'s prompts
    assert tool_lines and max(map(len, tool_lines)) <= 50
    assert {w for line in tool_lines for w in line.split()} <= words  # no word cut in two


def test_run_with_packed_weights_answers_as_with_plain_ones():
    """``--weights packed`` loads the embedded default with its FP8 / FP4 weights as stored;
    greedy decoding gives the plain load's answer (the same logits, tests/test_packed.py), and
    so does ``--engram host`` (the same rows, tests/test_engram_host.py)."""
    def answer(*flags):
        env = {**os.environ, "DSAGENT_HOME": tempfile.mkdtemp()}
        r = subprocess.run([sys.executable, "-m", "dsagent", "run", "--yes", "--json", *flags, "What is 48 * 12?"],
                           capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["text"]

    assert answer("--weights", "packed") == answer()
    assert answer("--weights", "packed", "--engram", "host") == answer()  # the tables: the shard's memory map
    r = invoke("run", "--weights", "fp16", "hi")
    assert r.exit_code == 2 and "fp16" in r.stderr
    r = invoke("run", "--engram", "disk", "hi")
    assert r.exit_code == 2 and "disk" in r.stderr
