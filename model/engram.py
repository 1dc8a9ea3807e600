"""Engram n-gram hashing (ARCHITECTURE.md §2.9): bit-exact, or the tables are garbage.

Owns: the tokenizer-derived compressed token map, the per-layer hash multipliers, and
:class:`NgramHasher`, which turns token ids (plus the look-back history a cache carries)
into table row ids. Does not own the Engram module's weights or its gated injection into
the streams (``model.model.Engram``), nor the prime bucket layout (``engram_primes``, part
of the architecture: ``model.args``, whose table sizes are its sums).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from model import kernels
from model.args import ConfigError, engram_primes

DEAD = -1  # history marker: image-span token or unknown position; blocks look-back


def hash_multipliers(layer_ids: tuple, max_ngram: int, compressed_vocab: int) -> torch.Tensor:
    """[n_layers, max_ngram] odd int64 multipliers from numpy's PCG64 seeded 10007*layer."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    rows = []
    for layer in layer_ids:
        values = np.random.default_rng(10007 * layer).integers(0, bound, size=(max_ngram,), dtype=np.int64)
        rows.append(torch.from_numpy(values * 2 + 1))
    return torch.stack(rows)


def compressed_token_map(tokenizer_json: str | Path) -> tuple[list[int], int]:
    """Token id -> compressed id: tokens that normalise alike share an id (§2.9 step 1)."""
    from tokenizers import Regex, Tokenizer, normalizers

    tok = Tokenizer.from_file(str(tokenizer_json))
    sentinel = "\ue000"  # keeps a lone-space token from stripping to the empty string
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " ")])
    keys: dict[str, int] = {}
    lookup = []
    for token_id in range(tok.get_vocab_size(with_added_tokens=True)):
        text = tok.decode([token_id], skip_special_tokens=False)
        key = tok.id_to_token(token_id) if "\ufffd" in text else (norm.normalize_str(text) or text)
        lookup.append(keys.setdefault(key, len(keys)))
    return lookup, len(keys)


def find_tokenizer_json(path: str | Path) -> Path | None:
    path = Path(path)
    for candidate in (path / "tokenizer" / "tokenizer.json", path / "tokenizer.json"):
        if candidate.is_file():
            return candidate
    return None


class NgramHasher:
    """Row ids of the n-grams ending at each position, for every engram layer at once.

    ``__call__(ids, history)`` takes the compressed ids of the ``max_ngram - 1`` tokens
    before the chunk (``DEAD`` where the look-back is blocked: before position 0, or an
    image-span token) and returns ``[B, S, n_layers, n_cols]`` row ids (per-layer bucket
    offsets included): ``model.kernels.ngram_hash``, whose twin ``ngram_hash_ref`` is the maths.
    """

    def __init__(self, token_map: list[int], layer_ids: tuple, vocab_size: int, n_heads: int,
                 max_ngram: int, pad_id: int):
        self.token_map = torch.tensor(token_map, dtype=torch.long)
        self.pad = int(self.token_map[pad_id])
        primes = engram_primes(vocab_size, n_heads, max_ngram, len(layer_ids))
        self.primes = torch.tensor(primes, dtype=torch.long)  # [L, n-1, heads]
        flat = self.primes.flatten(1)
        self.offsets = torch.cumsum(flat, 1) - flat  # [L, n_cols]
        self.multipliers = hash_multipliers(tuple(layer_ids), max_ngram, len(set(token_map)))
        self._on: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def tables(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token_map, multipliers, primes, offsets) on ``device``, copied there once: a copy
        from host memory in every decode step would wait for the device to finish the step
        before (the host blocks on a pageable copy), so no two steps could overlap."""
        device = torch.device(device)
        if device not in self._on:
            self._on[device] = tuple(t.to(device) for t in (self.token_map, self.multipliers, self.primes,
                                                             self.offsets))
        return self._on[device]

    @property
    def table_sizes(self) -> list[int]:
        return self.primes.flatten(1).sum(1).tolist()

    def compress(self, ids: torch.Tensor, dead: torch.Tensor | None) -> torch.Tensor:
        c = self.tables(ids.device)[0][ids]
        return c if dead is None else c.masked_fill(dead, DEAD)

    def __call__(self, compressed: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """compressed: [B, S] (DEAD marks image tokens); history: [B, max_ngram-1], oldest first
        (the cache keeps it: ``Cache.engram_history``) -> row ids [B, S, n_layers, n_cols]."""
        _, multipliers, primes, offsets = self.tables(compressed.device)
        return kernels.ngram_hash(compressed, history.to(compressed.device), multipliers, primes, offsets,
                                  self.pad, DEAD)

    @classmethod
    def from_map(cls, args, token_map: list[int], size: int | None = None) -> "NgramHasher":
        size = len(set(token_map)) if size is None else size
        if args.engram_compressed_vocab_size and size != args.engram_compressed_vocab_size:
            raise ConfigError(f"config field 'engram_compressed_vocab_size': the tokenizer gives {size} "
                              f"compressed ids, the config says {args.engram_compressed_vocab_size}")
        if len(token_map) < args.vocab_size:
            raise ConfigError(f"the tokenizer has {len(token_map)} ids but vocab_size is {args.vocab_size}")
        hasher = cls(token_map, args.engram_layer_ids, args.engram_vocab_size, args.engram_n_heads,
                     args.engram_max_ngram_size, args.engram_pad_id)
        if tuple(hasher.table_sizes) != tuple(args.engram_num_embeddings):
            raise ConfigError(f"config field 'engram_num_embeddings': {list(args.engram_num_embeddings)} "
                              f"differs from the prime sums {hasher.table_sizes}")
        return hasher

