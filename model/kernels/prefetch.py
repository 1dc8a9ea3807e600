"""Weights asked into the GPU's L2 by programs riding a latency-bound launch of a decode step.

A batch-1 decode step alternates kernels that stream weights (the GEMVs, the MoE) with
chains of small dependent kernels that leave the memory bus idle (the window entry, the
sparse attention and its merge, the mHC sites, the gate). A GEMV asks for its own weight
tiles before its dependent launch's wait (``model.kernels.matvec``), but only while the one
kernel before it runs. Here a launch of the idle chain — the attention's merge, launched
while the attention runs — takes more programs, *riders*, that ask the L2 for the bytes of
the weights read after the chain (``cp.async.bulk.prefetch.L2``, sm_90) and leave: the
layer's output projections, the FFN site's mixes and the gate; the next layer's input
projections ride that launch too (``RIDE = "both"``) or the MoE gate's (``"split"``), the
other idle launch of a layer.
Session 30 issued the same asks from a kernel of their own on a side stream, whose fork and
join cost the step what the GEMVs gained; a rider adds no launch and no edge to the graph,
and waits on nothing (weights are never written).

A prefetch is a hint: it reads nothing back and writes nothing, so every kernel computes the
same with or without riders (``tests/test_prefetch.py``). Riders need a CUDA device of
compute capability 9 or later; elsewhere (the CPU, Triton's interpreter) there are none.

Owns the byte ranges' table (:class:`Asks`, made once per set of weights outside a graph's
capture) and the riders' code (:func:`_ride`). Does not own which weights are asked for
(``model.model.Block.read_after_attention``) or how a launch carries riders
(``model.kernels.fused``, ``model.kernels.moe``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl
import triton

# which weights ride which launch: "" none; "output" the layer's own read after its attention (output
# projections, FFN site's mixes, gate) on the attention's merge launch; "both" those and the next layer's
# input projections and attention-site mixes there; "split" the next layer's on the MoE gate's launch
RIDE = ""
# bytes one prefetch instruction asks for (a multiple of 16), and the chunks one rider asks for: an
# SM's bulk-copy unit takes a rider's asks one after another, and its launch ends with its riders
# (session 34, H200, `small`, 128K: riders of 8 MB each, 256 chunks, made a step 1.42x slower)
CHUNK_BYTES, RIDER_CHUNKS = 32768, 8
# the L2's eviction priority of what is asked for: "last" (kept over the MoE's experts, which
# stream through evict-first) or "normal"
PRIORITY = "last"

_ASK = {
    "normal": "@p cp.async.bulk.prefetch.L2.global [$1], $2;",
    "last": ".reg .b64 pol; createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
            "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol;",
}


@triton.jit
def _ride(table_ptr, sink_ptr, n, r, ASK: tl.constexpr, LANES: tl.constexpr, CHUNKS: tl.constexpr):
    """Rider ``r`` of a launch of LANES threads: CHUNKS of them, evenly spaced, each ask the L2
    for one byte range table[r * CHUNKS + j] = (address, bytes). ``sink`` is written only
    where an instruction's result is nonzero (never): it keeps the compiler from dropping
    instructions whose only effect is outside the kernel."""
    lane = tl.arange(0, LANES)
    i = r * CHUNKS + lane // (LANES // CHUNKS)
    m = (lane % (LANES // CHUNKS) == 0) & (i < n)
    address = tl.load(table_ptr + 2 * i, mask=m, other=0)
    size = tl.load(table_ptr + 2 * i + 1, mask=m, other=0).to(tl.int32)
    done = tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.s32 p, $2, 0; " + ASK + " mov.u32 $0, 0; }",
                                     "=r,l,r", [address, size], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(sink_ptr + i, done, mask=m & (done != 0))


def ranges(tensors, chunk: int) -> list[tuple[int, int]]:
    """(address, bytes) of ``chunk`` bytes or fewer covering each tensor's storage once: the
    table the riders read. A range starts 16-aligned and its length is a multiple of 16
    (the instruction's rule): a tensor's first and last bytes are rounded out to 16, which
    asks for at most 15 bytes more at either end (inside the same 32-byte sectors)."""
    assert chunk % 16 == 0
    out = []
    for t in tensors:
        start = t.data_ptr() & ~15
        end = (t.data_ptr() + t.numel() * t.element_size() + 15) & ~15
        out += [(a, min(chunk, end - a)) for a in range(start, end, chunk)]
    return out


@dataclass(frozen=True)
class Asks:
    """A table of byte ranges on the device for riders: ``table`` int64 [n, 2] of (address,
    bytes), ``sink`` int32 [n] (never written), ``n`` ranges."""
    table: torch.Tensor
    sink: torch.Tensor
    n: int

    def launch(self, lanes: int) -> tuple[int, dict]:
        """(riders, their launch arguments) for a launch of ``lanes`` threads a program: a
        rider asks for ``RIDER_CHUNKS`` ranges (at most one a thread)."""
        chunks = min(RIDER_CHUNKS, lanes)
        assert lanes % chunks == 0, (lanes, chunks)
        return triton.cdiv(self.n, chunks), {"ride_ptr": self.table, "ride_sink": self.sink, "ride_n": self.n,
                                             "ASK": _ASK[PRIORITY], "RIDERS": triton.cdiv(self.n, chunks),
                                             "RIDE_LANES": lanes, "RIDE_CHUNKS": chunks}


_TABLES: dict = {}  # (device, addresses and sizes, chunk) -> Asks; weights stay put


def asks(tensors, device: torch.device) -> Asks | None:
    """The :class:`Asks` of ``tensors``' bytes, made on first use; None while a graph is
    captured and they were not made before (its warm-up makes them: a hint skipped)."""
    key = (device.index, tuple((t.data_ptr(), t.numel() * t.element_size()) for t in tensors), CHUNK_BYTES)
    if key not in _TABLES:
        if torch.cuda.is_current_stream_capturing():
            return None
        rows = ranges(tensors, CHUNK_BYTES)
        _TABLES[key] = Asks(torch.tensor(rows, dtype=torch.int64).to(device),
                            torch.zeros(len(rows), dtype=torch.int32, device=device), len(rows))
    return _TABLES[key]
