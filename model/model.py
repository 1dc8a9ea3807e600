"""The DeepSeek-V4.1-Flash text network in plain PyTorch: the reference every kernel matches.

The Transformer (ARCHITECTURE.md §2): token (and image) embeddings copied into the hc
streams, the layers (``model.block``: Engram, the shared-latent attention over the CSA2
sources, the MoE, the lagged mHC sites), the final collapse, norm and head, and CED's
projection of the encoder output into the decoder's KV source. The DSpark draft stages
hang off it as ``mtp`` (``model.dspark``). Module and parameter names are the official
checkpoint names, so loading is a name-for-name copy.

Every forward goes through an explicit :class:`model.cache.Cache` (a fresh one when none is
given). Positions that a cache already covers are never compressed twice, which is what
makes bounded-replay prefill and resume a matter of choosing which layers to run.

Does not own: the layers (``model.block``, ``model.csa2``, ``model.moe``), the fast decode
step on CUDA that runs these parameters through fused kernels and graphs
(``model.decode_step``; this module never calls it), sampling, prefill strategies and
session state (``model.engine``), weight files (``model.checkpoint``), tokenization
(``model.tokenizer``).
"""
from __future__ import annotations

import torch
from torch import nn

from model.args import ModelArgs
from model.block import Block, hc_collapse
from model.cache import Cache
from model.dspark import DSpark
from model.engram import NgramHasher
from model.layer import RMSNorm, Step, embedding
from model.linear import ALONE, Linear, VocabEmbedding, World
from model.quant import KVFormat
from model.rope import Ropes
from model.vision import Aligner, VisionTransformer, encode_image_span, preprocess

ENGRAM_PLACES = ("device", "host")  # where the Engram tables are kept (``model.linear.Table``)


class Transformer(nn.Module):
    """The V4.1 backbone. ``model(ids)`` is the exact full forward: logits [B, T, vocab]."""

    def __init__(self, args: ModelArgs, world: World = ALONE, engram: str = "device"):
        """``world``: the ranks that share the model (tensor and expert parallel: attention
        heads, vocabulary, Engram table rows; ``docs/tensor-and-expert-parallel-design.md``); one
        process alone by default. ``engram``: where the Engram tables are kept (one of
        :data:`ENGRAM_PLACES`)."""
        if engram not in ENGRAM_PLACES:
            raise ValueError(f"the Engram tables are kept on the {' or '.join(ENGRAM_PLACES)}, not {engram!r}")
        super().__init__()
        self.args, self.world = args, world
        alone = world.size == 1
        self.embed = embedding(args.vocab_size, args.hidden_size) if alone else \
            VocabEmbedding(args.vocab_size, args.hidden_size, world)
        self.layers = nn.ModuleList([Block(args, i, world, engram) for i in range(args.num_hidden_layers)])
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.head = Linear(args.hidden_size, args.vocab_size, split=None if alone else "vocab", world=world)
        self.ropes = Ropes(args)
        self.hasher: NgramHasher | None = None
        if args.vision is not None:
            self.vision = VisionTransformer(args.vision)
            self.aligner = Aligner(args.vision, args.hidden_size)
            self.image_start = nn.Parameter(torch.zeros(args.hidden_size))
            self.image_end = nn.Parameter(torch.zeros(args.hidden_size))
            self.image_newline = nn.Parameter(torch.zeros(args.hidden_size))
        if args.num_nextn_predict_layers:
            self.mtp = DSpark(args, world)  # the draft stages, checkpoint names mtp.K.*
        self.derived: dict = {}  # what a fast path made from the weights' addresses (captured graphs)
        self.register_load_state_dict_post_hook(lambda module, keys: module.derived.clear())

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.derived.clear()  # a move or cast gave the weights new addresses
        return self

    def encode_image(self, image, *, grad: bool = False) -> torch.Tensor:
        """A decoded RGB PIL image -> its span embeddings [n_tokens, D] (start, rows+newlines, end);
        differentiable only when ``grad`` (training)."""
        if self.args.vision is None:
            raise ValueError("this checkpoint has no vision tower; it cannot read images")
        pixels, plan = preprocess(image, self.args.vision)
        with torch.set_grad_enabled(grad):
            span = encode_image_span(self.vision, self.aligner, self.image_start, self.image_newline,
                                     self.image_end, pixels.to(self.device, self.embed.weight.dtype), plan)
        return span.to(self.embed.weight.dtype)

    def bind_token_map(self, token_map: list[int]) -> None:
        """Engram needs the tokenizer-derived compressed token map (§2.9)."""
        self.hasher = NgramHasher.from_map(self.args, token_map)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_cache(self, batch: int = 1, kv: KVFormat = KVFormat.PACKED) -> Cache:
        return Cache(self.args, batch=batch, device=self.device, kv=kv)

    def forward(self, input_ids: torch.Tensor, cache: Cache | None = None, *,
                image_embeds: torch.Tensor | None = None, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run every layer on ``input_ids`` [B, S], continuing ``cache`` (fresh if None)."""
        cache = cache if cache is not None else self.new_cache(input_ids.shape[0])
        streams, pre, step = self.begin(input_ids, cache, start=cache.length,
                                        image_embeds=image_embeds, image_mask=image_mask)
        streams, pre = self.run_layers(streams, pre, step, cache, range(self.args.num_hidden_layers))
        cache.length = max(cache.length, step.end)
        return self.logits(streams, pre)

    def begin(self, ids: torch.Tensor, cache: Cache, start: int, image_embeds=None, image_mask=None, hash_ids=None):
        """Embeddings copied into the hc streams, the one-hot first ``pre``, and the Step
        (``hash_ids``: the Engram rows of ``ids``, where the caller hashed them already)."""
        x = self.embed(ids)
        if image_mask is not None and image_embeds is not None:
            x = torch.where(image_mask.unsqueeze(-1), image_embeds.to(x.dtype), x)
        step = Step(start=start, length=ids.shape[1], image_mask=image_mask,
                    new=all(src.done == start for src in cache.sources.values()))
        step.hash_ids = hash_ids if hash_ids is not None else self.engram_hash(ids, cache, start, image_mask)
        step.engram_rows = self.fetch_engram_rows(step.hash_ids)
        streams = x.unsqueeze(2).expand(-1, -1, self.args.hc_mult, -1).contiguous()
        pre = torch.zeros(*streams.shape[:-1], dtype=torch.float32, device=x.device)
        pre[..., 0] = 1.0
        return streams, pre, step

    def engram_hash(self, ids, cache: Cache, start: int, image_mask=None) -> torch.Tensor | None:
        if not self.args.engram_layer_ids:
            return None
        if self.hasher is None:
            raise RuntimeError("this model has Engram layers: call bind_token_map() with the tokenizer's map")
        compressed = self.hasher.compress(ids, image_mask)
        history = cache.engram_history(start, self.args.engram_max_ngram_size - 1)
        hash_ids = self.hasher(compressed, history)
        cache.record_engram(compressed, start)
        return hash_ids

    def fetch_engram_rows(self, hash_ids: torch.Tensor | None) -> dict | None:
        """The rows of ``hash_ids`` of every Engram table kept in host memory, by slot, fetched
        before any layer runs (``Table.fetch``: on CUDA the copies run beside the layers), or
        None where no table is kept there."""
        if hash_ids is None:
            return None
        held = [b.engram for b in self.layers if b.engram is not None and b.engram.embed.host]
        return {e.slot: e.embed.fetch(hash_ids[:, :, e.slot]) for e in held} or None

    def run_layers(self, streams, pre, step: Step, cache: Cache, layers: range):
        """(streams, pre) through ``layers``, each reading and writing ``cache``."""
        for i in layers:
            streams, pre = self.layers[i](streams, pre, step, cache, self.ropes)
        return streams, pre

    def logits(self, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        return self.world.gather(self.head(self.final_hidden(streams, pre))).float()

    def final_hidden(self, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        return self.norm(hc_collapse(streams, pre))

    def project_decoder_source(self, streams, pre, step: Step, cache: Cache) -> None:
        """CED: the decoder's KV source turns the encoder output into global KV and index
        keys for every token, without running the decoder layers (ARCHITECTURE.md §2.7)."""
        layer = self.layers[self.args.decoder_start]
        streams = layer.engram_site(streams, step.hash_ids, None, step.engram_rows)
        x = layer.attn_norm(hc_collapse(streams, pre))
        layer.attn.update_source(x, step, cache, self.ropes)

