"""The linear family: every projection of the network, by weight format and parallel split.

A :class:`Linear` is the one place a projection's kernel is chosen. It is an ``nn.Linear``
(its ``weight`` keeps the checkpoint's name, so loading stays a name-for-name copy) that
also knows two things:

- its **format** — ``plain`` (a float weight), ``fp8`` (e4m3 bytes plus one ue8m0 scale per
  ``block`` x ``block`` tile, the checkpoint's ``X.scale``) or ``fp4`` (two e2m1 values a
  byte, even index in the low nibble, plus one ue8m0 scale per 1 x 32). Packed weights are
  held as the checkpoint stores them, the same bytes;
- its **split** over a :class:`World` — ``None`` (every rank holds all of it), ``column``
  (the output features split: each rank makes its slice), ``row`` (the input features
  split: each rank multiplies its slice and the ranks' partial outputs are summed) or
  ``vocab`` (an embedding's or head's rows split, like ``column``).

``forward`` picks the computation by device, format and row count: on a decode step's few
rows the GEMV kernel (``model.kernels.gemv``, where it runs; a packed weight as stored,
:meth:`Linear.gemv_weight`, dequantised in the kernel's registers); on a prefill's rows a
packed weight's GEMM on tensor cores, decoding its bytes the same way
(``model.kernels.packed_matmul``); else the PyTorch twin — the weight dequantised
(:meth:`Linear.dense_weight`), then ``F.linear``. A
new format or kernel plugs in here and nowhere else. :func:`grouped_linear` is the grouped
output projection of the attention (``wo_a``), the same choice.

:class:`Table` is the same for a lookup table (the Engram tables, FP8 by rows).

Does not own: where the projections sit in the network (``model.block``, ``model.csa2``,
``model.moe``), the checkpoint's name families (``model.checkpoint``), nor the process
groups' creation (the caller's ``torch.distributed.init_process_group``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model import kernels
from model.blockfp import dequantize_fp8_weight, quantize_fp8_weight
from model.checkpoint import dequantize_tensor, fp8_scale_block, quantize_fp4, quantize_fp8_rows

FORMATS = ("plain", "fp8", "fp4")
SPLITS = (None, "column", "row", "vocab")
FP8_BLOCK = 32  # V4.1's weight_block_size [32, 32]
FP4_BLOCK = 32  # one ue8m0 scale per 32 inputs


@dataclass(frozen=True)
class World:
    """Where this process sits among the ranks that share the model (tensor parallel =
    expert parallel = ``size``): ``group`` is a ``torch.distributed`` group, None for the
    default one. ``World()`` is one process alone; ``World(0, 1, group)`` one process whose
    sums still go through the group's collectives."""
    rank: int = 0
    size: int = 1
    group: object = None

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in a world of {self.size}")

    def part(self, n: int, what: str) -> slice:
        """This rank's contiguous share of ``n`` items (``what`` names them for the error)."""
        if n % self.size:
            raise ValueError(f"{what}: {n} do not split evenly over {self.size} ranks")
        share = n // self.size
        return slice(self.rank * share, (self.rank + 1) * share)

    def span(self, n: int) -> slice:
        """This rank's contiguous share of ``n`` rows where they need not split evenly: ranks
        hold ceil(n / size) rows each, the last what is left (a table's rows)."""
        step = -(-n // self.size)
        return slice(min(n, self.rank * step), min(n, (self.rank + 1) * step))

    def share(self, n: int, what: str) -> int:
        """How many of ``n`` items this rank holds (:meth:`part`'s length)."""
        part = self.part(n, what)
        return part.stop - part.start

    @property
    def joined(self) -> bool:
        """Whether its sums are collectives: several ranks, or one in a group of its own (the
        check that a step's collectives capture in its CUDA graph on one GPU)."""
        return self.size > 1 or self.group is not None

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """The ranks' ``t`` summed, in place (one all-reduce); ``t`` itself alone."""
        if self.joined:
            import torch.distributed as dist

            dist.all_reduce(t, group=self.group)
        return t

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """The ranks' slices of ``t``'s last dim side by side, in rank order."""
        if self.size == 1:
            return t
        import torch.distributed as dist

        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


ALONE = World()


class Stored(nn.Module):
    """A module whose weight may be held as the checkpoint stores it (``fmt`` not ``plain``)."""

    fmt = "plain"

    def _apply(self, fn, recurse=True):
        """A move keeps the stored bytes' dtypes: ``model.to(torch.bfloat16)`` casts the float
        weights, never a packed weight or its scales (a float8 tensor is a float to torch)."""
        if self.fmt == "plain":
            return super()._apply(fn, recurse)
        kept = {name: p.dtype for name, p in self._parameters.items() if p is not None}
        super()._apply(fn, recurse)
        for name, p in self._parameters.items():
            if p is not None and p.dtype != kept[name]:
                p.data = p.data.to(kept[name])  # exact: e4m3 and e8m0 values are all bf16 / fp32 values
        return self


class Linear(Stored, nn.Linear):
    """``y = x @ W.T`` of a weight in one of :data:`FORMATS`, split as one of :data:`SPLITS`
    over ``world``. ``in_features`` / ``out_features`` are the whole layer's; the weight is
    this rank's part. No bias: the network has none. A row split's partial products are
    summed over the world (one all-reduce), unless ``sums`` is False: its caller adds them
    with its own (the MoE's shared expert, in the routed experts' all-reduce)."""

    def __init__(self, in_features: int, out_features: int, *, fmt: str = "plain", split: str | None = None,
                 world: World = ALONE, block: int = FP8_BLOCK, gemv: bool = True, sums: bool = True, device=None,
                 dtype=None):
        if fmt not in FORMATS or split not in SPLITS:
            raise ValueError(f"a Linear is one of {FORMATS} x {SPLITS}, not ({fmt!r}, {split!r})")
        local_in = world.share(in_features, "input features") if split == "row" else in_features
        local_out = world.share(out_features, "output features") if split in ("column", "vocab") else out_features
        super().__init__(local_in, local_out, bias=False, device=device, dtype=dtype)
        self.fmt, self.split, self.world, self.block = "plain", split, world, block
        self.full_in, self.full_out = in_features, out_features
        self.gemv = gemv  # False: a plain weight never by the GEMV kernel (cuBLAS's GEMM on few rows too)
        self.sums = sums
        if fmt != "plain":
            self.pack(fmt)

    def pack(self, fmt: str) -> None:
        """Hold the weight in ``fmt`` from now on, as the checkpoint stores it: quantised from the
        float weight held now (bit for bit the checkpoint writer's bytes), or, on the meta
        device, the stored tensors' shapes for a load to fill."""
        if fmt not in FORMATS[1:] or self.fmt != "plain":
            raise ValueError(f"a plain Linear packs to one of {FORMATS[1:]}, not {self.fmt!r} -> {fmt!r}")
        w = self.weight.detach()
        if w.is_meta:
            weight, scale = _stored_shapes(fmt, w.shape, self.block)
        else:
            weight, scale = quantize_fp8_weight(w, self.block) if fmt == "fp8" else quantize_fp4(w)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)
        self.fmt = fmt

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as floats of ``dtype``: a plain one as it is (cast where it differs), a
        packed one dequantised exactly as ``model.checkpoint`` dequantises it."""
        if self.fmt == "plain":
            w = self.weight  # read once: under training's QAT each read computes it
            return w if w.dtype == dtype else w.to(dtype)
        return dequantize_tensor(self.fmt, self.weight, self.scale, (self.out_features, self.in_features),
                                 block=self.block, dtype=dtype)

    def gemv_weight(self) -> torch.Tensor | kernels.Packed:
        """The weight as ``kernels.gemv`` takes it: a plain one itself, a packed one its stored
        bytes and scales (``kernels.Packed``), which the kernel dequantises in registers."""
        if self.fmt == "plain":
            return self.weight
        return kernels.Packed(self.weight, self.scale, self.fmt, self._scale_block(), self.in_features,
                              self.dense_weight)

    def _scale_block(self) -> tuple[int, int] | None:
        """(rows, inputs) one scale of the packed weight covers (FP4: 1 x 32; FP8: the block the
        checkpoint's shapes imply), None where they name none."""
        if self.fmt == "fp4":
            return (1, FP4_BLOCK) if -(-self.in_features // FP4_BLOCK) == self.scale.shape[1] else None
        return fp8_scale_block(self.weight.shape, self.scale.shape, self.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a decode step's few rows; a packed weight's always (the twin would dequantise all of it a step:
        # the Engram projections of `small`, ~1.2 ms of a 6 ms step on the H200, 2026-12-05)
        if (self.gemv or self.fmt != "plain") and kernels.gemv_runs(x, self):
            y = kernels.gemv(x, self.gemv_weight())[0]
        elif self.fmt != "plain" and kernels.packed_gemm_runs(x, packed := self.gemv_weight()):
            y = kernels.packed_matmul(x, packed)  # a prefill's rows: the bytes decoded in registers
        else:
            y = F.linear(x, self.dense_weight(x.dtype))
        return self.world.sum(y) if self.split == "row" and self.sums else y

    def extra_repr(self) -> str:
        split = "" if self.split is None else f", split={self.split} over {self.world.size}"
        return f"in_features={self.full_in}, out_features={self.full_out}, fmt={self.fmt}{split}"


class Table(Stored):
    """A lookup table of ``rows`` x ``dim`` (the Engram tables): float rows, or rows held as the
    checkpoint stores them (``fp8``: e4m3 bytes with one ue8m0 scale per 1 x ``block``), each
    gathered row dequantised as it is read.

    Where it is kept:

    - on the model's device, over a ``world`` a contiguous range of the rows a rank
      (:meth:`World.span`: the tables' prime-sum row counts rarely split evenly); ids outside
      it give zeros and the ranks' rows are summed (one all-reduce), which adds only zeros to
      each row, so the rows are the same bits at any world size;
    - ``host``: whole, in host memory, at any world size — a move of the model to a device or
      a cast of a plain table leaves it there (a table read from a checkpoint's shard is the
      shard's memory map: one copy in the page cache, whichever ranks map it). Its rows are
      gathered on the host and copied to the device the ids are on (:meth:`fetch`)."""

    def __init__(self, rows: int, dim: int, block: int = FP8_BLOCK, world: World = ALONE, host: bool = False):
        super().__init__()
        world = ALONE if host else world
        self.world, self.rows, self.full_rows, self.host = world, world.span(rows), rows, host
        if self.rows.start == self.rows.stop:
            raise ValueError(f"a table of {rows} rows leaves rank {world.rank} of {world.size} none")
        where = "meta" if host and torch.empty(0).is_meta else "cpu" if host else None
        self.weight = nn.Parameter(torch.empty(self.rows.stop - self.rows.start, dim, device=where))
        self.fmt, self.block = "plain", block

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.host and ids.device != self.weight.device:
            return self.ready(self.fetch(ids))
        if self.world.size == 1:
            return self._gather(ids)
        mine = (ids >= self.rows.start) & (ids < self.rows.stop)
        out = self._gather(torch.where(mine, ids - self.rows.start, 0))
        return self.world.sum(torch.where(mine.unsqueeze(-1), out, 0))

    def fetch(self, ids: torch.Tensor) -> torch.Tensor | kernels.Beside:
        """The rows of ``ids`` (on any device) from a table held in host memory: gathered on
        the host as stored (a packed row is its bytes and scales, 264 B a V4.1 row), copied to
        ``ids``' device and dequantised there. On CUDA the copy runs on a side stream from
        pinned memory and this returns the ``kernels.Beside`` to join where the rows are read,
        so a step that fetches before its first layer overlaps the copy with the layers before."""
        host_ids = ids.cpu()  # a device's ids are waited for here: the one sync of a fetch
        stored = (F.embedding(host_ids, self.weight),) if self.fmt == "plain" else \
            (self.weight[host_ids], self.scale[host_ids])
        if not ids.is_cuda:
            return self._rows(*(t.to(ids.device) for t in stored))
        pinned = tuple(t.pin_memory() for t in stored)
        return kernels.Beside(lambda *ts: self._rows(*(t.to(ids.device, non_blocking=True) for t in ts)), *pinned,
                              device=ids.device)

    @staticmethod
    def ready(rows: torch.Tensor | kernels.Beside) -> torch.Tensor:
        """:meth:`fetch`'s rows, the current stream made to wait for their copy where it ran beside."""
        return rows.value() if isinstance(rows, kernels.Beside) else rows

    def _gather(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows ``ids`` (of this rank's range, on the table's device) as floats."""
        if self.fmt == "plain":
            return F.embedding(ids, self.weight)
        return self._rows(self.weight[ids], self.scale[ids])

    def _rows(self, rows: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """Gathered rows as floats: plain ones as they are, packed ones (``[..., dim]`` bytes,
        ``[..., dim / block]`` scales) dequantised."""
        if scale is None:
            return rows
        flat = dequantize_fp8_weight(rows.reshape(-1, rows.shape[-1]), scale.reshape(-1, scale.shape[-1]),
                                     (1, self.block))
        return flat.view(*rows.shape[:-1], -1)

    def _apply(self, fn, recurse=True):
        """A table held in host memory stays there: of a move or cast only its dtype is taken
        (a plain table's; packed bytes keep theirs), and ``to_empty`` / a move to meta."""
        if not self.host:
            return super()._apply(fn, recurse)
        for name, p in self._parameters.items():
            probe = fn(torch.empty(0, dtype=p.dtype))  # what the move or cast makes of a tensor
            dtype = probe.dtype if self.fmt == "plain" else p.dtype
            if probe.is_meta or p.is_meta:
                data = torch.empty(p.shape, dtype=dtype, device="meta" if probe.is_meta else "cpu")
            else:
                data = p.data.to(dtype)
            self._parameters[name] = nn.Parameter(data, requires_grad=p.requires_grad)
        return self

    def pack(self, fmt: str) -> None:
        """Rows held in ``fmt`` (only ``fp8``): quantised from the float rows (the checkpoint
        writer's bytes), or on the meta device the stored shapes."""
        if fmt != "fp8" or self.fmt != "plain":
            raise ValueError(f"a plain Table packs to fp8 rows, not {self.fmt!r} -> {fmt!r}")
        w = self.weight.detach()
        rows, dim = w.shape
        if w.is_meta:
            weight = torch.empty(rows, dim, dtype=torch.float8_e4m3fn, device="meta")
            scale = torch.empty(rows, -(-dim // self.block), dtype=torch.float8_e8m0fnu, device="meta")
        else:
            weight, scale = quantize_fp8_rows(w, self.block)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)
        self.fmt = fmt


class VocabEmbedding(nn.Embedding):
    """The token embedding over a ``world``: a rank holds the rows of its share of the
    vocabulary; ids outside it give zeros, and the ranks' lookups are summed (one all-reduce)."""

    def __init__(self, rows: int, dim: int, world: World):
        self.world, self.rows = world, world.part(rows, "vocab_size")
        super().__init__(self.rows.stop - self.rows.start, dim, _weight=torch.empty(self.rows.stop - self.rows.start, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.rows.start) & (ids < self.rows.stop)
        out = F.embedding(torch.where(mine, ids - self.rows.start, 0), self.weight) * mine.unsqueeze(-1)
        return self.world.sum(out)


def _stored_shapes(fmt: str, shape: torch.Size, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty stored tensors (meta) of a weight of ``shape`` in ``fmt``."""
    out_f, in_f = shape
    if fmt == "fp8":
        return (torch.empty(out_f, in_f, dtype=torch.float8_e4m3fn, device="meta"),
                torch.empty(-(-out_f // block), -(-in_f // block), dtype=torch.float8_e8m0fnu, device="meta"))
    return (torch.empty(out_f, -(-in_f // 2), dtype=torch.int8, device="meta"),
            torch.empty(out_f, -(-in_f // FP4_BLOCK), dtype=torch.float8_e8m0fnu, device="meta"))


def grouped_linear(layer: nn.Linear, x: torch.Tensor, groups: int) -> torch.Tensor:
    """The grouped projection of ``x`` [..., groups * i] by ``layer`` [groups * o, i]: group g
    of the output reads only group g of the input (the attention's ``wo_a``). -> [..., groups * o]."""
    if kernels.gemv_runs(x, layer):
        return kernels.gemv(x, layer.gemv_weight() if isinstance(layer, Linear) else layer.weight, groups=groups)[0]
    if (getattr(layer, "fmt", "plain") != "plain" and layer.out_features // groups % 16 == 0
            and kernels.packed_gemm_runs(x, packed := layer.gemv_weight())):
        return kernels.packed_matmul(x, packed, groups=groups)
    weight = layer.dense_weight(x.dtype) if isinstance(layer, Linear) else layer.weight
    return kernels.gemv_ref(x, weight, groups=groups)[0]


def shard(full: torch.Tensor, layer: Linear) -> torch.Tensor:
    """This rank's part of a whole layer's float weight ``full`` [out, in] (a loader's slice)."""
    if layer.split == "row":
        return full[:, layer.world.part(full.shape[1], "input features")]
    if layer.split in ("column", "vocab"):
        return full[layer.world.part(full.shape[0], "output features")]
    return full
