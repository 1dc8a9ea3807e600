"""Rank 0 drives, the other ranks follow (``model.lockstep``): over two gloo processes on the
CPU, a ``Leader`` gives the tokens one process gives — prefill, greedy decode, a state made
from stored chunks and replayed as a resume does — and a follower that fails ends the run on
rank 0 with its traceback, every process gone (``dsagent.ranks``)."""
from __future__ import annotations

import time

import pytest
from pathlib import Path

import torch
import torch.multiprocessing as mp

from model.distributed import run_ranks
from model.linear import World

DEFAULT = Path(__file__).resolve().parents[1] / "model" / "assets" / "default"  # trained: margins, not near-ties
CHUNK = 64


def _script(engine, ids: torch.Tensor) -> list[int]:
    """What a session does with an engine: prefill, 16 greedy tokens, the global KV stored in
    chunks and a new state made from them and replayed (a resume), 8 more tokens."""
    from model.engine import Sampling

    state = engine.new_state()
    engine.prefill(state, ids)
    tokens = list(engine.generate(state, Sampling(max_new_tokens=16)))
    log = ids[0].tolist() + tokens[:-1]  # the last token sampled is not yet in the cache
    k = state.cache.stored_tokens(1) // CHUNK * CHUNK
    chunks = [state.cache.export_range(c, c + CHUNK) for c in range(0, k, CHUNK)]
    resumed = engine.state_from_chunks(chunks, k)
    engine.replay(resumed, torch.tensor([log[:k]]), images=lambda begin, end: None, tokens=32)  # as the agent asks
    engine.prefill(resumed, torch.tensor([log[k:]]))
    del state  # rank 0 drops a state: the followers drop theirs with the next call
    return tokens + list(engine.generate(resumed, Sampling(max_new_tokens=8)))


def _rank(world: World, ids: torch.Tensor, results) -> None:
    from model.engine import Engine
    from model.loading import load
    from model.lockstep import Leader, follow

    torch.set_num_threads(1)
    model = load(DEFAULT, world=world)
    if world.rank == 0:
        leader = Leader(model, world, chunk=CHUNK)
        results[0] = _script(leader, ids)
        leader.close()
    else:
        follow(Engine(model, chunk=CHUNK), world)
        results[world.rank] = "followed"


def test_a_leader_gives_one_process_tokens(tmp_path):
    from model.engine import Engine
    from model.loading import load

    ids = torch.randint(3, 1000, (1, 150), generator=torch.Generator().manual_seed(7))
    want = _script(Engine(load(DEFAULT), chunk=CHUNK), ids)
    with mp.Manager() as manager:
        results = manager.dict()
        run_ranks(_rank, 2, ids, results, init_method=f"file://{tmp_path / 'rendezvous'}", timeout_s=300)
        got = dict(results)
    assert got[1] == "followed"
    assert got[0] == want and len(want) == 24


def test_a_failed_follower_is_reported_and_every_rank_ends(tmp_path):
    """A follower that cannot load its model: rank 0 hears of it with the follower's traceback
    (the CLI prints it and exits 1) and no follower process is left."""
    from dsagent import ranks
    from dsagent.runtime import Settings
    from model.distributed import close_world

    reports = []
    r = ranks.start(Settings(model=str(tmp_path / "no-such-checkpoint"), gpus=2), 2, timeout_s=60,
                    on_failure=reports.append)
    try:
        deadline = time.monotonic() + 60
        while not reports and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        r.stop()
        close_world(r.world)
    assert reports, "rank 0 never heard of the failed follower"
    assert "rank 1 of 2 failed" in reports[0] and "no-such-checkpoint" in reports[0], reports[0]
    assert all(not p.is_alive() for p in r.procs)


def _bench_rank(world: World, results) -> None:
    from model.bench import bench_decode
    from model.engine import Engine
    from model.loading import load
    from model.lockstep import follow

    torch.set_num_threads(1)
    model = load("tiny", world=world)
    if world.rank == 0:
        results[0] = bench_decode(model, 160, short=130, steps=2)
        import torch.distributed as dist

        from model.lockstep import Leader

        leader = Leader(model, world)
        state = leader.new_state()
        with torch.no_grad():
            leader.prefill(state, torch.arange(3, 40)[None])
            calls, real = [], dist.all_reduce
            dist.all_reduce = lambda *a, **k: calls.append(1) or real(*a, **k)
            leader.decode(state, state.last_logits.argmax(-1))
            dist.all_reduce = real
        results["step_all_reduces"] = len(calls)  # a decode step's, counted as they ran
        leader.close()  # any leader of rank 0 tells the followers to leave
    else:
        follow(Engine(model), world)


def test_decode_bench_over_two_ranks_reports_its_all_reduces(tmp_path):
    """``bench_decode`` on rank 0 of two drives the other rank through its benchmark's own
    engines and prints, beside the step, the all-reduces a step makes and their time."""
    with mp.Manager() as manager:
        results = manager.dict()
        run_ranks(_bench_rank, 2, results, init_method=f"file://{tmp_path / 'rendezvous'}", timeout_s=300)
        out, counted = dict(results)[0], dict(results)["step_all_reduces"]
    from model.args import ModelArgs

    args = ModelArgs.preset("tiny")
    # the embedding's, two a layer, and one an Engram layer (its table's rows split over the ranks)
    assert out["ranks"] == 2 and out["all_reduces_per_step"] == 1 + 2 * args.num_hidden_layers + len(args.engram_layer_ids)
    assert args.engram_layer_ids and out["all_reduces_per_step"] == counted
    assert out["all_reduce_us"] > 0 and out["step_ms_long"] > 0
    assert out["all_reduce_ms_per_step"] == pytest.approx(out["all_reduces_per_step"] * out["all_reduce_us"] / 1e3)


LEADER = """
import sys, time
from dsagent import ranks
from dsagent.runtime import Settings
r = ranks.start(Settings(preset="tiny", threads=1, gpus=2), 2, timeout_s=60)
print(" ".join(str(p.pid) for p in r.procs), flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.split()[1] == "Z" for line in f if line.startswith("State:"))  # exited, not reaped
    except FileNotFoundError:
        return True


def test_followers_exit_when_rank_0_is_killed():
    """No orphans: rank 0 killed (SIGKILL: nothing of it runs), its followers find their
    parent gone and exit within a second or so."""
    import os
    import signal
    import subprocess
    import sys

    if not os.path.isdir("/proc"):
        pytest.skip("reads process states from /proc")
    leader = subprocess.Popen([sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True)
    try:
        followers = [int(pid) for pid in leader.stdout.readline().split()]
        assert followers and not any(_gone(pid) for pid in followers)
        leader.send_signal(signal.SIGKILL)
        leader.wait(10)
        deadline = time.monotonic() + 15
        while not all(_gone(pid) for pid in followers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_gone(pid) for pid in followers), "a follower outlived rank 0"
    finally:
        leader.kill()


def test_a_ctrl_c_waits_for_the_call_on_every_rank():
    """SIGINT during a lockstep call (here: the block) is held until the call ends, then
    raised as the KeyboardInterrupt it would have been; nested holds raise it once."""
    import os
    import signal

    from model.lockstep import _interrupts_held

    done = []
    with pytest.raises(KeyboardInterrupt):
        with _interrupts_held():
            with _interrupts_held():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                done.append("inner")
            done.append("outer")
    assert done == ["inner", "outer"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
