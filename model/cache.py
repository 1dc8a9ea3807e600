"""The explicit inference cache passed to ``Transformer.forward``: packed bytes, not floats.

Owns, for a batch of rows that share positions:
- per layer, a window ring of FP8 records (528 B/token at head_dim 512), slot = pos % cap;
- per KV-source layer, the global KV: FP4 main records (288 B) and FP4 index keys (68 B),
  plus the compressor's pending projections (tokens of an unfinished group);
- the Engram look-back (compressed ids of recent positions).

Everything is keyed by absolute position, so replaying positions that the cache already
covers (bounded-replay prefill, resume) rewrites windows but never duplicates records.

``state()`` / ``from_state()`` export named uint8/float tensors plus JSON-able metadata,
split into the *global* part (what the session store keeps on disk) and the *local* part
(what lives in the RAM pool). Does not own the maths that fills it (``model.model``) nor
storage (``sessions``).
"""
from __future__ import annotations

import torch

from model import kernels
from model.args import ModelArgs
from model.engram import DEAD
from model.quant import KVFormat

FORMAT_VERSION = 2


class CacheFormatError(ValueError):
    """State made by another config or format version, or malformed state."""


class WindowRing:
    """FP8 window entries of one layer for the last ``cap`` positions."""

    def __init__(self, batch: int, cap: int, dim: int, device, kv: KVFormat = KVFormat.PACKED):
        self.dim, self.kv = dim, kv
        width, dtype = kv.window_row(dim)
        self.data = torch.zeros(batch, cap, width, dtype=dtype, device=device)
        self.pos = torch.full((cap,), -1, dtype=torch.long, device=device)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(entries [B, cap, D] fp32, positions [cap]; -1 marks an empty slot)."""
        return self.kv.unpack_window(self.data, self.dim), self.pos

    def before(self, start: int, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the slots of positions [start - span, start) in order, their positions; -1 where the
        slot holds another position: replayed, stale or never written)."""
        wanted = start - span + torch.arange(span, device=self.pos.device)
        slots = wanted % self.pos.shape[0]
        return slots, torch.where(self.pos[slots] == wanted, wanted, -1)

    def write(self, kv: torch.Tensor, positions: torch.Tensor) -> None:
        cap = self.pos.shape[0]
        self.write_packed(self.kv.pack_window(kv[:, -cap:]), positions)

    def write_packed(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """:meth:`write` of entries already packed as the ring holds them."""
        cap = self.pos.shape[0]
        rows, positions = rows[:, -cap:], positions[-cap:]
        slots = positions % cap
        self.data[:, slots] = rows
        self.pos[slots] = positions

    def write_step(self, kv: torch.Tensor, position: torch.Tensor) -> None:
        """:meth:`write` of one decode step's entries [B, 1, D] at ``position`` ([1], a device
        tensor): on a packed ring one kernel packs them into their slot where the kernels run."""
        if not (self.kv.packed and kernels.pack_window_at(kv, self.data, self.pos, position)):
            self.write(kv, position)

    def truncate(self, length: int) -> None:
        self.pos[self.pos >= length] = -1


class SourceKV:
    """Global KV of one KV-source layer: packed records + index keys, and pending tokens."""

    def __init__(self, batch: int, ratio: int, dim: int, index_dim: int, device, spare: int = 16,
                 kv: KVFormat = KVFormat.PACKED):
        self.ratio, self.dim, self.index_dim, self.kv = ratio, dim, index_dim, kv
        self.n = 0
        # projections of the newest tokens, so a rollback can rebuild the pending group
        hist = ratio + spare if ratio > 1 else 0
        self.hist_kv = torch.zeros(batch, hist, dim, device=device)
        self.hist_gate = torch.zeros(batch, hist, dim, device=device)
        self.hist_pos = torch.full((hist,), -1, dtype=torch.long, device=device)
        (rec_w, rec_t), (idx_w, idx_t) = kv.main_row(dim), kv.index_row(index_dim)
        self.records = torch.zeros(batch, 16, rec_w, dtype=rec_t, device=device)
        self.index = torch.zeros(batch, 16, idx_w, dtype=idx_t, device=device)
        empty = torch.zeros(batch, 0, dim, device=device)
        self.set_pending(empty, empty.clone())

    @property
    def covered(self) -> int:
        """Tokens whose records exist (excludes pending tokens)."""
        return self.n * self.ratio

    @property
    def done(self) -> int:
        """Tokens consumed by the compressor: covered + pending."""
        return self.covered + self.pending_n

    # the pending group's projections: a pair of tensors, or None after a decode step on
    # the fixed buffers (:meth:`stepped`), when the history ring holds them
    @property
    def pending_kv(self) -> torch.Tensor:
        return self._pending_pair()[0]

    @property
    def pending_gate(self) -> torch.Tensor:
        return self._pending_pair()[1]

    def set_pending(self, kv: torch.Tensor, gate: torch.Tensor) -> None:
        self._pending, self.pending_n = (kv, gate), kv.shape[1]

    def _pending_pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._pending is None:
            self._pending = self._from_history(self.covered, self.done)
        return self._pending

    def _from_history(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The remembered projections of tokens [lo, hi)."""
        wanted = torch.arange(lo, hi, device=self.hist_pos.device)
        if wanted.numel() == 0:
            return self.hist_kv[:, :0], self.hist_gate[:, :0]
        assert bool((self.hist_pos[wanted % self.hist_pos.shape[0]] == wanted).all()), \
            "rollback deeper than the projection history"
        return self.recall(wanted)

    def _grow(self, need: int, fresh: bool = False) -> None:
        """Room for ``need`` records: a quarter more than now at least. A decode step reads the
        whole buffers (its index scores and top-k run over them, so a CUDA graph can hold
        them), so they stay close to their count; each growth is a copy and a recapture.
        ``fresh``: new buffers of ``need`` records even where these hold them — records that
        carry gradients (training) are never written into a buffer that autograd may have
        saved, as a gather over :meth:`view` does."""
        cap = self.records.shape[1]
        if need <= cap and not fresh:
            return
        new = need if fresh else max(need, cap + cap // 4)
        for name in ("records", "index"):
            old = getattr(self, name)
            grown = old.new_zeros(old.shape[0], new, old.shape[2])
            grown[:, : self.n] = old[:, : self.n]
            setattr(self, name, grown)

    def append(self, records: torch.Tensor, index: torch.Tensor) -> None:
        """Append rows made by the format's ``pack_main`` / ``pack_index`` ([B, G, 288] / [B, G, 68] packed)."""
        g = records.shape[1]
        self._grow(self.n + g, fresh=records.requires_grad or index.requires_grad or self.records.requires_grad)
        self.records[:, self.n: self.n + g] = records
        self.index[:, self.n: self.n + g] = index
        self.n += g

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.records[:, : self.n], self.index[:, : self.n]

    def remember(self, kv: torch.Tensor, gate: torch.Tensor, start: int) -> None:
        """Keep the projections of tokens [start, start + S) for :meth:`truncate`."""
        cap = self.hist_pos.shape[0]
        if cap == 0:
            return
        self._pending_pair()  # after a decode step the ring holds the pending group: take it out first
        positions = torch.arange(start, start + kv.shape[1], device=kv.device)[-cap:]
        self.remember_at(kv[:, -cap:], gate[:, -cap:], positions)

    def truncate(self, length: int) -> None:
        """Forget tokens >= ``length``: drop their records and rebuild the pending group."""
        if length >= self.done:
            return
        self.n = min(self.n, length // self.ratio)
        self.set_pending(*self._from_history(self.covered, length))

    # ------------------------------------------------------------------ decode steps on fixed buffers
    # A decode step's position is a tensor here, so its cache work can replay as a CUDA graph;
    # the host keeps the counts (``reserve`` before the step, ``stepped`` after it).
    def reserve(self, position: int) -> None:
        """Room for the records of every token up to ``position``; asserts that the source
        has consumed every earlier position (what a decode step continues from)."""
        assert self.done == position, f"a decode step at {position} on a source that consumed {self.done}"
        self._grow((position + 1) // self.ratio)

    def remember_at(self, kv: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor) -> None:
        """Write the projections [B, len, D] of ``positions`` (a tensor, at most the ring's
        length) into the history ring: :meth:`remember`'s write, and a decode step's."""
        slots = positions % self.hist_pos.shape[0]
        self.hist_kv[:, slots], self.hist_gate[:, slots] = kv, gate
        self.hist_pos[slots] = positions

    def recall(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The remembered projections [B, len, D] of ``positions`` (a tensor; unchecked)."""
        slots = positions % self.hist_pos.shape[0]
        return self.hist_kv[:, slots], self.hist_gate[:, slots]

    def write_at(self, slot: torch.Tensor, records: torch.Tensor, index: torch.Tensor) -> None:
        """Write one record and its index key ([B, 1, width] packed) at ``slot`` [1]."""
        self.records[:, slot], self.index[:, slot] = records, index

    def stepped(self, position: int) -> None:
        """Count the decode step at ``position``: its record (if its group completed) and
        its pending projection (left in the history ring) are in the buffers."""
        done = position + 1
        self.n = done // self.ratio
        self._pending, self.pending_n = None, done - self.covered


class Cache:
    """All inference state of a batch of sequences that share positions."""

    def __init__(self, args: ModelArgs, batch: int = 1, device="cpu", spare: int = 16,
                 kv: KVFormat = KVFormat.PACKED):
        self.args, self.batch, self.device = args, batch, torch.device(device)
        self.spare, self.kv = spare, kv
        self.length = 0  # positions consumed: the next new token is at this position
        cap = args.sliding_window + spare  # spare slots let speculation roll back
        self.windows = [WindowRing(batch, cap, args.head_dim, self.device, kv) for _ in range(args.num_hidden_layers)]
        self.sources = {s: SourceKV(batch, args.ratios[s], args.head_dim, args.index_head_dim, self.device, spare, kv)
                        for s in args.kv_source_layer_ids}
        hist = cap + args.engram_max_ngram_size
        self.engram_ids = torch.full((batch, hist), DEAD, dtype=torch.long, device=self.device)
        self.engram_pos = torch.full((hist,), -1, dtype=torch.long, device=self.device)

    # ------------------------------------------------------------------ engram look-back
    def engram_history(self, start: int, n: int) -> torch.Tensor:
        """Compressed ids at positions [start-n, start) ([B, n], oldest first; DEAD if unknown)."""
        wanted = torch.arange(start - n, start, device=self.device)
        slots = wanted % self.engram_pos.shape[0]
        known = (self.engram_pos[slots] == wanted) & (wanted >= 0)
        return torch.where(known, self.engram_ids[:, slots], torch.full_like(self.engram_ids[:, slots], DEAD))

    def record_engram(self, compressed: torch.Tensor, start: int) -> None:
        cap = self.engram_pos.shape[0]
        positions = torch.arange(start, start + compressed.shape[1], device=self.device)[-cap:]
        slots = positions % cap
        self.engram_ids[:, slots] = compressed[:, -cap:]
        self.engram_pos[slots] = positions

    # ------------------------------------------------------------------ rollback
    def truncate(self, length: int) -> None:
        """Forget every position >= ``length`` (speculative rollback)."""
        if length < 0 or length > self.length or self.length - length > self.spare:
            raise ValueError(f"cannot roll back {self.length - length} tokens: the cache keeps {self.spare} "
                             "spare positions; rebuild it from the token log")
        for ring in self.windows:
            ring.truncate(length)
        for src in self.sources.values():
            src.truncate(length)
        self.engram_pos[self.engram_pos >= length] = -1
        self.length = length

    # ------------------------------------------------------------------ sizes
    def global_bytes(self) -> int:
        return sum(s.n * (s.records.shape[2] + s.index.shape[2]) * self.batch for s in self.sources.values())

    def local_bytes(self) -> int:
        ring = sum(w.data.numel() for w in self.windows)
        pend = sum(s.pending_kv.numel() * 8 for s in self.sources.values())
        return ring + pend + self.engram_ids.numel() * 8

    # ------------------------------------------------------------------ export / import
    def meta(self) -> dict:
        a = self.args
        return {"format": FORMAT_VERSION, "batch": self.batch, "length": self.length,
                "head_dim": a.head_dim, "index_head_dim": a.index_head_dim, "window": a.sliding_window,
                "sources": {str(s): {"ratio": v.ratio, "n": v.n} for s, v in self.sources.items()},
                "layers": a.num_hidden_layers}

    def _check_packed(self) -> None:
        if not self.kv.packed:
            raise CacheFormatError(f"a {self.kv} cache holds floats; only packed caches are exported")

    def global_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Packed records and index keys per KV source (the part the session store keeps)."""
        self._check_packed()
        tensors = {}
        for s, src in self.sources.items():
            rec, idx = src.view()
            tensors[f"layers.{s}.kv"] = rec.contiguous().cpu()
            tensors[f"layers.{s}.index"] = idx.contiguous().cpu()
        return tensors, self.meta()

    def local_state(self) -> dict[str, torch.Tensor]:
        """Window rings, pending compressor tokens and engram look-back (the RAM-pool part)."""
        out = {}
        for i, w in enumerate(self.windows):
            out[f"layers.{i}.window"], out[f"layers.{i}.window_pos"] = w.data.clone(), w.pos.clone()
        for s, src in self.sources.items():
            out[f"layers.{s}.pending_kv"] = src.pending_kv.clone()
            out[f"layers.{s}.pending_gate"] = src.pending_gate.clone()
            for part in ("hist_kv", "hist_gate", "hist_pos"):
                out[f"layers.{s}.{part}"] = getattr(src, part).clone()
        out["engram.ids"], out["engram.pos"] = self.engram_ids.clone(), self.engram_pos.clone()
        return out

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        tensors, meta = self.global_state()
        return {**tensors, **self.local_state()}, meta

    # ------------------------------------------------------------------ chunked global KV
    def stored_tokens(self, multiple: int) -> int:
        """Tokens whose records every source holds, rounded down to ``multiple``."""
        covered = min((src.covered for src in self.sources.values()), default=self.length)
        return min(covered, self.length) // multiple * multiple

    def export_range(self, start: int, end: int) -> dict[str, bytes]:
        """Packed records / index keys of tokens [start, end) of batch row 0, per blob name.
        ``start`` and ``end`` must be multiples of every source's ratio."""
        self._check_packed()
        out = {}
        for s, src in self.sources.items():
            a, b = start // src.ratio, end // src.ratio
            assert a * src.ratio == start and b * src.ratio == end and b <= src.n
            out[f"layers.{s}.kv"] = src.records[0, a:b].contiguous().cpu().numpy().tobytes()
            out[f"layers.{s}.index"] = src.index[0, a:b].contiguous().cpu().numpy().tobytes()
        return out

    @classmethod
    def from_chunks(cls, args: ModelArgs, chunks: list[dict[str, bytes]], length: int, device="cpu") -> "Cache":
        """A batch-1 cache holding the global KV of ``length`` tokens from stored chunk blobs."""
        cache = cls(args, batch=1, device=device)
        for s, src in cache.sources.items():
            rec = _rows(b"".join(c[f"layers.{s}.kv"] for c in chunks), src.records.shape[2], f"layers.{s}.kv")
            idx = _rows(b"".join(c[f"layers.{s}.index"] for c in chunks), src.index.shape[2], f"layers.{s}.index")
            if rec.shape[0] != length // src.ratio or idx.shape[0] != rec.shape[0]:
                raise CacheFormatError(f"layers.{s}: {rec.shape[0]} records / {idx.shape[0]} index keys "
                                       f"for {length} tokens at ratio {src.ratio}")
            src.append(rec[None].to(cache.device), idx[None].to(cache.device))
        cache.length = length
        return cache

    @classmethod
    def from_state(cls, args: ModelArgs, tensors: dict[str, torch.Tensor], meta: dict,
                   device="cpu") -> "Cache":
        """Rebuild a cache; local tensors are optional (absent: the caller replays)."""
        _check_meta(args, meta)
        cache = cls(args, batch=meta["batch"], device=device)
        for s, src in cache.sources.items():
            rec, idx = tensors[f"layers.{s}.kv"], tensors[f"layers.{s}.index"]
            _check_rows(f"layers.{s}", rec, idx, meta["sources"][str(s)]["n"], src)
            src.append(rec.to(cache.device), idx.to(cache.device))
        if "engram.ids" in tensors:
            cache._load_local(tensors)
        cache.length = meta["length"]
        return cache

    def _load_local(self, t: dict[str, torch.Tensor]) -> None:
        for i, w in enumerate(self.windows):
            w.data.copy_(t[f"layers.{i}.window"]), w.pos.copy_(t[f"layers.{i}.window_pos"])
        for s, src in self.sources.items():
            src.set_pending(t[f"layers.{s}.pending_kv"].to(self.device), t[f"layers.{s}.pending_gate"].to(self.device))
            for part in ("hist_kv", "hist_gate", "hist_pos"):
                getattr(src, part).copy_(t[f"layers.{s}.{part}"])
        self.engram_ids.copy_(t["engram.ids"]), self.engram_pos.copy_(t["engram.pos"])


def _rows(data: bytes, width: int, name: str) -> torch.Tensor:
    if not data:
        return torch.zeros(0, width, dtype=torch.uint8)
    if len(data) % width:
        raise CacheFormatError(f"{name}: {len(data)} bytes is not a whole number of {width}-byte records")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(-1, width)


def _check_meta(args: ModelArgs, meta: dict) -> None:
    if meta.get("format") != FORMAT_VERSION:
        raise CacheFormatError(f"cache format {meta.get('format')!r} is not {FORMAT_VERSION}; rebuild it")
    mine = {"head_dim": args.head_dim, "index_head_dim": args.index_head_dim,
            "window": args.sliding_window, "layers": args.num_hidden_layers,
            "sources": sorted(str(s) for s in args.kv_source_layer_ids)}
    theirs = {k: meta.get(k) for k in mine if k != "sources"}
    theirs["sources"] = sorted(meta.get("sources", {}))
    if mine != theirs:
        raise CacheFormatError(f"cache state was made by another model config ({theirs} vs {mine})")
    if not 0 <= meta.get("length", -1) <= args.max_position_embeddings:
        raise CacheFormatError(f"cache length {meta.get('length')!r} is out of range")


def _check_rows(name: str, rec: torch.Tensor, idx: torch.Tensor, n: int, src: SourceKV) -> None:
    want_rec = (rec.shape[0], n, src.records.shape[2])
    want_idx = (idx.shape[0], n, src.index.shape[2])
    if rec.dtype != torch.uint8 or idx.dtype != torch.uint8 or tuple(rec.shape) != want_rec \
            or tuple(idx.shape) != want_idx:
        raise CacheFormatError(f"{name}: records {tuple(rec.shape)} / index keys {tuple(idx.shape)} do not "
                               f"match {n} records of {want_rec[2]} / {want_idx[2]} bytes")
