"""Inference engine: CED prefill with bounded decoder replay, decode, sampling, resume.

Owns how tokens go through the model (RUNTIME.md §4, ARCHITECTURE.md §2.7):
- ``prefill(state, ids)``: in ``ced`` mode the new tokens run through the encoder layers
  only, the decoder's KV source projects the encoder output into global KV and index keys
  for every token, and only the last ``window`` tokens run through the decoder layers.
  ``exact`` mode runs every token through every layer. Both work in chunks, so memory
  stays bounded on long prompts.
- ``decode(state, token)`` / ``generate(...)``: one token through all layers; greedy,
  temperature, top-k, top-p, seeded; stop ids; a streaming iterator of ids.
- ``export_global`` / ``import_global`` / ``replay``: the session state in two parts; the
  local part is rebuilt by replaying the last ``window`` tokens, as a resume does.

Knows nothing of tokenization, chat formats or storage: ids in, ids and bytes out.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import torch

from model import decode_step, kernels
from model.cache import Cache
from model.layer import Step
from model.quant import KVFormat

if TYPE_CHECKING:
    from model.model import Transformer


# a prefill's chunk: tokens run at once (``Engine.chunk``). On CUDA 8192: `small` on an H200
# (2026-12-07) prefilled 32K tokens exact / CED at 13.6K / 25.4K tokens/s in chunks of 2048,
# 27.1K / 47.8K of 4096, 31.1K / 65.2K of 8192 and 31.3K / 67.5K of 16384, and 128K at 19.2K /
# 48.2K of 4096, 20.1K / 53.2K of 8192 (the launches of a layer are paid once a chunk, and the
# host's time between them shows where chunks are small); on the CPU 512, as before.
CUDA_CHUNK, CPU_CHUNK, MIN_CHUNK = 8192, 512, 256
# bytes a (query, record) pair of a chunk's index scores takes at its peak (the scores, the
# candidate pool's mask, the top-k): sorted (torch's sort, the CPU's top-k), an exact prefill
# of 128K tokens in chunks of 2048 peaked 11.3 GB above the weights on the H100, ~42 B a pair;
# by the select kernel (CUDA), exact prefills of 32K in chunks of 8192 / 16384 peaked 3.6 / 7.1
# GB above the weights on the H200 (2026-12-07), ~13 B a pair, the cache included
SCORE_BYTES_PER, SELECT_BYTES_PER = 48, 16


def default_chunk(device) -> int:
    return CUDA_CHUNK if torch.device(device).type == "cuda" else CPU_CHUNK


def score_bytes(device) -> int:
    """:data:`SELECT_BYTES_PER` where a prefill's top-k runs the select kernel
    (``model.kernels.selects``), else :data:`SCORE_BYTES_PER`."""
    return SELECT_BYTES_PER if kernels.selects(torch.device(device)) else SCORE_BYTES_PER


def score_budget(device) -> int:
    """The bytes a chunk's index scores may take (``Engine.chunk_at``): a quarter of the GPU's
    memory, 4 GiB elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // 4
    return 4 << 30


class ContextLimitError(ValueError):
    """The prompt would not fit in the configured context."""


@dataclass
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 256
    stop_ids: tuple = ()


@dataclass
class State:
    """One live sequence batch: its cache and the logits of the newest position."""
    cache: Cache
    last_logits: torch.Tensor | None = None  # [B, vocab]
    generator: torch.Generator | None = field(default=None, repr=False)
    # a model with draft stages: the DSpark target layers' taps of positions [taps_start,
    # length) from the prefill that ended at ``length`` (the speculator's draft context), else None
    taps: dict | None = field(default=None, repr=False)
    taps_start: int = 0

    @property
    def length(self) -> int:
        return self.cache.length

    @property
    def taps_end(self) -> int | None:
        """Where the kept taps end (None without them)."""
        return None if self.taps is None else self.taps_start + next(iter(self.taps.values())).shape[1]


@dataclass
class _Tail:
    """Encoder output of the newest ``window`` tokens, kept for the decoder replay."""
    streams: torch.Tensor | None = None
    pre: torch.Tensor | None = None
    hash_ids: torch.Tensor | None = None
    image_mask: torch.Tensor | None = None

    def push(self, keep: int, streams, pre, hash_ids, image_mask) -> None:
        self.streams = _cat_tail(self.streams, streams, keep)
        self.pre = _cat_tail(self.pre, pre, keep)
        self.hash_ids = _cat_tail(self.hash_ids, hash_ids, keep)
        self.image_mask = _cat_tail(self.image_mask, image_mask, keep)


def _cat_tail(old, new, keep: int):
    if new is None:
        return None
    return (new if old is None else torch.cat([old, new], dim=1))[:, -keep:]


class Engine:
    def __init__(self, model: Transformer, *, mode: str = "ced", chunk: int | None = None,
                 max_context: int | None = None):
        if mode not in ("ced", "exact"):
            raise ValueError(f"prefill mode must be 'ced' or 'exact', not {mode!r}")
        self.model, self.args = model, model.args
        self.mode = mode if model.args.supports_ced else "exact"
        self.chunk = chunk or default_chunk(model.device)
        self.score_budget, self.score_bytes = score_budget(model.device), score_bytes(model.device)
        self.max_context = max_context or model.args.max_position_embeddings

    # ------------------------------------------------------------------ state
    def new_state(self, batch: int = 1, kv: KVFormat = KVFormat.PACKED) -> State:
        return State(cache=self.model.new_cache(batch, kv=kv))

    def _check_room(self, state: State, n: int) -> None:
        if state.length + n > self.max_context:
            raise ContextLimitError(f"{state.length} cached + {n} new tokens exceed the context limit of "
                                    f"{self.max_context} tokens; start a new session (the history no longer fits) "
                                    "or send a shorter input")

    # ------------------------------------------------------------------ prefill
    @torch.no_grad()
    def prefill(self, state: State, ids: torch.Tensor, *, mode: str | None = None, images=None,
                progress=None) -> torch.Tensor:
        """Consume ``ids`` [B, n]; returns (and keeps) the logits of the last position [B, vocab].
        ``images``: optional (image_embeds [B, n, D], image_mask [B, n]); ``progress``: called
        with (tokens done, total) after each chunk."""
        ids = ids.to(self.model.device)
        self._check_room(state, ids.shape[1])
        if ids.shape[1] == 0:
            return state.last_logits
        mode = mode or self.mode
        state.taps = None
        chunks = self._chunks(ids, images, progress, state.cache.length)
        if mode == "exact" or not self.args.supports_ced:
            state.last_logits = self._exact(state, chunks)
        else:
            state.last_logits = self._ced(state, chunks)
        return state.last_logits

    def _chunks(self, ids: torch.Tensor, images, progress=None, start: int = 0):
        n, s = ids.shape[1], 0
        while s < n:
            part = slice(s, s + self.chunk_at(start + s))
            emb, mask = (None, None) if images is None else (images[0][:, part], images[1][:, part])
            yield ids[:, part], emb, mask
            s = min(n, part.stop)
            if progress is not None:
                progress(s, n)

    def chunk_at(self, position: int) -> int:
        """Tokens the chunk starting at ``position`` runs at once: ``chunk``, halved (to no
        fewer than ``MIN_CHUNK``) while its queries' index scores over every record they may
        see would pass ``score_budget`` (``score_bytes`` a query and record), so memory stays
        bounded at long contexts."""
        size = self.chunk
        ratio = min((r for r in self.args.ratios if r), default=0)
        while ratio and size > MIN_CHUNK and size * (position + size) // ratio * self.score_bytes > self.score_budget:
            size //= 2
        return size

    def _exact(self, state: State, chunks) -> torch.Tensor:
        for chunk, emb, mask in chunks:
            logits = self._all_layers(state, chunk, state.cache.length, emb, mask)
        return logits

    def _all_layers(self, state: State, ids, start: int, emb, mask) -> torch.Tensor:
        """Every layer on ``ids`` at positions [start, ...); the head only on the last one."""
        m, cache = self.model, state.cache
        streams, pre, step = decode_step.begin(m, ids, cache, start, image_embeds=emb, image_mask=mask)
        taps = self._keep_taps(step)
        streams, pre = decode_step.run_layers(m, streams, pre, step, cache, range(self.args.num_hidden_layers))
        cache.length = max(cache.length, step.end)
        self._kept_taps(state, taps, step)
        return m.logits(streams[:, -1:], pre[:, -1:])[:, -1]

    def _keep_taps(self, step: Step) -> dict | None:
        """Ask the layers for the DSpark taps of this step, where the model has draft stages."""
        if getattr(self.model, "mtp", None) is None:
            return None
        step.shared["taps"] = taps = {}
        return taps

    def _kept_taps(self, state: State, taps: dict | None, step: Step) -> None:
        """The step's taps on ``state`` when every target layer ran in it (a CED prefill's
        replay runs only the decoder's), after the previous chunk's: the last window's."""
        if taps is None or not all(layer in taps for layer in self.args.dspark_target_layer_ids):
            return
        if state.taps_end == step.start:
            taps = {k: torch.cat([state.taps[k], t], dim=1)[:, -self.args.sliding_window:] for k, t in taps.items()}
        state.taps = taps
        state.taps_start = step.end - next(iter(taps.values())).shape[1]

    def _ced(self, state: State, chunks) -> torch.Tensor:
        m, cache, window = self.model, state.cache, self.args.sliding_window
        encoder = range(self.args.decoder_start)
        tail = _Tail()
        for chunk, emb, mask in chunks:
            streams, pre, step = decode_step.begin(m, chunk, cache, cache.length, image_embeds=emb, image_mask=mask)
            streams, pre = decode_step.run_layers(m, streams, pre, step, cache, encoder)
            m.project_decoder_source(streams, pre, step, cache)
            tail.push(window, streams, pre, step.hash_ids, mask)
            cache.length = step.end
        return self._decoder_replay(state, tail)

    def _decoder_replay(self, state: State, tail: _Tail) -> torch.Tensor:
        """Run the decoder layers on the newest ``window`` tokens only (bounded replay)."""
        r = tail.streams.shape[1]
        step = Step(start=state.cache.length - r, length=r, hash_ids=tail.hash_ids, image_mask=tail.image_mask,
                    packed_reads=decode_step.asks_packed_reads(tail.streams, r))
        decoder = range(self.args.decoder_start, self.args.num_hidden_layers)
        taps = self._keep_taps(step)
        streams, pre = decode_step.run_layers(self.model, tail.streams, tail.pre, step, state.cache, decoder)
        self._kept_taps(state, taps, step)
        return self.model.logits(streams[:, -1:], pre[:, -1:])[:, -1]

    # ------------------------------------------------------------------ decode
    @torch.no_grad()
    def decode(self, state: State, token: torch.Tensor) -> torch.Tensor:
        """One token per row ([B] or [B, 1]) through every layer; returns logits [B, vocab]."""
        self._check_room(state, 1)
        state.taps = None
        token = token.reshape(-1, 1).to(self.model.device)
        state.last_logits = decode_step.forward(self.model, token, state.cache)[:, -1]
        return state.last_logits

    def sample(self, state: State, params: Sampling) -> torch.Tensor:
        if state.generator is None and params.seed is not None:
            state.generator = torch.Generator(device="cpu").manual_seed(params.seed)
        return sample_logits(state.last_logits, params, state.generator)

    def generate(self, state: State, params: Sampling) -> Iterator[int]:
        """Stream sampled ids (batch row 0) from the current state until a stop id or the limit.
        A stop id is yielded but not fed back (the caller decides whether to consume it)."""
        for i in range(params.max_new_tokens):
            if state.length >= self.max_context:
                return
            token = self.sample(state, params)
            yield int(token[0])
            if int(token[0]) in params.stop_ids or i == params.max_new_tokens - 1:
                return
            self.decode(state, token)

    # ------------------------------------------------------------------ session state
    def export_global(self, state: State) -> tuple[dict[str, torch.Tensor], dict]:
        return state.cache.global_state()

    def import_global(self, tensors: dict[str, torch.Tensor], meta: dict) -> State:
        """A state holding only the global KV; call :meth:`replay` before continuing."""
        return State(cache=Cache.from_state(self.args, tensors, meta, device=self.model.device))

    def state_from_chunks(self, chunks: list[dict[str, bytes]], length: int) -> State:
        """A state holding the global KV of ``length`` tokens from a session store's chunk
        blobs (``Cache.from_chunks``, which refuses blobs that do not fit with
        ``CacheFormatError``); call :meth:`replay` before continuing."""
        return State(cache=Cache.from_chunks(self.args, chunks, length, device=self.model.device))

    def replay_spans(self, n: int, tokens: int | None = None) -> tuple[int, int]:
        """(first, begin) of :meth:`replay` over a log of ``n`` tokens: log[begin:n] runs
        through every layer, after log[first:begin] seeds the Engram look-back before it."""
        begin = max(0, n - (tokens or self.args.sliding_window))
        if not self.args.engram_layer_ids or begin == 0:
            return begin, begin
        return max(0, begin - (self.args.engram_max_ngram_size - 1)), begin

    @torch.no_grad()
    def replay(self, state: State, log_ids: torch.Tensor, images=None, tokens: int | None = None) -> torch.Tensor:
        """Rebuild the local part (windows, pending compressor tokens, engram look-back) from
        the token log [B, N] by running its last ``tokens`` (default: ``window``) tokens
        through every layer. Records already stored are kept, never recomputed. ``images``
        is a callable ``(begin, end) -> (embeds, mask) | None`` for the image spans of a
        range of the log. Returns the last logits."""
        n = log_ids.shape[1]
        if n != state.length:
            raise ValueError(f"the token log has {n} tokens but the state covers {state.length}")
        if n == 0:
            return None
        first, begin = self.replay_spans(n, tokens)
        state.taps = None
        self._seed_engram(state, log_ids, first, begin, images)
        tail = log_ids[:, begin:].to(self.model.device)
        emb, mask = (images and images(begin, n)) or (None, None)
        state.last_logits = self._all_layers(state, tail, begin, emb, mask)
        return state.last_logits

    def _seed_engram(self, state: State, log_ids: torch.Tensor, first: int, begin: int, images) -> None:
        """Give the replay the n-gram look-back of the tokens just before it."""
        if first == begin:
            return
        ids = log_ids[:, first:begin].to(self.model.device)
        dead = (images and images(first, begin) or (None, None))[1]
        state.cache.record_engram(self.model.hasher.compress(ids, dead), first)


def sample_logits(logits: torch.Tensor, p: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """[B, V] logits -> [B] ids."""
    if p.temperature <= 0:
        return logits.argmax(-1)
    probs = shaped_probs(logits, p).cpu()
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(logits.device)


def shaped_probs(logits: torch.Tensor, p: Sampling) -> torch.Tensor:
    """The distribution sampling draws from: temperature, then top-k, then top-p."""
    scores = logits.float() / p.temperature
    if p.top_k > 0:
        kth = scores.topk(min(p.top_k, scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if p.top_p < 1.0:
        scores = _top_p(scores, p.top_p)
    return scores.softmax(-1)


def _top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_scores, order = scores.sort(dim=-1, descending=True)
    cum = sorted_scores.softmax(-1).cumsum(-1)
    drop = cum - sorted_scores.softmax(-1) >= top_p  # keep the smallest prefix reaching top_p
    sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
    return torch.full_like(scores, float("-inf")).scatter(-1, order, sorted_scores)
