"""``scripts/gpu_compile_check.py``: a kernel the interpreter runs but the GPU compiler refuses
is reported, and one it builds is not. Needs Triton installed (not CI's); no GPU."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton installed")

KERNEL = '''
import torch
import triton
import triton.language as tl


@triton.jit
def _branches(x_ptr, A: tl.constexpr, B: tl.constexpr):
    if tl.program_id(0) >= 0:  # a runtime condition: the compiler types both branches
        o = tl.arange(0, A)
    else:
        o = tl.arange(0, B)
    tl.store(x_ptr + tl.arange(0, 4), tl.zeros([4], dtype=tl.float32))


def test_launch():
    x = torch.ones(4)
    _branches[(1,)](x, A={a}, B={b})
    assert x.sum().item() == 0
'''


def check(tmp_path: Path, a: int, b: int, **env_extra: str) -> subprocess.CompletedProcess:
    name = f"test_branches_{a}_{b}.py"
    (tmp_path / name).write_text(KERNEL.format(a=a, b=b))
    env = {**os.environ, **env_extra, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_compile_check.py"), str(tmp_path / name),
                           "-q", "-p", "no:cacheprovider"], env=env, capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)


def test_a_kernel_the_gpu_compiler_refuses_is_reported(tmp_path):
    """``o`` of 2 and of 4 elements in the two branches: the interpreter runs the test, the
    compiler for sm_90 refuses the kernel."""
    r = check(tmp_path, 2, 4)
    assert "1 passed" in r.stdout and "FAIL test_branches_2_4._branches" in r.stdout, r.stdout + r.stderr
    assert "1 distinct launches compiled for sm_90, 1 failed" in r.stdout and r.returncode == 1


def test_a_kernel_that_builds_passes(tmp_path):
    r = check(tmp_path, 4, 4)
    assert "1 distinct launches compiled for sm_90, 0 failed" in r.stdout and r.returncode == 0, r.stdout + r.stderr


def test_ptxas_reports_registers_and_spills(tmp_path):
    """``DSAGENT_PTXAS=1``: each build's registers and spills, as ptxas words them."""
    r = check(tmp_path, 4, 4, DSAGENT_PTXAS="1")
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("_branches "))
    assert "bytes spill stores" in line and "Used " in line and " registers" in line, line


def test_sass_census_counts_a_builds_instructions(tmp_path):
    """``DSAGENT_SASS=1``: each build's SASS counted (instructions, spill stores, opcodes)."""
    r = check(tmp_path, 4, 4, DSAGENT_SASS="1")
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("_branches ") and " SASS " in x)
    count = int(line.split(" SASS ")[1].split()[0])
    assert count > 0 and "spill stores" in line and "EXIT" in line, line


def test_sass_census_of_the_decode_kernels_at_a_presets_shapes():
    """``scripts/sass_census.py``: the attention, a layer's GEMVs, the indexer, the top-k, an
    mHC site and a token's MoE launched once under the interpreter at the preset's decode
    shapes, then each build's SASS counted."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "sass_census.py"), "--preset", "tiny"], env=env,
                       capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [x for x in r.stdout.splitlines() if " SASS " in x]
    assert any(x.startswith("_sparse_attention_kernel ") and "'launch_pdl': True" in x for x in lines), r.stdout
    # the projections of x, the query, wo_a and wo_b
    assert sum(x.startswith("_gemv_kernel ") and "'launch_pdl': True" in x for x in lines) == 4, r.stdout
    for kernel in ("_indexer_kernel", "_pass_kernel", "_site_dots_kernel", "_site_finish_kernel", "_gate_kernel",
                   "_up_kernel", "_down_slots_kernel"):
        assert any(x.startswith(kernel + " ") for x in lines), (kernel, r.stdout)
