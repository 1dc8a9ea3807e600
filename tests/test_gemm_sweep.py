"""``scripts/gemm_sweep.py`` at its toy shapes: every sweep runs and writes its lines, each
timed output agrees with its reference, the decode pass gives the twin's floats. On CUDA, or
on the CPU under ``TRITON_INTERPRET=1``; else skipped (the kernels need Triton)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from tests.test_packed_gemm import needs_triton

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gemm_sweep.py"


@needs_triton
def test_the_sweep_runs_its_three_parts_at_toy_shapes(tmp_path, monkeypatch):
    monkeypatch.delenv("DSAGENT_PACKED_GEMM", raising=False)
    spec = importlib.util.spec_from_file_location("gemm_sweep", SCRIPT)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    out = tmp_path / "sweep.jsonl"
    sweep.main([str(out), "--toy"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    kinds = [r.get("kind") for r in rows[1:]]
    assert rows[0]["matmul_tflops"] > 0
    assert kinds.count("dense") == 4 and kinds.count("grouped") == 2 and kinds.count("paths") == 4
    assert kinds.count("stacks") == 1
    tiles = [v for r in rows if r.get("kind") in ("dense", "grouped") for v in r.values() if isinstance(v, dict)]
    assert tiles and all(t["rel_err"] < 1e-2 and t["tflops"] > 0 for t in tiles)
    assert all(r["decode_equal"] for r in rows if r.get("kind") == "paths")
    assert rows[-1]["up_rel_err"] < 1e-2
