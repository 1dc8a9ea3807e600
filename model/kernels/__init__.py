"""Fused decode kernels on packed cache bytes, and the one place that picks kernel or twin.

Public functions: ``pack_window`` / ``pack_main`` / ``pack_index`` (KV rows to the cache's
bytes, equal to ``model.blockfp``'s, whose functions are their twins) and ``fake_quant_fp8`` /
``fake_quant_fp4`` (the values those bytes hold, likewise);
``hc_split(mixes, scale, base, hc, iters, eps)`` -> (pre, post, comb), the mHC mixes after
their projection (the model's own maths is its twin ``hc_split_ref``, used wherever the
kernel is not); ``rope(x, cos, sin)`` (the RoPE rotation, kernel in ``model.kernels.rotary``,
bit-exact with its twin ``rope_ref``) and ``rms_norm(x, weight, eps)`` (kernel in
``model.kernels.norm``, twin ``rms_norm_ref``), ``hc_collapse(streams, pre)`` and
``hc_expand(y, residual, post, comb)`` (kernels in ``model.kernels.streams``, bit-exact with
twins of the same names + ``_ref``) — these five on any number of tokens; the last four
also in training, through the closed-form backward passes of ``model.kernels.backward``;
``engram_gate(...)`` (the Engram value gated into the streams, kernel in
``model.kernels.engram``, twin ``engram_gate_ref``; any number of tokens, not in training);
``ngram_hash(...)`` (the Engram rows of each token's n-grams, kernel in
``model.kernels.engram``, twin ``ngram_hash_ref``, bit-exact: integers; any number of tokens);
``hc_site(...)``: a whole mHC site, two launches on a decode step's few tokens, else its
parts (``hc_site_parts``: the functions above);
and, for one decode step (one query per batch row):
- ``sparse_attention(q, window, window_valid, records, record_idx, sink, scale)`` -> [B, H, D]
  fp32 (or ``out_dtype``): ``Attention.attend`` for S=1 on FP8 window rows and selected FP4
  records; ``window_at`` = (ring positions, query position, span) in place of the mask.
- ``pack_window_at(kv, data, ring_pos, pos)``: a step's window entry packed into its ring slot;
  ``window_entry(kv, norm_weight, eps, cos, sin, data, ring_pos, pos)``: the entry made from
  its K=V latent (norm, RoPE, FP8) and packed there, one launch.
- ``compress_step(x, weights, norm, hist, records, index, wk, k_norm, inv_freq, pos, ratio,
  emit)``: a KV source's compressor in a decode step, its history ring, record and index key
  written in four launches (``model.kernels.pack``), or False and the caller runs the torch path.
- ``indexer_scores(q, weights, keys, n_visible, head_scale, rows=None, weight_scale=1.0)`` -> [B, N] fp32:
  ``Indexer.scores`` for S=1 on FP4 index keys (``n_visible`` an int, a one-element
  device tensor that a CUDA graph can hold, or (position, ratio)); with ``rows`` [B, M], the
  scores of those keys alone (a candidate pool's records).
- ``topk_rows(scores, k, rows=None, width=None)`` -> int64 [R, width]: the positions (or
  ``rows``' entries) of each row's k largest scores, the choice of the model's
  ``stable_topk`` (ties to the lower position, -inf never), in ascending order, -1 after
  (kernel in ``model.kernels.select``: a radix select over many programs, six launches where
  torch's sort took ~8; ``DSAGENT_SELECT=0`` sorts instead; twin ``topk_rows_ref``).
  ``top_records(scores, k)`` -> int64 [..., <= k]: the indexer's selection of each query (the
  reference's ``top_records``), through ``topk_rows`` outside autograd where it runs.

- ``moe_decode(x, ...)`` -> [N, D] fp32 or None: ``model.moe.MoE`` on a few text tokens in
  four or five launches (``model.kernels.moe``) where ``moe_decode_runs(x)``; None if it cannot
  be built, and the caller runs the MoE in torch, which is its twin.
- ``gemv(x, *weights, groups=1)``: a decode step's linear layers on its few rows
  (``model.kernels.matvec``) where ``gemv_runs(x, *layers)`` (on by default, ``DSAGENT_GEMV=0``
  turns it off); twin ``gemv_ref``. ``x`` may be a :class:`Collapsed`, which ``resolve(x)`` makes;
  a weight a float tensor or a :class:`Packed` one (FP8 / FP4 as the checkpoint stores it,
  dequantised in the kernel's registers).

``fp32_linear(x, w)``: ``F.linear(x.float(), w.float())``, the router's and the compressor's
fp32 products (and the mHC mixes in ``hc_site_parts``), on CUDA as bf16 GEMMs with fp32 sums
(``model.kernels.products``: no fp32 GEMM on the CUDA path);

and, for a prefill's chunk:
- ``sparse_prefill(q, window, window_pos, records, record_idx, sink, scale)``: a chunk's
  attention on the cache's bytes and ``prefill_index_scores(q, weights, keys, pos, ratio, ...)``
  its index scores (``model.kernels.prefill``: the keys decoded once a call, then a program a
  query, or a block of queries x keys); twins: the decode-step functions above, a query a row.
- ``routed_swiglu(gate, up, route, limit, twin)`` and ``slot_sum(out, order, k, ends, twin)``:
  the grouped MoE's work around its GEMMs, one pass each (``model.kernels.routing``), from
  ``ROUTING_ROWS`` rows; twins: ``model.moe``'s own torch code, passed in.

and, for a prefill's rows on packed weights (``model.kernels.gemm``, where
``packed_gemm_runs(x, *weights)``; ``DSAGENT_PACKED_GEMM=0`` turns them off):
- ``packed_matmul(x, w, groups=1)``: ``F.linear(x, w.dense(x.dtype))`` (a grouped projection
  with ``groups``): for few rows the weight's bytes decoded in registers, tensor-core dots; for
  ``gemm.DEQUANT_ROWS`` or more the weight's floats made once (``dequantised``) and torch's GEMM;
- ``dequantised(w, dtype)`` / ``dequantised_fp4_stack(w, s, in_features, dtype, twin)``: a packed
  weight's or an FP4 expert stack's floats in one pass (``model.kernels.dequant``), the twin's bits;
- ``grouped_fp4(x, ends, w, s, twin, paired=None, route=None, limit=0.0, rows=None)``: rows
  sorted by expert (``x[rows]``, read in place) times an FP4 expert stack, or the up projection
  whole (w1 with w3, the SwiGLU and the route weight); ``twin()`` where the kernel does not run.

Each runs its Triton kernel (``model.kernels.fused`` unless named above) when
:func:`triton_available` and the tensors are on CUDA (or ``TRITON_INTERPRET=1``, Triton's CPU
interpreter, for tests), else the pure-PyTorch twin of ``model.kernels.reference``; both
compute the same function (``tests/test_kernels.py``, ``test_rope_kernel.py``,
``test_norm_kernel.py``). On a GPU of compute capability 9 or later every Triton kernel
launches as a programmatic dependent launch (``fused.chained``; ``DSAGENT_PDL=0`` turns it
off): it may be scheduled while the kernel before it runs and waits at its start for that
one's writes, so it computes the same and only the launch latency is hidden
(``tests/test_pdl.py``). Triton is optional (``pip install .[gpu]``) and is imported only when
a kernel runs. Does not own: where the inputs come from (``model.model``, ``model.cache``).
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
import warnings

import torch

from model import blockfp
from model.kernels import backward, products, reference
from model.kernels.collapsed import Collapsed
from model.kernels.packed import Packed
from model.kernels.products import fp32_linear
from model.kernels.reference import (engram_gate_ref, hc_collapse_ref, hc_expand_ref, hc_split_ref, indexer_scores_ref,
                                    ngram_hash_ref, rms_norm_ref, rope_ref, sparse_attention_ref, topk_rows_ref)
from model.kernels.reference import top_records as top_records_ref

__all__ = ["triton_available", "enabled", "hc_split", "hc_collapse", "hc_expand", "hc_site", "hc_site_parts", "rope",
           "rms_norm", "sparse_attention", "indexer_scores", "moe_decode", "moe_decode_runs", "pack_window", "pack_main",
           "pack_index", "fake_quant_fp8", "fake_quant_fp4", "hc_split_ref", "hc_collapse_ref", "hc_expand_ref",
           "rope_ref", "rms_norm_ref", "sparse_attention_ref", "indexer_scores_ref", "engram_gate",
           "engram_gate_ref", "ngram_hash", "ngram_hash_ref", "gemv", "gemv_runs", "gemv_ref", "Packed", "mhc_join",
           "mhc_forget", "selects", "top_records", "topk_rows", "topk_rows_ref", "window_entry", "compress_step", "resolve",
           "beside_on", "Beside", "engram_step", "packed_gemm_runs", "packed_matmul", "grouped_fp4",
           "dequantised", "dequantised_fp4_stack", "sparse_prefill", "prefill_index_scores", "routed_swiglu", "slot_sum", "fp32_linear"]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """Triton is importable and has somewhere to run: a CUDA device, or its CPU interpreter."""
    return _triton_installed() and (torch.cuda.is_available() or _interpreting())


def _use_triton(t: torch.Tensor) -> bool:
    return (t.is_cuda or _interpreting()) and triton_available()  # the cheap test first: it runs per layer


def enabled(t: torch.Tensor) -> bool:
    """Whether the model's decode steps on ``t``'s device use these kernels: Triton can run
    there and ``DSAGENT_KERNELS`` is not ``0``."""
    return _use_triton(t) and os.environ.get("DSAGENT_KERNELS", "1") != "0"


def sparse_attention(q: torch.Tensor, window: torch.Tensor, window_valid: torch.Tensor | None,
                     records: torch.Tensor, record_idx: torch.Tensor, sink: torch.Tensor, scale: float,
                     splits: int | None = None, out_dtype: torch.dtype = torch.float32,
                     window_at: tuple[torch.Tensor, torch.Tensor, int] | None = None,
                     turn_back: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One decode step of window + selected-record attention with the sink; see
    :func:`model.kernels.reference.sparse_attention_ref` for shapes. ``splits`` fixes how
    many programs share one row's keys on the kernel path (None: enough to fill the GPU);
    the output is computed in fp32 and returned in ``out_dtype`` (the kernel writes bf16
    itself, rounded as ``.to`` rounds). ``window_at`` = (ring positions [W], the query's
    position [1], window span) stands for ``window_valid`` = positions in (query - span,
    query], every row alike: the kernel tests the slots itself (six launches fewer).
    ``turn_back`` = (cos, sin [1, r]): each head's output then turned by :func:`rope_ref`
    (the de-rotation before ``wo_a``, sin negated), by the kernel's merge launch."""
    if _use_triton(q) and out_dtype in (torch.float32, torch.bfloat16):
        from model.kernels import fused

        return fused.sparse_attention(q, window, window_valid, records, record_idx, sink, scale, splits, out_dtype,
                                      window_at, turn_back)
    if window_at is not None:
        at, cur, span = window_at
        window_valid = ((at >= 0) & (at <= cur) & (at > cur - span)).expand(q.shape[0], -1)
    out = sparse_attention_ref(q, window, window_valid, records, record_idx, sink, scale).to(out_dtype)
    return out if turn_back is None else rope_ref(out[:, None], *turn_back)[:, 0]


def attends_packed(t: torch.Tensor) -> bool:
    """Whether a step of several tokens on ``t``'s device reads the cache's bytes in place
    through :func:`sparse_prefill` and :func:`prefill_index_scores`' kernels (``model.decode_step``
    sets ``Step.packed_reads`` from this), rather than the reference's float keys;
    ``DSAGENT_PREFILL_KERNELS=0`` turns this alone off (to time the two side by side)."""
    return enabled(t) and _prefill_form() != "0"


def _prefill_form() -> str:
    """``DSAGENT_PREFILL_KERNELS``: "1" (the default) a prefill's keys decoded once a call, then
    ``model.kernels.prefill``'s kernels, and the grouped MoE's routing in ``model.kernels.routing``;
    "rows" the form before those (the decode kernels a query a row, the routing in torch), to
    time the two side by side; "0" the reference's float keys too."""
    return os.environ.get("DSAGENT_PREFILL_KERNELS", "1")


def sparse_prefill(q: torch.Tensor, window: torch.Tensor, window_pos: torch.Tensor, records: torch.Tensor | None,
                   record_idx: torch.Tensor | None, sink: torch.Tensor, scale: float,
                   out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``Attention.attend`` of S prefill queries of one sequence on packed bytes, each query a
    row of :func:`sparse_attention` (kernel or twin): q [S, H, D]; ``window`` uint8 [span + S,
    D + D/32], the FP8 entries of positions [start - span, start + S) in order (``span`` the
    sliding window), ``window_pos`` [span + S] their positions (-1: no entry), so that query i's
    window is rows i + 1 .. i + span — a strided view, read in place; ``records`` uint8 [N, D/2 +
    D/16], the source's FP4 records, every query's (a stride-0 view), and ``record_idx`` [S, K]
    each query's selection (-1 none); either None: no records. No [S, K, D] gather is made on
    the kernel path: ``model.kernels.prefill`` decodes the window's and the records' rows once
    to bf16, then attends a program a query (``DSAGENT_PREFILL_KERNELS=rows``: the decode
    kernel instead, each query a row decoding its own keys). -> [S, H, D]."""
    if _use_triton(q) and _prefill_form() != "rows":
        from model.kernels import prefill

        return prefill.sparse_prefill(q, window, window_pos, records, record_idx, sink, scale, out_dtype)
    S, span = q.shape[0], window.shape[0] - q.shape[0]
    rows = window.as_strided((S, span, window.shape[1]), (window.stride(0), window.stride(0), window.stride(1)),
                             window.storage_offset() + window.stride(0))
    at = window_pos.as_strided((S, span), (window_pos.stride(0), window_pos.stride(0)),
                               window_pos.storage_offset() + window_pos.stride(0))
    if records is None or record_idx is None:
        D = q.shape[-1]
        records = torch.zeros(0, D // 2 + D // 16, dtype=torch.uint8, device=q.device)
        record_idx = torch.full((S, 0), -1, dtype=torch.long, device=q.device)
    return sparse_attention(q, rows, at >= 0, records.expand(S, -1, -1), record_idx, sink, scale,
                            splits=1 if _use_triton(q) else None, out_dtype=out_dtype)


def prefill_index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, pos: torch.Tensor, ratio: int,
                         head_scale: float, weight_scale: float = 1.0) -> torch.Tensor:
    """``Indexer.scores`` of S prefill queries of one sequence on the source's FP4 index keys
    ``keys`` uint8 [N, DI / 2 + DI / 32]: q [S, HI, DI], weights [S, HI], positions ``pos`` [S]
    (query t sees (pos[t] + 1) // ratio keys) -> [S, N] fp32, -inf where unseen. The kernel
    path (``model.kernels.prefill``) decodes the keys once to bf16 and scores a block of
    queries against several blocks of keys a program; else :func:`indexer_scores`, each query a row
    (``DSAGENT_PREFILL_KERNELS=rows`` takes that on the GPU too)."""
    if _use_triton(q) and _prefill_form() != "rows":
        from model.kernels import prefill

        return prefill.index_scores(q, weights, keys, pos, ratio, head_scale, weight_scale)
    return indexer_scores(q, weights, keys.expand(q.shape[0], -1, -1), (pos, ratio), head_scale,
                          weight_scale=weight_scale)


def merge_turns_back(q: torch.Tensor) -> bool:
    """Whether a fused decode step's attention on ``q`` de-rotates its own output
    (:func:`sparse_attention`'s ``turn_back``, in the kernel's merge launch where
    ``fused.MERGE_TURNS_BACK``), so that ``wo_a``'s GEMV need not."""
    if not _use_triton(q):
        return False
    from model.kernels import fused

    return fused.MERGE_TURNS_BACK


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, n_visible, head_scale: float,
                   rows: torch.Tensor | None = None, weight_scale: float = 1.0) -> torch.Tensor:
    """Index scores [B, N] of one decode step, or [B, M] of the keys at ``rows`` [B, M] (-1:
    none); see :func:`model.kernels.reference.indexer_scores_ref` (``n_visible`` a count, or
    (position, ratio), which the kernel turns into the count itself)."""
    if _use_triton(q):
        from model.kernels import fused

        return fused.indexer_scores(q, weights, keys, n_visible, head_scale, rows, weight_scale)
    return indexer_scores_ref(q, weights, keys, n_visible, head_scale, rows, weight_scale)


def selects(device: torch.device) -> bool:
    """Whether a top-k on ``device`` runs the select kernel (:func:`topk_rows`; at prefill
    :func:`top_records` outside autograd): Triton runs there and ``DSAGENT_SELECT`` is not ``0``."""
    return ((device.type == "cuda" or _interpreting()) and triton_available()
            and os.environ.get("DSAGENT_SELECT", "1") != "0")


def top_records(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Each query's selection among index ``scores`` [..., n]: the records of its top-k scores,
    -1 where there are fewer than k (:func:`model.kernels.reference.top_records`, whose order is
    the scores'). Outside autograd, where :func:`topk_rows` runs its kernel, the same records in
    ascending order: a radix select where the reference sorts every row (a prefill's chunk of
    4,096 queries sorted its [4096, n] scores once an index layer). The attention sums over the
    set, so only the order of its sums differs."""
    if not torch.is_grad_enabled() and selects(scores.device):
        return topk_rows(scores.reshape(-1, scores.shape[-1]), k).view(*scores.shape[:-1], -1)
    return top_records_ref(scores, k)


def topk_rows(scores: torch.Tensor, k: int, rows: torch.Tensor | None = None, width: int | None = None) -> torch.Tensor:
    """Each row's top-k positions of ``scores`` [R, n] (or ``rows``' entries there) in
    ascending order, -1 after, up to ``width``; see :func:`model.kernels.reference.topk_rows_ref`."""
    if selects(scores.device):
        from model.kernels import select

        return select.topk_rows(scores, k, rows, width)
    return topk_rows_ref(scores, k, rows, width)


MOE_TOKENS = 16  # the most tokens moe_decode takes: decode steps (batch x 1), not prefill chunks


def moe_decode_runs(x: torch.Tensor) -> bool:
    """Whether :func:`moe_decode` runs on tokens ``x`` [N, D]: where :func:`enabled`, outside
    autograd, N <= ``MOE_TOKENS`` and ``DSAGENT_FUSED_MOE`` is not ``0``."""
    return (x.shape[0] <= MOE_TOKENS and not torch.is_grad_enabled() and _kernel_runs("MoE kernel", x)
            and os.environ.get("DSAGENT_FUSED_MOE", "1") != "0")


def moe_decode(x: torch.Tensor, *weights: torch.Tensor, **config) -> torch.Tensor | None:
    """The MoE of tokens ``x`` [N, D] by the Triton kernels of ``model.kernels.moe`` (see
    ``moe_decode`` there for the weights and ``config``), for a caller that asked
    :func:`moe_decode_runs`. A kernel that cannot be built warns once and returns None, and
    the caller runs the MoE in torch (as :func:`moe_decode_runs` says from then on)."""
    from model.kernels import moe

    return _guarded("MoE kernel", lambda *a: moe.moe_decode(*a, **config), lambda *a: None, x, *weights)


def beside_on(x: torch.Tensor, knob: str) -> bool:
    """Whether a decode step's work runs beside its layers (:class:`Beside`) under ``knob``
    ("module.NAME", a boolean of ``model.kernels``: ``engram.BESIDE``, ``select.POOL_BESIDE``,
    ``pack.COMPRESS_BESIDE``): only while a CUDA graph of the step is captured on ``x``'s
    device and the kernels are :func:`enabled`."""
    if not (x.is_cuda and enabled(x) and torch.cuda.is_current_stream_capturing()):
        return False
    module, name = knob.split(".")
    return getattr(importlib.import_module(f"model.kernels.{module}"), name)


class Beside:
    """``fn(*args)`` launched on a side stream, beside whatever the current stream runs after
    it: work of a decode step's graph whose result is read much later than its inputs exist
    (the Engram layers' projections of the step's hashed rows, from the step's start; the
    candidate pool, from its source layer to the first layer that reads it; a compressor,
    beside the query's projections). :meth:`value` makes the current stream wait for it (an
    event recorded after it, so later work on the side stream is not waited for) and returns
    its result; every one made in a capture must be joined before the capture ends. One side
    stream a device: work beside is ordered among itself in the order it was launched.
    Timed (2026-12-04, 3097e7e): pays where the work is long and read late; a join is a full
    dependency, ~2 µs, so moving a 2 µs launch beside gains nothing."""

    _streams: dict = {}  # device index -> the side stream, made once

    def __init__(self, fn, *args, device: torch.device):
        """``fn(*args)`` launched beside (``device``: where the current stream is). ``args`` are
        kept until the join: the allocator must not hand their memory to the current stream's
        later work while the side stream may still read it."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in Beside._streams:
            Beside._streams[index] = torch.cuda.Stream(index)
        side = Beside._streams[index]
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self._out = fn(*args)
        self._event = torch.cuda.Event()
        self._event.record(side)
        self._joined, self._args = False, args

    def join(self) -> None:
        """The current stream waits for it (a no-op after the first)."""
        self.value()

    def value(self):
        if not self._joined:
            torch.cuda.current_stream().wait_event(self._event)
            self._joined, self._args = True, ()
        return self._out


def resolve(y):
    """``y`` made: a :class:`Collapsed`'s value, a tensor as it is."""
    return y.value() if isinstance(y, Collapsed) else y


GEMV_TOKENS = 4  # the most rows gemv takes: a decode step at small batch (cuBLAS's GEMMs from there)


def _gemv_kind(layer: torch.nn.Module, dtype: torch.dtype):
    """What the GEMV kernel reads of ``layer``'s weight: "plain" (a float weight of x's
    ``dtype``, read once: a QAT layer's is computed on each read), a packed weight's (format,
    scale block), or None where the kernel cannot read it."""
    if getattr(layer, "fmt", "plain") == "plain":
        return "plain" if layer.weight.dtype == dtype else None
    w = layer.gemv_weight()
    return (w.fmt, w.scale_block()) if w.decodable() else None


def gemv_runs(x: torch.Tensor, *layers: torch.nn.Module) -> bool:
    """Whether :func:`gemv` runs on rows ``x`` [..., D] against the ``layers``' weights: where
    :func:`enabled` and ``DSAGENT_GEMV`` is not ``0``, outside autograd, at most ``GEMV_TOKENS``
    rows of a float dtype, and weights of one kind: plain of x's dtype, or packed alike
    (:class:`Packed`, one format and scale block: one launch decodes them the same way).
    On by default since 2026-12-03 (0b5cbd1), when each
    program began asking for its whole weight tile before its dependent launch's wait: a
    `small` decode step on the H200 took 3.84 ms at 128K where cuBLAS's GEMMs took 4.55
    (4K: 3.57 against 4.24; one call, ``DSAGENT_GEMV`` 1 beside 0). The weights are read
    last: a QAT layer's is computed on each read."""
    if not (os.environ.get("DSAGENT_GEMV", "1") != "0" and x.numel() <= GEMV_TOKENS * x.shape[-1]
            and x.dtype in (torch.float32, torch.bfloat16) and not torch.is_grad_enabled()
            and _kernel_runs("GEMV kernel", x)):
        return False
    kinds = {_gemv_kind(layer, x.dtype) for layer in layers}
    return None not in kinds and len(kinds) <= 1


def gemv(x: torch.Tensor, *weights, groups: int = 1, norm=None, rope_in=None,
         rope_out=None, keep: bool = False) -> tuple[torch.Tensor, ...]:
    """``F.linear(x, w)`` for each of one or two weights, in one launch (``model.kernels.matvec``),
    for a caller that asked :func:`gemv_runs`; a weight is a float tensor, or a :class:`Packed`
    one, dequantised in the kernel's registers (the same bits as the kernel on
    ``w.dense(x.dtype)`` where those values are exact in x's dtype: always in fp32, and in bf16
    but for exponents out of its range). ``groups`` > 1: ``Attention``'s grouped output
    projection. ``norm`` = (weight, eps): of ``rms_norm(x, weight, eps)`` instead of x;
    ``rope_in`` / ``rope_out`` = (cos, sin, head_dim): of ``rope`` of x seen as heads of
    head_dim channels / the output so rotated (one weight with these); ``keep`` (with ``norm``):
    the normalised x returned after the outputs, for its other readers. Agrees with cuBLAS to
    rounding (another summation order); the norm's and the rotations' own roundings are
    those of :func:`rms_norm` and :func:`rope`. A kernel that cannot be built warns once and
    the twin (:func:`gemv_ref`) runs from then on."""
    from model.kernels import matvec as kernel

    options = dict(groups=groups, norm=norm, rope_in=rope_in, rope_out=rope_out, keep=keep)
    return _guarded("GEMV kernel", functools.partial(kernel.gemv, **options),
                    lambda x, *w: gemv_ref(resolve(x), *w, **options), x, *weights)


def gemv_ref(x: torch.Tensor, *weights, groups: int = 1, norm=None, rope_in=None,
             rope_out=None, keep: bool = False) -> tuple[torch.Tensor, ...]:
    """:func:`gemv`'s twin: ``F.linear``, or the grouped einsum of ``model.linear.grouped_linear``,
    after ``rms_norm_ref`` / ``rope_ref`` of x and before ``rope_ref`` of the output; a
    :class:`Packed` weight dequantised to x's dtype first."""
    weights = tuple(w.dense(x.dtype) if isinstance(w, Packed) else w for w in weights)

    def heads(t: torch.Tensor, rope) -> torch.Tensor:
        cos, sin, hd = rope
        return rope_ref(t.reshape(-1, cos.shape[0], t.shape[-1] // hd, hd), cos, sin).reshape(t.shape)

    if norm is not None:
        x = rms_norm_ref(x, *norm)
    if rope_in is not None:
        x = heads(x, rope_in)
    if groups == 1:
        outs = tuple(torch.nn.functional.linear(x, w) for w in weights)
    else:
        (w,) = weights
        grouped = x.reshape(*x.shape[:-1], groups, -1)
        outs = (torch.einsum("...gi,goi->...go", grouped, w.view(groups, w.shape[0] // groups, -1)).flatten(-2),)
    if rope_out is not None:
        outs = (heads(outs[0], rope_out),)
    return outs + (x,) if keep else outs


def packed_gemm_runs(x: torch.Tensor, *weights) -> bool:
    """Whether :func:`packed_matmul` / :func:`grouped_fp4` run on rows ``x`` [..., K] against
    ``weights`` (:class:`Packed` ones, or an FP4 stack's bytes): where :func:`enabled`, outside
    autograd, on bf16 rows (the model's dtype on CUDA; fp32 too under the interpreter, for
    tests), every weight decodable, and ``DSAGENT_PACKED_GEMM`` not ``0``."""
    return (os.environ.get("DSAGENT_PACKED_GEMM", "1") != "0" and not torch.is_grad_enabled()
            and (x.dtype == torch.bfloat16 or (_interpreting() and x.dtype == torch.float32))
            and all(not isinstance(w, Packed) or w.decodable() for w in weights)
            and _kernel_runs("packed GEMM kernel", x))


def packed_matmul(x: torch.Tensor, w: Packed, groups: int = 1) -> torch.Tensor:
    """``F.linear(x, w.dense(x.dtype))`` of rows x [..., K] where :func:`packed_gemm_runs`:
    the weight's FP8 / FP4 bytes decoded in the kernel's registers (``model.kernels.gemm``),
    never a float image of it; agrees with the twin to the summation order. ``groups`` > 1:
    the grouped projection of :func:`gemv_ref` (each group's outputs a multiple of 16)."""
    from model.kernels import gemm

    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] >= gemm.DEQUANT_ROWS:  # many rows: the weight's floats once, then the library's GEMM
        y = gemv_ref(flat, dequantised(w, x.dtype), groups=groups)[0]
    else:
        y = _guarded("packed GEMM kernel", lambda t, p: gemm.packed_matmul(t, p, groups=groups),
                     lambda t, p: gemv_ref(t, p, groups=groups)[0], flat, w)
    return y.view(*x.shape[:-1], y.shape[-1])


def dequantised(w: Packed, dtype: torch.dtype) -> torch.Tensor:
    """``w.dense(dtype)``, the same bits: one pass of ``model.kernels.dequant`` over the bytes
    where :func:`enabled` and the weight is decodable (else, or if it cannot be built, the twin)."""
    if not (w.decodable() and _kernel_runs("dequantisation kernel", w.data)):
        return w.dense(dtype)
    from model.kernels import dequant

    return _guarded("dequantisation kernel", lambda p: dequant.dequantise(p, dtype), lambda p: p.dense(dtype), w)


def dequantised_fp4_stack(w: torch.Tensor, s: torch.Tensor, in_features: int, dtype: torch.dtype, twin) -> torch.Tensor:
    """An FP4 expert stack's floats [E, N, K] from its bytes [E, N, K / 2] and scales: the
    dequantisation kernel where :func:`enabled` (K even), else ``twin()``; the same bits."""
    if in_features % 2 or not _kernel_runs("dequantisation kernel", w):
        return twin()
    from model.kernels import dequant

    return _guarded("dequantisation kernel", lambda t: dequant.dequantise_fp4_stack(t, s, in_features, dtype),
                    lambda t: twin(), w)


# the fewest (token, expert) rows the routing kernels take: a MoE of `small` (bf16, one H100, 2026-12-06,
# 20 calls, best of 5) took 1.14 ms with them against 1.91 at 4,096 tokens (24,576 rows), 0.97 against
# 0.82 at 128 (768 rows), where three more launches from Python cost more than the passes they save
ROUTING_ROWS = 4096


def _routing_runs(x: torch.Tensor, *grads: torch.Tensor) -> bool:
    return (x.shape[0] >= ROUTING_ROWS and _kernel_runs("MoE routing kernel", x, grads)
            and _prefill_form() != "rows")


def routed_swiglu(gate: torch.Tensor, up: torch.Tensor, route: torch.Tensor, limit: float, twin) -> torch.Tensor:
    """``route[:, None] * swiglu(gate, up, limit)`` in gate's dtype, for the grouped MoE's rows
    [R, I] (``model.kernels.routing``: one pass where torch makes eight) where the kernels
    run outside autograd on ``ROUTING_ROWS`` rows or more (and ``DSAGENT_PREFILL_KERNELS`` is
    not ``rows``, the form before it); else, or if it cannot be built (warned once), ``twin()``."""
    if not _routing_runs(gate, gate, up, route):
        return twin()
    from model.kernels import routing

    return _guarded("MoE routing kernel", lambda t: routing.routed_swiglu(t, up, route, limit), lambda t: twin(), gate)


def slot_sum(out: torch.Tensor, order: torch.Tensor, k: int, ends: torch.Tensor, twin) -> torch.Tensor:
    """Each token's k rows of ``out`` [T * k, D] (sorted by expert: ``order``; rows from the
    last group's end on are another rank's, zeros) summed in fp32 in slot order -> [T, D]
    (``model.kernels.routing``) where :func:`routed_swiglu`'s kernel would run; else ``twin()``."""
    if not _routing_runs(out, out):
        return twin()
    from model.kernels import routing

    return _guarded("MoE routing kernel", lambda t: routing.slot_sum(t, order, k, ends), lambda t: twin(), out)


def grouped_fp4(x: torch.Tensor, ends: torch.Tensor, w: torch.Tensor, s: torch.Tensor, twin, *,
                paired: tuple[torch.Tensor, torch.Tensor] | None = None, route: torch.Tensor | None = None,
                limit: float = 0.0, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Rows x [P, K] sorted by expert (expert e's at [ends[e-1], ends[e])) times an FP4 expert
    stack (bytes ``w`` [E, N, K / 2], scales ``s`` [E, N, K / 32]), decoded in registers
    (``model.kernels.gemm.grouped_fp4``; with ``paired`` = (w3, its scales) and ``route``:
    ``route * swiglu(x w^T, x w3^T, limit)``) where :func:`packed_gemm_runs`; else, or if the
    kernel cannot be built (warned once), ``twin()``: the same from dequantised experts. With
    ``rows`` [P], the sorted rows are ``x[rows]``, which the kernel reads in place."""
    if not packed_gemm_runs(x):
        return twin()
    from model.kernels import gemm

    return _guarded("packed GEMM kernel",
                    lambda t: gemm.grouped_fp4(t, ends, w, s, paired=paired, route=route, limit=limit, rows=rows),
                    lambda t: twin(), x)


def hc_split(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps: float):
    """(pre, post, comb) of the mHC mixes. Outside autograd: the Triton kernel where
    :func:`enabled`. With a gradient wanted on CUDA (training): the twin compiled by
    ``torch.compile`` (fused forward and backward instead of ~120 launches each way;
    ``DSAGENT_COMPILE=0`` turns it off). Else the twin :func:`hc_split_ref` (on up to
    ``reference.SINKHORN_HOST_ROWS`` CPU rows its ``host`` loop: the same bits). Both fast paths
    run on every forward, so one that cannot be built costs a warning and the twin for the
    rest of the process, not the session."""
    args = (mixes, scale, base, hc, iters, eps)
    if _kernel_runs("mHC kernel", mixes, grads=(mixes, scale)):
        from model.kernels import fused

        return _guarded("mHC kernel", fused.hc_split, hc_split_ref, *args)
    if (_wants_grad(mixes, scale) and mixes.is_cuda and os.environ.get("DSAGENT_COMPILE", "1") != "0"
            and "compiled mHC" not in _FAILED):
        return _guarded("compiled mHC", _hc_split_compiled, hc_split_ref, *args)
    host = (mixes.device.type == "cpu" and mixes.dtype == torch.float32 and not _wants_grad(mixes, scale, base)
            and 0 < mixes.numel() // mixes.shape[-1] <= reference.SINKHORN_HOST_ROWS)
    return hc_split_ref(*args, host=host)


_COMPILE_ROWS = 8192


def _hc_split_compiled(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
                       eps: float):
    """The compiled twin on the rows flattened and zero-padded to a multiple of
    ``_COMPILE_ROWS``: every call then lands in one dynamic-shape graph. Unpadded, the
    compiler specialised on 1 row and on its own size thresholds (4,096 rows), a fresh
    25-96 s compile each time a training run met a new shape class."""
    flat = mixes.reshape(-1, mixes.shape[-1])
    n = flat.shape[0]
    flat = torch.nn.functional.pad(flat, (0, 0, 0, max(1, -(-n // _COMPILE_ROWS)) * _COMPILE_ROWS - n))
    torch._dynamo.mark_dynamic(flat, 0)
    lead = mixes.shape[:-1]
    return tuple(t[:n].unflatten(0, lead) for t in _compiled_twin()(flat, scale, base, hc, iters, eps))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """RoPE rotation by cos / sin (see :func:`rope_ref`): the kernel where :func:`enabled`,
    else the twin; bit-exact either way. With a gradient wanted, through
    :class:`backward.Rope` (whose backward is the same rotation by -sin). ``in_place``: ``x``
    is the caller's temporary, which the kernel may rotate in place (its rope channels alone
    read and written, where a copy reads and writes every channel); else ``x`` is unchanged."""
    if in_place and x.is_contiguous() and not _wants_grad(x):
        return _kernel_or_twin("RoPE kernel", "rotary.rope_", rope_ref, x, cos, sin, grads=())
    return _kernel_or_twin("RoPE kernel", "rotary.rope", rope_ref, x, cos, sin, grads=(x,),
                           function=backward.Rope)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, upcast: bool = False) -> torch.Tensor:
    """RMSNorm (see :func:`rms_norm_ref`; ``weight`` None: none): the kernel where
    :func:`enabled`, else the twin (with a gradient wanted, through
    :class:`backward.RMSNorm`). Agrees with the twin to a few fp32 ulps before the cast back
    (another summation order). ``upcast`` (no weight): the fp32 norm of ``x.float()``; the
    kernel reads a bf16 x itself rather than after a copy."""
    if upcast:
        assert weight is None
        if x.dtype == torch.bfloat16 and _kernel_runs("RMSNorm kernel", x, grads=(x,)):
            from model.kernels import norm

            return _guarded("RMSNorm kernel", lambda t: norm.rms_norm(t, None, eps, torch.float32),
                            lambda t: rms_norm_ref(t.float(), None, eps), x)
        x = x.float()
    if weight is not None and x.dtype != weight.dtype:
        return rms_norm_ref(x, weight, eps)
    grads = (x,) if weight is None else (x, weight)
    return _kernel_or_twin("RMSNorm kernel", "norm.rms_norm", rms_norm_ref, x, weight, eps, grads=grads,
                           function=backward.RMSNorm)


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """The streams collapsed into a site's input (see :func:`hc_collapse_ref`): the kernel
    where :func:`enabled`, else the twin (with a gradient wanted, through
    :class:`backward.HcCollapse`); bit-exact either way."""
    mhc_join()
    return _kernel_or_twin("mHC collapse kernel", "streams.hc_collapse", hc_collapse_ref, streams, pre,
                           grads=(streams, pre), function=backward.HcCollapse)


def hc_expand(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """A site's output expanded into the streams (see :func:`hc_expand_ref`): the kernel
    where :func:`enabled`, else the twin (with a gradient wanted, through
    :class:`backward.HcExpand`); bit-exact either way."""
    mhc_join()
    return _kernel_or_twin("mHC expand kernel", "streams.hc_expand", hc_expand_ref, y, residual, post, comb,
                           grads=(y, residual, post, comb), function=backward.HcExpand)


def engram_gate(streams: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_weight: torch.Tensor,
                k_weight: torch.Tensor, live: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The Engram value gated into the streams (see :func:`engram_gate_ref`): one kernel
    (``model.kernels.engram``) where :func:`enabled`, outside autograd; else the twin (training
    differentiates through it). Agrees with the twin to a few fp32 ulps before the cast back."""
    return _kernel_or_twin("Engram kernel", "engram.engram_gate", engram_gate_ref, streams, key, value, q_weight,
                           k_weight, live, eps, grads=(streams, key, value, q_weight, k_weight))


SITE_TOKENS = 16  # the most tokens hc_site's kernel takes: decode steps (its dots split each token's channels)


def hc_site(streams: torch.Tensor, pre: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
            norm_weight: torch.Tensor, *, eps: float, norm_eps: float, iters: int, hc_eps: float,
            expand: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, overlap: bool = False,
            norm_later: bool = False, name: str = ""):
    """One mHC site: (streams, pre', post', comb', x). ``expand`` = (y, post, comb) of the
    site before: the streams are first ``hc_expand(y, streams, post, comb)``. The mixes
    (pre', post', comb') are ``hc_split`` of ``fn`` [(2 + hc) * hc, hc * D] times the
    RMS-normalised flattened streams; x, the site's input, is ``rms_norm(hc_collapse(streams,
    pre), norm_weight)`` (``pre``: the site before's, V4.1's lagged mHC). On a decode step's
    few tokens (at most ``SITE_TOKENS``) where :func:`enabled`, outside autograd: two
    launches (``model.kernels.streams.hc_site``: split dots, then the split, collapse and
    norm) where the parts take five or six; the dots are summed in another order, so the
    mixes agree with :func:`hc_site_parts` to a few fp32 ulps. Else :func:`hc_site_parts`.

    ``overlap`` (a caller whose next reads of the mixes come through this module, and that
    calls :func:`mhc_join` before its CUDA graph's capture ends: the model's whole-step
    decode): while a graph is captured on CUDA and ``DSAGENT_MHC_OVERLAP`` is not ``0``, the
    split (its Sinkhorn, ~4 us of serial reductions at batch 1) runs on a side stream beside
    the site's input and the attention or MoE after it — V4.1's mixes are read only at the
    next site — and ``hc_site``, ``hc_collapse`` and ``hc_expand`` join it before they run.
    The same kernels on the same inputs: the same bits.

    ``norm_later`` (a caller whose consumer of x can normalise it — a GEMV's or the MoE
    gate's ``norm``): a sixth value, True where the kernel ran (``streams.NORM_LATER`` on)
    and x is the collapse before the site's norm (made by the dots launch, channel block by
    channel block: the launch that collapsed and normalised the whole row, one program a
    token after the dots, is gone); else False and x normalised as above. With ``overlap``
    beside too (and ``streams.DOTS_BESIDE``, on streams at most ``streams.DOTS_BESIDE_MAX_D``
    wide), the dots launch runs on the side stream before the split and x is a
    :class:`Collapsed`, made by its consumer's launch (the site then puts nothing on the
    current stream); a consumer that cannot takes its ``value()``.
    ``name`` ("attn", "ffn"): which site, for a ``DOTS_BESIDE`` that names one."""
    mhc_join()  # the site before's split, where it ran beside: its post / comb are read here
    args = (streams, pre, fn, scale, base, norm_weight, eps, norm_eps, iters, hc_eps, expand)
    rows = streams.numel() // (streams.shape[-2] * streams.shape[-1])
    if (0 < rows <= SITE_TOKENS and streams.shape[-2] in (1, 2, 4) and norm_weight.dtype == streams.dtype
            and fn.dtype == torch.float32
            and streams.dtype in (torch.float32, torch.bfloat16)
            and _kernel_runs("mHC site kernel", streams, grads=(streams, pre, fn, scale, base, norm_weight,
                                                                 *_tensors(expand or ())))):
        from model.kernels import streams as kernel

        beside = (overlap and streams.is_cuda and torch.cuda.is_current_stream_capturing()
                  and os.environ.get("DSAGENT_MHC_OVERLAP", "1") != "0")
        later = norm_later and kernel.NORM_LATER
        dots_beside = (beside and later and kernel.DOTS_BESIDE in (True, name)
                       and streams.shape[-1] <= kernel.DOTS_BESIDE_MAX_D)
        site = functools.partial(kernel.hc_site, overlap=beside, norm_later=later, dots_beside=dots_beside)
        out = _guarded("mHC site kernel", site, hc_site_parts, *args)
        if isinstance(out[4], tuple):  # the dots beside: x left to its reader
            out = (*out[:4], Collapsed(*out[4], out[0], hc_collapse))
        return (*out, later and "mHC site kernel" not in _FAILED) if norm_later else out
    out = hc_site_parts(*args)
    return (*out, False) if norm_later else out


def mhc_join() -> None:
    """Make the current stream wait for the mHC splits :func:`hc_site` ran on a side stream
    (``overlap``); nothing when none is pending."""
    kernel = sys.modules.get("model.kernels.streams")  # loaded once a site kernel ran
    if kernel is not None:
        kernel.join()


def mhc_forget() -> None:
    """Drop the pending side-stream splits unjoined: a capture that failed never ran them,
    and its streams are not to be waited on (the caller then runs the step eagerly)."""
    kernel = sys.modules.get("model.kernels.streams")
    if kernel is not None:
        kernel.forget()


def hc_site_parts(streams, pre, fn, scale, base, norm_weight, eps, norm_eps, iters, hc_eps, expand=None):
    """:func:`hc_site` as its parts: ``hc_expand``, ``rms_norm`` and a linear layer (on CUDA's bf16
    streams ``products.normed_linear``: bf16 GEMMs, the norm a factor after them), ``hc_split``,
    ``hc_collapse``, ``rms_norm`` — each its own kernel or twin (the model's maths)."""
    if expand is not None:
        streams = hc_expand(expand[0], streams, expand[1], expand[2])
    flat = streams.flatten(-2)
    if products.runs(flat, fn):  # CUDA: tensor-core GEMMs, the norm a factor after them
        mixes = products.normed_linear(flat, fn, eps)
    else:
        mixes = torch.nn.functional.linear(rms_norm(flat, None, eps, upcast=True), fn.float())
    site_pre, post, comb = hc_split(mixes, scale, base, streams.shape[-2], iters, hc_eps)
    return streams, site_pre, post, comb, rms_norm(hc_collapse(streams, pre), norm_weight, norm_eps)


_FAILED: dict[str, str] = {}  # fast path -> the error it failed with in this process


def _tensors(items) -> tuple[torch.Tensor, ...]:
    return tuple(t for t in items if isinstance(t, torch.Tensor))


def _wants_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _kernel_runs(path: str, x: torch.Tensor, grads: tuple[torch.Tensor, ...] = ()) -> bool:
    """Whether ``path``'s kernel runs on ``x``: :func:`enabled` there, not failed in this
    process, and no gradient wanted through ``grads`` (the kernels have no backward)."""
    return enabled(x) and path not in _FAILED and not _wants_grad(*grads)


def ngram_hash(compressed: torch.Tensor, history: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor,
               offsets: torch.Tensor, pad: int, dead: int) -> torch.Tensor:
    """The Engram rows of the n-grams ending at each token (see :func:`ngram_hash_ref`): one
    kernel (``model.kernels.engram``) where :func:`enabled`, in place of ~20 small torch
    launches a decode step; else the twin. Integers: equal either way."""
    return _kernel_or_twin("Engram hash kernel", "engram.ngram_hash", ngram_hash_ref, compressed, history,
                           multipliers, primes, offsets, pad, dead, grads=())


def engram_step(ids: torch.Tensor, token_map: torch.Tensor, ring_ids: torch.Tensor, ring_pos: torch.Tensor,
                start: int, multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor, pad: int,
                dead: int) -> torch.Tensor | None:
    """A decode step's Engram rows [B, 1, L, cols] and the look-back ring's write in one launch
    (``model.kernels.engram.engram_step``) where :func:`enabled` on one new token a row; None
    where it does not run (or cannot be built: warned once), and the ring untouched — the
    caller then runs the compress, look-back, :func:`ngram_hash` and record itself."""
    if ids.dim() != 2 or ids.shape[1] != 1 or ring_pos.shape[0] < multipliers.shape[1] \
            or not _kernel_runs("Engram step kernel", ids):
        return None
    from model.kernels import engram

    return _guarded("Engram step kernel", lambda _: engram.engram_step(ids, token_map, ring_ids, ring_pos, start,
                                                                       multipliers, primes, offsets, pad, dead),
                    lambda _: None, ids)


def _kernel_or_twin(path: str, kernel: str, twin, x: torch.Tensor, *args, grads: tuple[torch.Tensor, ...],
                    function: type[torch.autograd.Function] | None = None):
    """``kernel`` ("module.function" under ``model.kernels``, imported on first use: it needs
    Triton) on ``(x, *args)`` where :func:`_kernel_runs`, guarded; else ``twin(x, *args)``.
    With a gradient wanted through ``grads`` and a ``function`` (``model.kernels.backward``)
    given, that function runs, its forward this same choice made without autograd."""
    if function is not None and _wants_grad(*grads):
        return function.apply(functools.partial(_kernel_or_twin, path, kernel, twin, grads=()), x, *args)
    if _kernel_runs(path, x, grads=grads):
        module, name = kernel.split(".")
        return _guarded(path, getattr(importlib.import_module(f"model.kernels.{module}"), name), twin, x, *args)
    return twin(x, *args)


def _guarded(path: str, fn, twin, x: torch.Tensor, *args):
    """``fn(x, *args)``; if it cannot be built or launched here, a warning and ``twin`` (the
    same function in PyTorch) for the rest of the process, rather than a failed session."""
    try:
        return fn(x, *args)
    except Exception as e:  # a Triton / inductor build or launch error
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise
        _FAILED[path] = f"{type(e).__name__}: {e}"
        warnings.warn(f"the {path} path failed ({_FAILED[path][:200]}); using the PyTorch twin",
                      RuntimeWarning, stacklevel=3)
        return twin(x, *args)


@functools.cache
def _compiled_twin():
    return torch.compile(hc_split_ref, dynamic=True)


def pack_window(x: torch.Tensor) -> torch.Tensor:
    """FP8 window rows [..., D + D/32] bytes: the kernel where :func:`enabled`, else ``model.blockfp``."""
    return _pack("pack_window", x)


def pack_main(x: torch.Tensor) -> torch.Tensor:
    """FP4 main records [..., D/2 + D/16] bytes: the kernel where :func:`enabled`, else ``model.blockfp``."""
    return _pack("pack_main", x)


def pack_index(x: torch.Tensor) -> torch.Tensor:
    """FP4 index keys [..., d/2 + d/32] bytes: the kernel where :func:`enabled`, else ``model.blockfp``."""
    return _pack("pack_index", x)


def pack_window_at(kv: torch.Tensor, data: torch.Tensor, ring_pos: torch.Tensor, pos: torch.Tensor) -> bool:
    """One decode step's window write in one launch: ``data[:, p % cap] = pack_window(kv[:, 0])``
    and ``ring_pos[p % cap] = p`` for ``pos`` = [p], a device tensor. True where the kernel
    ran (:func:`enabled`, rows the pack kernel takes); False, and nothing written, where it
    does not or cannot be built: the caller writes in torch (``WindowRing.write``, its
    twin: the remainder, the pack, two scatters), the same bytes."""
    if not (blockfp.pow2_blocks(kv.shape[-1], blockfp.WINDOW_BLOCK) and _kernel_runs("pack_window", kv)):
        return False
    from model.kernels import pack

    return _guarded("pack_window", lambda t: pack.pack_window_at(t, data, ring_pos, pos) or True, lambda t: False, kv)


def window_entry(kv: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                 data: torch.Tensor, ring_pos: torch.Tensor, pos: torch.Tensor) -> bool:
    """One decode step's window entry made and written in one launch, from its K=V latent
    ``kv`` [B, 1, D]: ``pack_window_at(fake_quant_fp8(rope(rms_norm(kv, norm_weight, eps), cos,
    sin)), data, ring_pos, pos)`` (``model.decode_step``), where torch's kernels or ours
    took four. True where the kernel ran (:func:`enabled`, rows the pack kernel takes);
    False, and nothing written, where it does not or cannot be built: the caller runs the
    four. Its norm agrees with :func:`rms_norm`'s to rounding; the rest as the four round."""
    if not (blockfp.pow2_blocks(kv.shape[-1], blockfp.WINDOW_BLOCK) and _kernel_runs("window entry", kv)
            and kv.dtype in (torch.float32, torch.bfloat16) and norm_weight.dtype == kv.dtype):
        return False
    from model.kernels import pack

    return _guarded("window entry", lambda t: pack.window_entry(t, norm_weight, eps, cos, sin, data, ring_pos, pos)
                    or True, lambda t: False, kv)


def compress_step(x: torch.Tensor, weights: tuple, norm: tuple, hist: tuple, records: torch.Tensor,
                  index: torch.Tensor, wk: torch.Tensor, k_norm: tuple, inv_freq: torch.Tensor, pos: torch.Tensor,
                  ratio: int, emit: bool) -> bool:
    """A KV source's compressor in one decode step at ``pos`` [1] on ``x`` [B, 1, D], written
    into the source's buffers (``model.decode_step``): its projections by ``weights`` —
    (wkv,) at ratio 1, fp32 (wkv, wgate) of ``x.float()`` above — in one GEMV launch; at ratio >
    1 kept in the history ring ``hist`` = (hist_kv, hist_gate, hist_pos); when ``emit`` (its
    group completes) the group's latent pooled and normalised by ``norm`` = (weight, eps), its
    record (RoPE by ``inv_freq`` at the group's first position, FP4) into ``records``, and its
    index key (``wk``, ``k_norm``, RoPE, FP4) into ``index`` — four launches in all
    (``model.kernels.pack``'s ``compress_step``, the GEMV, ``index_entry``) where torch took ~30.
    True where they ran; False, and nothing written, where they do not (the caller runs
    ``decode_step.compressor_step`` and the packs, its twin). The pool's exp, the norms' sums and the GEMVs'
    orders agree with torch's to rounding, so a record's bytes may differ where a value sits
    on an FP4 boundary."""
    if not (_kernel_runs("compressor step", x) and 1 <= ratio <= 16 and records.dtype == index.dtype == torch.uint8
            and x.shape[1] == 1 and gemv_runs(x)):
        return False
    from model.kernels import pack

    if not pack.COMPRESS_STEP:
        return False

    def run(x):
        kv, *gate = gemv(x if ratio == 1 else x.float(), *weights)
        latent = pack.compress_step(kv, gate[0] if gate else None, hist, pos, *norm, inv_freq, records, ratio, emit)
        if latent is not None:
            pack.index_entry(gemv(latent, wk)[0], *k_norm, inv_freq, index, pos, ratio)
        return True

    return _guarded("compressor step", run, lambda t: False, x)


def fake_quant_fp8(x: torch.Tensor, block: int = blockfp.WINDOW_BLOCK) -> torch.Tensor:
    """FP8 values as the window stores them (:func:`model.blockfp.fake_quant_fp8`): one kernel
    where :func:`enabled`, no gradient is wanted and the rows suit it (:func:`pow2_blocks`),
    else the twin; bit-exact either way."""
    if not blockfp.pow2_blocks(x.shape[-1], block):
        return blockfp.fake_quant_fp8(x, block)
    return _kernel_or_twin("FP8 values", "pack.fake_quant_fp8", blockfp.fake_quant_fp8, x, block, grads=(x,))


def fake_quant_fp4(x: torch.Tensor, block: int, e4m3_scales: bool = False) -> torch.Tensor:
    """FP4 values as records / index keys / QAT weights store them
    (:func:`model.blockfp.fake_quant_fp4`): one kernel where :func:`enabled`, no gradient is
    wanted and the rows suit it (:func:`pow2_blocks`), else the twin; bit-exact."""
    if not blockfp.pow2_blocks(x.shape[-1], block):
        return blockfp.fake_quant_fp4(x, block, e4m3_scales)
    return _kernel_or_twin("FP4 values", "pack.fake_quant_fp4", blockfp.fake_quant_fp4, x, block, e4m3_scales,
                           grads=(x,))


def _pack(name: str, x: torch.Tensor) -> torch.Tensor:
    return _kernel_or_twin(name, f"pack.{name}", getattr(blockfp, name), x, grads=())  # bytes: no gradient either way
