"""Compile, on the CPU, every Triton kernel launch the tests make, for the H200's sm_90.

    TRITON_INTERPRET=1 PYTHONPATH=<triton>:. python3 scripts/gpu_compile_check.py [pytest args]
    (default pytest args: the kernel test files, -q -x)
    DSAGENT_PTXAS=1 ... also prints each launch's registers and spills (ptxas -v on its PTX)
    DSAGENT_SASS=1 ... and a census of each build's SASS: instructions (a static count, every
    branch), spill stores, the commonest opcodes (cuobjdump on its cubin)
    DSAGENT_REDUCE=1 ... and, a JSON line each, the layout of every tensor a build's reductions
    sum (its TTGIR's ``tt.reduce`` operands): the layout fixes the order of the sums

Triton's interpreter runs a kernel as Python, so a kernel it accepts can still be refused by
the GPU compiler, which types the whole body (both branches of an ``if`` alike, for one) —
and device time is the scarce thing. First, pytest runs under the interpreter with
``InterpretedFunction.run`` wrapped to record each launch's specialization: argument types,
constexpr values and launch options. Then a process without the interpreter compiles each
distinct one through ``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` (front end, LLVM
and ptxas: no GPU needed), again as a programmatic dependent launch where the kernel takes
``PDL`` (its ``griddepcontrol`` PTX, which the interpreter never runs), and prints every
failure. Exit status 1 if any kernel fails to build or the tests fail. A check before a
run on the GPU, not a test: CI has no Triton. With ``DSAGENT_PTXAS=1`` each build's PTX also
goes through Triton's own ptxas with ``-v``: registers a thread and bytes spilled, read on
the CPU (a kernel at 255 registers with spills, like the sparse attention's, is the one to
look at first). Each recorded launch keeps which arguments the GPU would specialise as
multiples of 16 (tensors at 16-byte addresses, integers divisible by 16 outside the kernel's
``do_not_specialize``), so the build vectorises its loads as the GPU's does. With
``DSAGENT_SASS=1`` the SASS census counts what the compiler gave the kernel's threads to do:
the sparse attention's key decode was found so (2026-12-03, 88b7232: 3,936 instructions with 65 spill
stores at 4 warps before, 1,280 with none after, on 8 warps). With ``DSAGENT_REDUCE=1`` two
builds whose reductions sum tensors of the same layouts sum in the same order, so give the
same bits from the same values: the GEMV on packed weights against the GEMV on their
dequantised floats (``tests/test_packed_gemv.py``).
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ["tests/test_kernels.py", "tests/test_moe_kernel.py", "tests/test_streams_kernel.py",
         "tests/test_engram_kernel.py", "tests/test_gemv_kernel.py", "tests/test_norm_kernel.py",
         "tests/test_rope_kernel.py", "tests/test_kernel_backward.py", "tests/test_packed_gemv.py"]
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")


def _type_of(value) -> str | None:
    """Triton's signature type of an argument, or None for a constexpr-like one (None)."""
    import torch

    if isinstance(value, torch.Tensor):
        return "*" + {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
                      torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
                      torch.uint8: "u8", torch.bool: "i1"}[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
    if isinstance(value, float):
        return "fp32"
    return None


def _aligned(value) -> bool:
    """Whether Triton specialises the argument as a multiple of 16 on the GPU: a tensor at a
    16-byte address, an integer (not a bool) divisible by 16."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def record(out: list, around=contextlib.nullcontext):
    """Wrap the interpreter's launch to append each launch's specialization to ``out``, the
    launch itself run inside ``around()``; returns the function that unwraps it."""
    from triton.runtime.interpreter import InterpretedFunction

    real = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        params = inspect.signature(self.fn).parameters
        bound = dict(zip(self.arg_names, args))
        bound.update({k: v for k, v in kwargs.items() if k in params})
        signature, constants, aligned = {}, {}, []
        loose = set(self.kwargs.get("do_not_specialize") or ())
        for name, p in params.items():
            value = bound.get(name, p.default)
            kind = None if "constexpr" in str(p.annotation) else _type_of(value)
            if kind is None:
                signature[name], constants[name] = "constexpr", value
            else:
                signature[name] = kind
                if _aligned(value) and name not in loose:
                    aligned.append(name)
        out.append({"module": self.fn.__module__, "name": self.fn.__name__, "signature": signature,
                    "constants": constants, "options": {k: kwargs[k] for k in LAUNCH_OPTIONS if k in kwargs},
                    "aligned": aligned})
        with around():
            return real(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    return lambda: setattr(InterpretedFunction, "run", real)


def compile_apart(launches: list, path: Path, env: dict | None = None, **run) -> subprocess.CompletedProcess:
    """``--compile`` of ``launches`` (written to ``path`` as JSON) in a process without the
    interpreter, this repo on its path: Triton's GPU compiler for sm_90. ``env``: more of its
    environment (``DSAGENT_SASS``, ...); ``run``: ``subprocess.run``'s options. The finished process."""
    path.write_text(json.dumps(launches, default=str))
    clean = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    clean["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), clean.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, str(Path(__file__).resolve()), "--compile", str(path)],
                          env={**clean, **(env or {})}, **run)


def compile_all(path: str) -> int:
    """Compile each distinct recorded launch for sm_90; print the failures; their count."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    launches = json.loads(Path(path).read_text())
    launches += [dependent for launch in launches if (dependent := _dependent(launch))]
    seen, failed = set(), 0
    for launch in launches:
        key = json.dumps(launch, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        fn = getattr(importlib.import_module(launch["module"]), launch["name"])
        attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in launch.get("aligned", ())}
        try:
            built = triton.compile(ASTSource(fn=fn, signature=launch["signature"], constexprs=launch["constants"],
                                             attrs=attrs), target=GPUTarget("cuda", 90, 32), options=launch["options"])
        except Exception as e:  # the compiler's own error, to print
            failed += 1
            print(f"FAIL {launch['module']}.{launch['name']} {launch['constants']} {launch['options']}:\n"
                  f"  {type(e).__name__}: {str(e)[:1500]}", flush=True)
            continue
        if os.environ.get("DSAGENT_PTXAS") == "1":
            print(f"{launch['name']} {launch['options']} {launch['constants']}: {ptxas_usage(built.asm['ptx'])}",
                  flush=True)
        if os.environ.get("DSAGENT_REDUCE") == "1":
            print("reduce " + json.dumps({"name": launch["name"], "constants": launch["constants"],
                                          "options": launch["options"], "layouts": reduce_layouts(built.asm["ttgir"])},
                                         default=str), flush=True)
        if os.environ.get("DSAGENT_SASS") == "1":
            census = sass_census(built.asm["cubin"])
            top = ", ".join(f"{op} {n}" for op, n in census["top"])
            print(f"{launch['name']} {launch['options']} {launch['constants']}: SASS {census['instructions']} "
                  f"instructions, {census['spill_stores']} spill stores ({top})", flush=True)
    print(f"{len(seen)} distinct launches compiled for sm_90, {failed} failed", flush=True)
    return failed


def reduce_layouts(ttgir: str) -> list[str]:
    """The tensor type, its layout written out, of each ``tt.reduce`` operand in ``ttgir``
    (with the reduced axis), in program order."""
    import re

    aliases = dict(re.findall(r"^(#[\w.]+) = (.*)$", ttgir, re.M))
    found = re.findall(r'"tt\.reduce"\(%[\w#]+\) <\{axis = (\d+) : i32\}>.*?\) : \((tensor<[^>]*>)\)', ttgir, re.S)
    return [f"axis {axis}: " + re.sub(r"#[\w.]+", lambda m: aliases.get(m.group(0), m.group(0)), t)
            for axis, t in found]


def sass_census(cubin: bytes) -> dict:
    """The SASS of a build (cuobjdump, as Triton ships it): its instruction count (static,
    every branch), spill stores (``STL``) and the ten commonest opcodes."""
    import collections
    import re

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        text = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    ops = collections.Counter(m.group(1).split(".")[0] for line in text.splitlines()
                              if (m := re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)))
    return {"instructions": sum(ops.values()), "spill_stores": ops.get("STL", 0), "top": ops.most_common(10)}


def ptxas_usage(ptx: str) -> str:
    """``ptxas -v`` of ``ptx`` for sm_90a with the ptxas Triton builds sm_90 with: registers a
    thread, stack frame and spill bytes, as ptxas words them. (Triton 3.9 builds sm_90 with its
    newer ``ptxas-blackwell``; its older ``ptxas`` refuses the PTX version it writes.)"""
    import re

    import triton

    try:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(90).path
    except ImportError:  # a Triton before get_ptxas: the one it ships
        ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        out = subprocess.run([str(ptxas), "-v", "-arch=sm_90a", f.name, "-o", os.devnull], capture_output=True,
                             text=True).stderr
    finally:
        os.unlink(f.name)
    found = re.findall(r"(\d+ bytes stack frame, \d+ bytes spill stores, \d+ bytes spill loads|Used \d+ registers)", out)
    return "; ".join(found) or out.strip()[-300:]


def _dependent(launch: dict) -> dict | None:
    """The launch as a programmatic dependent one (``model.kernels.fused.chained``), which the
    interpreter never makes; None for a kernel without ``PDL``."""
    if "PDL" not in launch["signature"] or launch["constants"].get("PDL"):
        return None
    return {**launch, "constants": {**launch["constants"], "PDL": True},
            "options": {**launch["options"], "launch_pdl": True}}


def main() -> None:
    if sys.argv[1:2] == ["--compile"]:
        sys.exit(1 if compile_all(sys.argv[2]) else 0)
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run under TRITON_INTERPRET=1: the tests' launches are recorded in the interpreter")
    import pytest

    launches: list = []
    record(launches)
    code = pytest.main(sys.argv[1:] or [*TESTS, "-q", "-x"])
    with tempfile.TemporaryDirectory() as tmp:
        built = compile_apart(launches, Path(tmp) / "launches.json").returncode
    sys.exit(1 if code or built else 0)


if __name__ == "__main__":
    main()
