"""Weights asked into the GPU's L2 ahead of their readers, on a stream beside the decode step.

A batch-1 decode step alternates kernels that stream weights (the GEMVs, the MoE) with chains
of small dependent kernels that leave the memory bus idle (the mHC sites, the window entry,
the indexer and its top-k, the sparse attention and its merge). A GEMV's own programs ask for
their weight tiles before their dependent launch's wait (``model.kernels.matvec``), but only
while the one kernel before them runs. ``prefetch_l2(*weights)`` launches, beside the step on
a stream of its own, one small kernel that asks the L2 for the weights' bytes
(``cp.async.bulk.prefetch.L2``, sm_90): issued once the work before the call has finished, it
overlaps the whole chain that follows, and the GEMVs after it then read from the L2.

A prefetch is a hint: it reads nothing back and writes nothing, so every kernel computes the
same with or without it (``tests/test_prefetch.py``); it needs a CUDA device of compute
capability 9 or later, and is skipped elsewhere (the CPU, Triton's interpreter).
``join()`` makes the current stream wait for the prefetches (before a graph's capture ends).

Owns the byte ranges' table (``ranges``) and the launch. Does not own which weights are
asked for when (``model.model``) or whether it runs (``model.kernels.prefetch_l2``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# off by default until timed: ``gpu_bench.py --knobs prefetch.ENABLED``
ENABLED = False
# which of the step's asks run (``model.model.Block.prefetched``'s parts, space-separated)
PARTS = "input output"
# bytes one prefetch instruction asks for (a multiple of 16), and the instructions a program
# issues (one a lane, a warp a program): 16 MB is 512 chunks of 32 KB, 16 programs
CHUNK_BYTES, LANES = 32768, 32
# the L2's eviction priority of what is prefetched: "last" (kept over normal loads, such as the
# MoE's experts streaming through) or "normal"
PRIORITY = "last"

_ASK = {
    "normal": "@p cp.async.bulk.prefetch.L2.global [$1], $2;",
    "last": ".reg .b64 pol; createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
            "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol;",
}


@triton.jit
def _prefetch_kernel(table_ptr, sink_ptr, n, ASK: tl.constexpr, LANES: tl.constexpr):
    """Lane i of program p: the byte range table[p * LANES + i] = (address, bytes) asked into
    the L2. ``sink`` is written only if an instruction's result were nonzero (never): it
    keeps the compiler from dropping instructions whose only effect is outside the kernel."""
    i = tl.program_id(0) * LANES + tl.arange(0, LANES)
    m = i < n
    address = tl.load(table_ptr + 2 * i, mask=m, other=0)
    size = tl.load(table_ptr + 2 * i + 1, mask=m, other=0).to(tl.int32)
    done = tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.s32 p, $2, 0; " + ASK + " mov.u32 $0, 0; }",
                                     "=r,l,r", [address, size], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(sink_ptr + i, done, mask=m & (done != 0))


def ranges(tensors, chunk: int) -> list[tuple[int, int]]:
    """(address, bytes) of ``chunk`` bytes or fewer covering each tensor's storage once: the
    table the kernel reads. A range starts 16-aligned and its length is a multiple of 16
    (the instruction's rule): a tensor's first and last bytes are rounded out to 16, which
    asks for at most 15 bytes more at either end (inside the same 32-byte sectors)."""
    assert chunk % 16 == 0
    out = []
    for t in tensors:
        start = t.data_ptr() & ~15
        end = (t.data_ptr() + t.numel() * t.element_size() + 15) & ~15
        out += [(a, min(chunk, end - a)) for a in range(start, end, chunk)]
    return out


_TABLES: dict = {}  # (device, addresses and sizes, chunk) -> (table on the device, sink); weights stay put
_STREAMS: dict = {}  # device index -> the prefetch stream
_PENDING: list = []  # streams with prefetches not yet joined


def _key(tensors, device: torch.device) -> tuple:
    return device.index, tuple((t.data_ptr(), t.numel() * t.element_size()) for t in tensors), CHUNK_BYTES


def _table(tensors, device: torch.device):
    key = _key(tensors, device)
    if key not in _TABLES:
        rows = ranges(tensors, CHUNK_BYTES)
        table = torch.tensor(rows, dtype=torch.int64).to(device)
        _TABLES[key] = (table, torch.zeros(len(rows), dtype=torch.int32, device=device))
    return _TABLES[key]


def prefetch_l2(*tensors: torch.Tensor) -> None:
    """Ask the L2 for ``tensors``' bytes, on the prefetch stream once the current stream's work
    so far is done; the current stream goes on at once."""
    device = tensors[0].device
    if torch.cuda.is_current_stream_capturing() and _key(tensors, device) not in _TABLES:
        return  # a table is copied to the device outside a capture (its warm-up made it): a hint skipped
    table, sink = _table(tensors, device)
    main = torch.cuda.current_stream(device)
    side = _STREAMS.setdefault(device.index, torch.cuda.Stream(device))
    side.wait_stream(main)
    with torch.cuda.stream(side):
        _prefetch_kernel[(triton.cdiv(table.shape[0], LANES),)](table, sink, table.shape[0], ASK=_ASK[PRIORITY],
                                                               LANES=LANES, num_warps=1)
    _PENDING.append(side)


def join() -> None:
    """The current stream waits for the prefetches launched since the last join."""
    if _PENDING:
        main = torch.cuda.current_stream()
        for side in {id(s): s for s in _PENDING}.values():
            main.wait_stream(side)
        _PENDING.clear()


def forget() -> None:
    """Drop the pending prefetches unjoined (a capture that failed never ran them)."""
    _PENDING.clear()
