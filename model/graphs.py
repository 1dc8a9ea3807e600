"""CUDA graphs of a decode step.

A decode step launches hundreds of small kernels per layer, and on a GPU its time was the
time to launch them. :class:`SegmentGraphs` captures segments of a step once per batch
size and replays them, so a step launches graphs where it launched thousands of kernels.
With the fused kernels the whole step over every layer is one segment, its cache work
included: the window-ring writes, the compressors' records, the index scores, top-k and
candidate pools run on the cache's fixed buffers with the position as a tensor
(``model.decode_step``), and the host keeps the counts around the one replay. Those buffers stay put: the capture is keyed on their
addresses and redone when one moves (a new cache, a grown buffer); a model whose
compressors pool pairs has two captures, for steps that complete a pair and steps that do
not. (One graph a layer, as until 2026-12-01 (0157739), cost the host ~160 us a layer in Python and
launches: the device waited on it.) Without the fused kernels two segments a layer
replay — the attention site (mixes, norm, projections, RoPE) and the FFN site (output
projection, mixes, the whole MoE) — around the eager cache work. A segment reads another
segment's output where that one wrote it; other inputs are copied in.

Replay runs the captured kernels on the same weights, so a graphed step computes what the
eager one does, bit for bit (``tests/test_graphs.py``). Graphs hold the weights' addresses:
``Transformer.derived`` drops them when the weights move (``model.to``, a load).
``DSAGENT_GRAPHS=0`` turns them off; a segment that cannot be captured (an operation that
reads the host) warns once and the model runs its steps eagerly from then on. Does not own:
which steps may use them nor the segments (``model.decode_step``), nor their maths (``model.block``).
"""
from __future__ import annotations

import os
import warnings
from typing import Callable

import torch

from model import kernels


def wanted(ids: torch.Tensor, image_mask: torch.Tensor | None, packed: bool) -> bool:
    """Whether a forward of ``ids`` [B, S] runs its segments as graphs: a one-token step
    on CUDA, outside autograd and outside another capture, on text, on a packed cache."""
    return (ids.shape[1] == 1 and ids.is_cuda and image_mask is None and packed
            and not torch.is_grad_enabled() and os.environ.get("DSAGENT_GRAPHS", "1") != "0"
            and not torch.cuda.is_current_stream_capturing())


class SegmentGraphs:
    """Captured segments by key; every capture shares one memory pool (they replay one
    after another, never at once)."""

    def __init__(self):
        self._graphs: dict = {}
        self._pool = None
        self.failed: str | None = None  # why a capture failed: every later segment runs eagerly
        self._outputs: list[torch.Tensor] = []  # every capture's outputs
        self._switches = _switches()

    def for_step(self) -> "SegmentGraphs":
        """These graphs for the next step, the ``CAPTURED_SWITCHES`` read once for all its
        segments (~10 us a read)."""
        self._switches = _switches()
        return self

    def __len__(self) -> int:
        return len(self._graphs)

    def __deepcopy__(self, memo) -> "SegmentGraphs":
        return SegmentGraphs()  # a copied model has its own weights: it captures its own graphs

    def run(self, key, fn: Callable[..., tuple], *inputs: torch.Tensor, version=None) -> tuple:
        """``fn(*inputs)`` (a tuple of tensors) by replaying its graph for ``key`` and the
        batch size (the first input's first dimension), captured on first use. ``version``
        names the memory ``fn`` reaches besides its inputs (say, a cache's buffers): a
        different one, inputs of other shapes (a grown buffer's candidate pool) or other
        ``CAPTURED_SWITCHES`` (as :meth:`for_step` read them) replace the capture. The
        returned tensors are the graph's own outputs: valid until this key replays again
        (the next step's same layer)."""
        if self.failed:
            return fn(*inputs)
        key = (key, inputs[0].shape[0] if inputs else None)
        version = (version, self._switches, *((tuple(x.shape), x.dtype) for x in inputs))
        entry = self._graphs.get(key)
        if entry is None or entry[0] != version:
            if entry is not None:  # replaced: later captures must not read its outputs in place
                self._outputs = [o for o in self._outputs if not any(o is x for x in entry[3])]
            try:
                entry = self._graphs[key] = (version, *self._capture(fn, inputs))
            except RuntimeError as e:  # torch.AcceleratorError is one
                kernels.mhc_forget()  # mHC splits the failed capture put on a side stream: never run
                self.failed = f"{type(e).__name__}: {e}"
                warnings.warn(f"CUDA graph capture failed ({self.failed[:200]}); decoding eagerly",
                              RuntimeWarning, stacklevel=2)
                return fn(*inputs)
        _, graph, static_in, static_out = entry
        for dst, src in zip(static_in, inputs):
            if not _same_memory(dst, src):  # another graph's output passed on needs no copy
                dst.copy_(src)
        graph.replay()
        return static_out

    def _capture(self, fn, inputs):
        # an input that is another graph's output is read where that graph writes it (the
        # segments replay in the order they were captured in); anything else gets a copy
        static_in = [x if any(_same_memory(x, o) for o in self._outputs) else x.clone() for x in inputs]
        graph, static_out = self._record(fn, static_in)
        self._outputs.extend(static_out)
        return graph, static_in, static_out

    def _record(self, fn, static_in):
        """A CUDA graph of ``fn(*static_in)`` and its output tensors."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture: lazy inits, kernel selection
            fn(*static_in)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            static_out = fn(*static_in)
        return graph, static_out


# the switches that change which kernels a capture holds, or how they launch: a capture made
# under other settings is replaced, not replayed (``bench decode --paths`` flips them in one process)
CAPTURED_SWITCHES = ("DSAGENT_KERNELS", "DSAGENT_FUSED_MOE", "DSAGENT_GROUPED_MOE", "DSAGENT_GEMV", "DSAGENT_PDL",
                     "DSAGENT_MHC_OVERLAP")


def _switches() -> tuple:
    return tuple(os.environ.get(name) for name in CAPTURED_SWITCHES)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)
