"""A test helper, not a test: the kernels' settings under Triton's CPU interpreter.

``interpretable(monkeypatch)``: under ``TRITON_INTERPRET=1`` the MoE's down sum takes its
early form (``moe.DOWN_EARLY``), the one form of it the interpreter runs (the looped one's
``range`` over a runtime width is not the interpreter's), so a test of the defaults runs the
MoE kernels there rather than their torch twin; and, everywhere, no test inherits another's
fallback to a twin (``kernels._FAILED``). Used by the MoE kernel tests, the fused-twins
model test and the mHC model test.
"""
from __future__ import annotations

import os

import model.kernels as kernels


def interpretable(monkeypatch) -> None:
    if os.environ.get("TRITON_INTERPRET") == "1" and kernels.triton_available():
        from model.kernels import moe

        monkeypatch.setattr(moe, "DOWN_EARLY", True)
    monkeypatch.setattr(kernels, "_FAILED", {})
