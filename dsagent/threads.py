"""How many threads torch computes with: the CPUs this process may use, not the machine's.

Owns: counting the CPUs a process may run on (its affinity mask, then a cgroup CPU quota:
v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, on the process's own
cgroup and every ancestor) and handing torch that count, or the one asked for
(``--threads`` / ``DSAGENT_THREADS`` / ``threads`` in config.toml), or one for a narrow model
on the CPU (``settle_threads``); and `measure`, what
``dsagent bench threads`` prints: prefill and decode times at several thread counts beside
busy-loop processes. Does not own reading the setting (``dsagent.settings``).

Why: torch's default follows the cores it can see. A container limited to 2 CPUs by a
quota on a 64-core host still sees 64, and 64 threads taking turns on 2 CPUs spend their
time waiting for each other at every barrier. A quota is rounded down (1.5 CPUs: 1
thread), since a thread past the quota is throttled with the rest.
"""
from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (all of them where the OS has no such mask)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def _quota_v2(text: str) -> float | None:
    quota, _, period = text.strip().partition(" ")
    if quota == "max" or not period:
        return None
    return int(quota) / int(period)


def _quota_v1(quota_text: str, period_text: str) -> float | None:
    quota = int(quota_text.strip())
    return None if quota < 0 else quota / int(period_text.strip())


def _own_paths(cgroup_file: Path) -> dict[str, str]:
    """{controller or "" for v2: path} from /proc/self/cgroup."""
    paths = {}
    try:
        lines = cgroup_file.read_text().splitlines()
    except OSError:
        return paths
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            paths[c] = path
    return paths


def _dirs(base: Path, own: str | None) -> list[Path]:
    """The process's cgroup directory and its ancestors under ``base``, then ``base`` itself
    (inside a container the cgroup is often mounted at the root and its path is not there)."""
    out = []
    if own:
        rel = Path(own.lstrip("/"))
        out += [base / p for p in [rel, *rel.parents] if p != Path(".")]
    return out + [base]


def quota_cpus(root: Path = CGROUP_ROOT, cgroup_file: Path = PROC_CGROUP) -> float | None:
    """The smallest CPU quota on this process's cgroup path, in CPUs; None without one."""
    own = _own_paths(cgroup_file)
    quotas = []
    for d in _dirs(root, own.get("")):
        try:
            q = _quota_v2((d / "cpu.max").read_text())
        except (OSError, ValueError):
            continue
        if q is not None:
            quotas.append(q)
    for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        for d in _dirs(root / name, own.get("cpu")):
            try:
                q = _quota_v1((d / "cpu.cfs_quota_us").read_text(), (d / "cpu.cfs_period_us").read_text())
            except (OSError, ValueError, ZeroDivisionError):
                continue
            if q is not None:
                quotas.append(q)
    return min(quotas) if quotas else None


def available_cpus() -> int:
    """CPUs this process may use: its affinity, capped by a cgroup quota rounded down."""
    n = affinity_cpus()
    quota = quota_cpus()
    if quota is not None:
        n = min(n, max(1, math.floor(quota)))
    return n


def apply_threads(requested: int | None) -> int:
    """Set torch's intra-op threads to ``requested`` or, when None, to `available_cpus()`;
    returns the count set. Imports torch: call it only where a model is about to run."""
    import torch

    n = requested or available_cpus()
    torch.set_num_threads(n)
    return n


# A model this narrow or narrower computes on one CPU thread unless a count is asked for: its
# forwards are many small ops, which more threads speed up little and which stall whenever another
# process holds one of the cores. This 2-CPU machine, 2026-12-06 (docs/benchmarks.md, Threads):
# the embedded default (hidden 128) decodes 38.8 ms a token at 2 threads and at 1, beside one busy
# loop 134 against 41; `small` cut to 8 layers (hidden 2,048) 172 against 146, beside a busy loop
# 360 against 178; the real five-question `dsagent chat` beside a busy loop 583 s at 2 threads
# (its 2,204-token first prefill alone 54.6 s) against 17.5 at 1. The cost, idle: that chat 12.7 s
# at 2 threads against 15.3 at 1, a 2,048-token prefill 1.45 s against 2.46. Wider models on the
# CPU were not measured and keep the CPUs' count.
ONE_THREAD_MAX_HIDDEN = 2048


def settle_threads(model, requested: int | None) -> int:
    """After the model is loaded: one thread for a CPU model up to ONE_THREAD_MAX_HIDDEN wide
    unless ``requested``; returns torch's count."""
    import torch

    narrow = model.args.hidden_size <= ONE_THREAD_MAX_HIDDEN
    if requested is None and narrow and torch.device(model.device).type == "cpu":
        torch.set_num_threads(1)
    return torch.get_num_threads()


def co_load(n: int) -> list[subprocess.Popen]:
    """``n`` busy-loop processes, each keeping one CPU busy until stopped (`stop_co_load`)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
            for _ in range(n)]


def stop_co_load(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def measure(model, counts: list[int], ctx: int, steps: int, rounds: int, busy: int = 0) -> dict:
    """Prefill ``ctx`` tokens and decode ``steps`` with torch at each of ``counts`` threads,
    the counts alternating within each of ``rounds`` (so drift in the machine's load falls on
    all of them), beside ``busy`` busy-loop processes; medians and their ratios to the
    first count. A measurement, never a test."""
    import torch

    from model.bench import prompt_ids
    from model.engine import Engine, Sampling

    engine, ids = Engine(model, mode="ced"), prompt_ids(model, ctx)
    before = torch.get_num_threads()
    prefill = {n: [] for n in counts}
    decode = {n: [] for n in counts}
    procs = co_load(busy)
    try:
        engine.prefill(engine.new_state(), ids[:, :64])  # warm-up: first-call costs fall on no count
        for _ in range(rounds):
            for n in counts:
                torch.set_num_threads(n)
                state = engine.new_state()
                t = time.perf_counter()
                engine.prefill(state, ids)
                prefill[n].append(time.perf_counter() - t)
                t = time.perf_counter()
                made = len(list(engine.generate(state, Sampling(max_new_tokens=steps))))
                decode[n].append((time.perf_counter() - t) / max(made, 1))
    finally:
        stop_co_load(procs)
        torch.set_num_threads(before)
    first = counts[0]
    med = lambda xs: statistics.median(xs)  # noqa: E731
    return {"bench": "threads", "ctx": ctx, "decode_steps": steps, "rounds": rounds, "busy_loops": busy,
            "cpus_available": available_cpus(), "counts": counts,
            "prefill_s": {n: med(prefill[n]) for n in counts},
            "decode_ms_per_token": {n: 1e3 * med(decode[n]) for n in counts},
            f"prefill_time_over_{first}_threads": {n: med(prefill[n]) / med(prefill[first]) for n in counts},
            f"decode_time_over_{first}_threads": {n: med(decode[n]) / med(decode[first]) for n in counts}}
