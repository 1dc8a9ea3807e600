"""A test helper, not a test: compile Triton launches for the H200's sm_90 on the CPU.

``compile_for_hopper(launches, tmp_path)`` writes the launches (dicts of module, kernel
name, signature, constants and options, as ``scripts/gpu_compile_check.py --compile``
reads them) and runs that script in a process without the interpreter (its
``compile_apart``): Triton's GPU
compiler types both branches of an ``if`` and builds the PTX of dependent launches, which
the interpreter never does. Used by the kernel tests where a kernel has variants no
interpreter run covers. Needs Triton installed, no GPU.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from gpu_compile_check import compile_apart  # noqa: E402


def compile_for_hopper(launches: list[dict], tmp_path: Path) -> subprocess.CompletedProcess:
    """Build each launch for sm_90; the finished process (returncode 0: all built)."""
    return compile_apart(launches, tmp_path / "launches.json", capture_output=True, text=True, timeout=300)
