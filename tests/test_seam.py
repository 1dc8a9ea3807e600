"""The seam between the reference network and the fast paths, read from the source.

The reference modules (the paper's network) may use ``model.kernels`` only for the
operations that are one function of tensors with a PyTorch twin, the kernel or the twin
chosen by device (``MATH_OPS``; the prefill's reads of packed bytes among them, taken where
the fast path set ``Step.packed_reads``), and ``model.kernels.reference`` (the twins themselves);
their projections go through ``model.linear``. They import neither the fused decode step
(``model.decode_step``) nor the graphs (``model.graphs``) nor any kernel module: launch
order, side streams, graph capture and kernel knobs live outside them.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ("model/model.py", "model/block.py", "model/moe.py", "model/csa2.py", "model/layer.py", "model/rope.py",
             "model/engram.py")
MATH_OPS = {"rms_norm", "rope", "hc_site", "hc_collapse", "hc_expand", "engram_gate", "ngram_hash", "topk_rows",
            "top_records", "sparse_prefill", "indexer_scores", "prefill_index_scores", "grouped_fp4",
            "dequantised_fp4_stack", "routed_swiglu", "slot_sum", "fp32_linear"}
FORBIDDEN_MODULES = ("model.decode_step", "model.graphs")


def _imported(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


@pytest.mark.parametrize("path", REFERENCE)
def test_a_reference_module_imports_no_fast_path(path):
    imported = _imported(ast.parse((ROOT / path).read_text()))
    assert not {m for m in imported if m.startswith(FORBIDDEN_MODULES)}
    kernel_modules = {m for m in imported if m.startswith("model.kernels.")}
    assert kernel_modules <= {"model.kernels.reference"} | {f"model.kernels.reference.{n}" for n in
                                                            _names_from(path, "model.kernels.reference")}


def _names_from(path: str, module: str) -> set[str]:
    tree = ast.parse((ROOT / path).read_text())
    return {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == module for a in n.names}


@pytest.mark.parametrize("path", REFERENCE)
def test_a_reference_module_uses_only_the_kernels_math_operations(path):
    tree = ast.parse((ROOT / path).read_text())
    used = {n.attr for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "kernels"}
    assert used <= MATH_OPS, f"{path} reaches into the fast path: {sorted(used - MATH_OPS)}"


def test_the_layers_project_through_the_linear_family():
    """Every projection of the attention and the CSA2 sources is a ``model.linear.Linear``
    (the Engram value projection stays torch's: it must not take the GEMV, see ``Engram.kv``;
    the routed experts stack into grouped GEMMs, ``model.moe``)."""
    from torch import nn

    from model.args import ModelArgs
    from model.linear import Linear
    from model.loading import build

    model = build(ModelArgs.preset("tiny"), device="meta")
    plain = {name for name, m in model.named_modules() if type(m) is nn.Linear}
    assert plain and all(".engram.wkv" in n or ".ffn." in n or n.startswith(("vision", "aligner", "mtp"))
                         for n in plain), sorted(plain)
    assert all(isinstance(m, Linear) for name, m in model.named_modules()
               if name.endswith((".wq_a", ".wq_b", ".wkv", ".wo_a", ".wo_b", ".wgate", ".wk", ".weights_proj"))
               and ".engram." not in name and not name.startswith("mtp"))
