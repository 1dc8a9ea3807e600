"""torch's thread count comes from the CPUs this process may use (`dsagent.threads`).

The cgroup files are faked in a temporary tree (v2 `cpu.max`; v1 `cpu.cfs_quota_us` /
`cpu.cfs_period_us`), so the quota rules are checked on any machine. How much the choice
matters is a measurement, not a test: README, *Threads*.
"""
import pytest
from typer.testing import CliRunner

import dsagent.cli as cli
from dsagent import threads


def _tree(tmp_path, files: dict[str, str], own: str) -> tuple:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    proc = tmp_path / "proc_cgroup"
    proc.write_text(own)
    return root, proc


def test_v2_quota_of_the_own_cgroup_and_its_ancestors(tmp_path):
    root, proc = _tree(tmp_path, {"cpu.max": "max 100000\n", "a/cpu.max": "400000 100000\n",
                                  "a/b/cpu.max": "150000 100000\n"}, "0::/a/b\n")
    assert threads.quota_cpus(root, proc) == 1.5


def test_v2_without_a_quota(tmp_path):
    root, proc = _tree(tmp_path, {"cpu.max": "max 100000\n"}, "0::/\n")
    assert threads.quota_cpus(root, proc) is None


def test_v2_mounted_at_the_root_inside_a_container(tmp_path):
    """The path /proc names is the host's; inside the container only the root file exists."""
    root, proc = _tree(tmp_path, {"cpu.max": "200000 100000\n"}, "0::/docker/0123abcd\n")
    assert threads.quota_cpus(root, proc) == 2


def test_v1_quota(tmp_path):
    root, proc = _tree(tmp_path, {"cpu,cpuacct/job/cpu.cfs_quota_us": "300000\n",
                                  "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n",
                                  "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
                       "4:memory:/job\n3:cpu,cpuacct:/job\n")
    assert threads.quota_cpus(root, proc) == 3


def test_v1_unlimited(tmp_path):
    root, proc = _tree(tmp_path, {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"},
                       "1:cpu:/\n")
    assert threads.quota_cpus(root, proc) is None


@pytest.mark.parametrize("affinity, quota, expected", [(8, None, 8), (8, 2.0, 2), (8, 1.5, 1), (8, 0.2, 1),
                                                       (2, 16.0, 2)])
def test_available_cpus_is_the_affinity_capped_by_the_quota_rounded_down(monkeypatch, affinity, quota, expected):
    monkeypatch.setattr(threads, "affinity_cpus", lambda: affinity)
    monkeypatch.setattr(threads, "quota_cpus", lambda: quota)
    assert threads.available_cpus() == expected


def test_apply_threads_sets_torchs_count(monkeypatch):
    import torch

    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "available_cpus", lambda: 1)
    try:
        assert threads.apply_threads(None) == 1 and torch.get_num_threads() == 1
        assert threads.apply_threads(2) == 2 and torch.get_num_threads() == 2  # asked for: taken as asked
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def seen(tmp_path, monkeypatch):
    """The Defaults `run` would load a model with (the load itself is stopped)."""
    monkeypatch.setenv("DSAGENT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DSAGENT_THREADS", raising=False)
    got = []

    def load(d, device, weights="plain", gpus=1, engram="device"):
        got.append(d)
        raise KeyboardInterrupt  # stop here: exit 130, nothing else runs

    monkeypatch.setattr(cli, "load_runtime", load)
    return got


def test_threads_flag_env_and_config(seen, tmp_path, monkeypatch):
    run = lambda *a: CliRunner().invoke(cli.app, ["run", "hi", *a])
    assert run().exit_code == 130 and seen[-1].threads is None  # None: the CPUs this process may use
    assert run("--threads", "3").exit_code == 130 and seen[-1].threads == 3
    monkeypatch.setenv("DSAGENT_THREADS", "5")
    assert run().exit_code == 130 and seen[-1].threads == 5
    assert run("--threads", "2").exit_code == 130 and seen[-1].threads == 2  # the flag wins
    monkeypatch.delenv("DSAGENT_THREADS")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "config.toml").write_text("threads = 4\n")
    assert run().exit_code == 130 and seen[-1].threads == 4


@pytest.mark.parametrize("args, env", [(["--threads", "0"], None), ([], "0"), ([], "many")])
def test_bad_threads_exit_2(seen, monkeypatch, args, env):
    if env is not None:
        monkeypatch.setenv("DSAGENT_THREADS", env)
    r = CliRunner().invoke(cli.app, ["run", "hi", *args])
    assert r.exit_code == 2 and not seen, r.output


def test_a_narrow_model_computes_on_one_thread_unless_a_count_is_asked_for(monkeypatch):
    """settle_threads: the embedded default on the CPU, left to it, on one thread; a count
    asked for (--threads / DSAGENT_THREADS / config) holds; a model wider than
    ONE_THREAD_MAX_HIDDEN keeps the CPUs' count."""
    import torch

    from dsagent.runtime import Runtime, Settings

    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "available_cpus", lambda: 2)
    try:
        rt = Runtime.load(Settings())
        assert torch.get_num_threads() == 1
        assert Runtime.load(Settings(threads=2)) and torch.get_num_threads() == 2
        threads.apply_threads(None)
        monkeypatch.setattr(threads, "ONE_THREAD_MAX_HIDDEN", rt.model.args.hidden_size - 1)
        assert threads.settle_threads(rt.model, None) == 2
    finally:
        torch.set_num_threads(before)
