"""pytest options for this suite.

``--fused-twins``: every one-token decode step takes the fused path (``model.decode_step``'s
``is_decode_step`` in place of ``takes_fused``), on the kernels' PyTorch twins where there is
no GPU — the cache bookkeeping CUDA decode runs, checked by the runtime suites on the CPU:
``python3 -m pytest -q --fused-twins tests/test_e2e.py tests/test_engine.py ...``. The
runtime suites (engine, model, sessions, agent loop, eval, chat, DSpark, vision, training)
pass with it; ``tests/test_graphs.py`` counts the segments of the default choice, so it
does not (it forces the fused path itself where it wants it).
"""
from __future__ import annotations


def pytest_addoption(parser):
    parser.addoption("--fused-twins", action="store_true",
                     help="run every one-token decode step on the fused path (PyTorch twins on the CPU)")


def pytest_configure(config):
    if config.getoption("--fused-twins"):
        from model import decode_step

        decode_step.takes_fused = decode_step.is_decode_step
