"""ModelArgs: the architecture of a V4.1 checkpoint, read from its ``config.json``.

Owns: the frozen dataclass of architecture fields (official HF names, ARCHITECTURE.md §1),
the presets ``v41-flash`` / ``small`` / ``tiny``, validation with errors that name the
field, the derived layer schedule (each layer's CSA2 role and sources) and the Engram
tables' prime bucket layout (``engram_primes``: ``engram_num_embeddings`` are its sums;
``model.engram`` hashes with it). Does not own: runtime settings (device, dtype, sampling,
paths) — those live with the engine and CLI.

The layer schedule is data: nothing here or in ``model.model`` hard-codes a number of
the full model; the presets below are the only place those numbers appear.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config that cannot describe a working model; the message names the field."""


@dataclass(frozen=True)
class VisionArgs:
    num_hidden_layers: int = 32  # ViT blocks
    hidden_size: int = 1024  # ViT width
    num_attention_heads: int = 16  # ViT heads
    intermediate_size: int = 2816  # ViT MLP width (w1 produces 2x for gate|up)
    patch_size: int = 14  # pixels per patch side
    downsample_ratio: int = 3  # pixel-unshuffle factor of the aligner
    rope_theta: float = 10000.0  # 2-D RoPE base
    max_image_tokens: int = 1024  # cap on LLM image tokens per image
    min_pixels: int = 295936  # images are upscaled to at least this many pixels
    max_wh_ratio: float | None = None  # clamp for very wide images (None: no clamp)
    rms_norm_eps: float = 1e-6  # ViT RMSNorm epsilon

    def __post_init__(self) -> None:
        _check_types(self, "vision_config.")


@dataclass(frozen=True)
class ModelArgs:
    # --- core sizes
    vocab_size: int = 129280  # tokenizer size
    hidden_size: int = 5120  # model width D
    num_hidden_layers: int = 40  # backbone layers (draft stages not counted)
    num_attention_heads: int = 64  # query heads
    num_key_value_heads: int = 1  # the single shared K=V latent
    head_dim: int = 512  # per-head width = latent width (nope + rope)
    qk_rope_head_dim: int = 64  # trailing RoPE channels of each head
    q_lora_rank: int = 1280  # low-rank query bottleneck
    o_groups: int = 8  # groups of the grouped output projection
    o_lora_rank: int = 1024  # per-group output rank
    rms_norm_eps: float = 1e-20  # every RMSNorm, the hc input norm and engram rstd
    swiglu_limit: float = 10.0  # SwiGLU clamp
    # --- positions
    rope_theta: float = 10000.0  # main RoPE (ratio-0 layers)
    compress_rope_theta: float = 160000.0  # compress RoPE (ratio > 0 layers), with YaRN
    rope_scaling: dict = field(default_factory=lambda: {
        "rope_type": "yarn", "factor": 16.0, "beta_fast": 32, "beta_slow": 1,
        "original_max_position_embeddings": 65536})  # YaRN of the compress RoPE
    max_position_embeddings: int = 1048576  # context limit
    sliding_window: int = 128  # window entries per query, self included
    # --- CSA2 schedule
    compress_ratios: tuple = (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)  # per layer (+ draft stages)
    kv_source_layer_ids: tuple = (2, 8, 14, 20)  # layers that own a compressor
    index_source_layer_ids: tuple = (2, 8, 14, 20, 24, 28, 32, 36)  # layers that own an indexer
    candidate_source_layer_id: int = 20  # builds the block candidate pool (-1: none)
    candidate_topk_blocks: int = 2048  # blocks kept in the candidate pool
    candidate_block_size: int = 8  # records per candidate block
    index_n_heads: int = 32  # indexer heads
    index_head_dim: int = 128  # indexer key/query width
    index_topk: int = 512  # records selected per query
    # --- MoE
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2304
    scoring_func: str = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    # --- mHC
    hc_mult: int = 4  # parallel residual streams
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # --- Engram
    engram_layer_ids: tuple = (1, 14)
    engram_num_embeddings: tuple = (384006168, 384016682)  # = sum of each layer's primes
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_vocab_size: int = 16000000  # primes are drawn upward from here
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    # --- DSpark draft stages
    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    # --- tokens
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int | None = 2
    image_token_id: int = 129264
    tie_word_embeddings: bool = False
    # --- checkpoint storage
    weight_block_size: int = 32  # FP8 weight block (quantization_config)
    expert_dtype: str = "fp4"
    vision: VisionArgs | None = None

    def __post_init__(self) -> None:
        validate(self)

    # ------------------------------------------------------------------ derived schedule
    @property
    def ratios(self) -> tuple:
        """Compress ratio of each backbone layer."""
        return tuple(self.compress_ratios[: self.num_hidden_layers])

    def kv_source(self, layer: int) -> int | None:
        """The KV-source layer whose compressed records ``layer`` attends (None: window only)."""
        if self.ratios[layer] == 0:
            return None
        return max(s for s in self.kv_source_layer_ids if s <= layer)

    def index_source(self, layer: int) -> int | None:
        """The index source whose top-k ``layer`` uses (its own, or the group's latest)."""
        if self.ratios[layer] == 0:
            return None
        group = self.kv_source(layer)
        return max(s for s in self.index_source_layer_ids if group <= s <= layer)

    def role(self, layer: int) -> str:
        """CSA2 mode: 'swa', 'full' (KV + index source), 'reindex' or 'reuse'."""
        if self.ratios[layer] == 0:
            return "swa"
        if layer in self.kv_source_layer_ids:
            return "full"
        return "reindex" if layer in self.index_source_layer_ids else "reuse"

    def uses_candidates(self, layer: int) -> bool:
        c = self.candidate_source_layer_id
        return c >= 0 and layer > c and layer in self.index_source_layer_ids

    @property
    def decoder_start(self) -> int:
        """First decoder layer (the first ratio-1 layer); == num_hidden_layers if none."""
        return next((i for i, r in enumerate(self.ratios) if r == 1), self.num_hidden_layers)

    @property
    def supports_ced(self) -> bool:
        """Bounded-replay prefill needs the decoder's only KV source to be its first layer."""
        dec = self.decoder_start
        return dec < self.num_hidden_layers and [s for s in self.kv_source_layer_ids if s >= dec] == [dec]

    @property
    def engram_n_cols(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    def kv_bytes_per_token(self) -> float:
        """Global (persistent) KV bytes per token: FP4 records + FP4 index keys of the sources."""
        from model.quant import index_record_bytes, main_record_bytes

        per = main_record_bytes(self.head_dim) + index_record_bytes(self.index_head_dim)
        return sum(per / self.ratios[s] for s in self.kv_source_layer_ids)

    # ------------------------------------------------------------------ io
    def replace(self, **changes: Any) -> "ModelArgs":
        return dataclasses.replace(self, **changes)

    def to_config(self) -> dict:
        """The composite ``config.json`` layout of an official checkpoint."""
        text = {k: v for k, v in dataclasses.asdict(self).items() if k not in _NON_TEXT}
        text = {k: list(v) if isinstance(v, tuple) else v for k, v in text.items()}
        cfg = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
               "dtype": "bfloat16", "tie_word_embeddings": self.tie_word_embeddings,
               "text_config": {"model_type": "deepseek_v41_text", **text},
               "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                       "weight_block_size": [self.weight_block_size] * 2,
                                       "scale_fmt": "ue8m0", "expert_dtype": self.expert_dtype}}
        if self.vision is not None:
            cfg["vision_config"] = {"model_type": "deepseek_v41_vision", **dataclasses.asdict(self.vision)}
        return cfg

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelArgs":
        """Read a composite (``text_config`` / ``vision_config``) or flat config; a value of
        the wrong shape or type is a ConfigError naming its field."""
        if not isinstance(cfg, dict):
            raise ConfigError(f"config.json must hold a JSON object at its top level, not {_kind(cfg)}; "
                              "check that it is the model's config.json")
        text = dict(_section(cfg, "text_config", cfg))
        known = {f.name for f in dataclasses.fields(cls)} - _NON_TEXT
        kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in text.items() if k in known}
        if "image_token_id" in cfg:
            kwargs["image_token_id"] = cfg["image_token_id"]
        quant = _section(cfg, "quantization_config", {})
        if quant.get("weight_block_size"):
            kwargs["weight_block_size"] = _block_size(quant["weight_block_size"])
        if quant.get("expert_dtype") or cfg.get("expert_dtype"):
            kwargs["expert_dtype"] = quant.get("expert_dtype") or cfg["expert_dtype"]
        vision = _section(cfg, "vision_config", {})
        if vision:
            vknown = {f.name for f in dataclasses.fields(VisionArgs)}
            kwargs["vision"] = VisionArgs(**{k: v for k, v in vision.items() if k in vknown})
        return cls(**kwargs)

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelArgs":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            cfg = json.loads(path.read_bytes().decode("utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path} is not UTF-8 text (byte {e.start}); save config.json as UTF-8 JSON") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        except OSError as e:
            raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
        return cls.from_config(cfg)

    @classmethod
    def preset(cls, name: str, layers: int | None = None, engram_rows: int | None = None) -> "ModelArgs":
        """A preset's config; ``layers`` / ``engram_rows``: :meth:`shortened` (for benchmarks)."""
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return PRESETS[name]().shortened(layers, engram_rows)

    def shortened(self, layers: int | None = None, engram_rows: int | None = None) -> "ModelArgs":
        """The same model at ``layers`` backbone layers that still hold every kind of layer the
        schedule has (a window-only layer, an Engram layer, each ratio's KV and index source
        with a Reuse reader, the candidate source, a Reindex reader of its pool and a Reuse
        after that): the first layer of each kind and the sources it reads, then others spread
        over the rest; widths unchanged. ``engram_rows``: Engram tables of about that many rows
        each (their primes walked up from a smaller start). None: as they are."""
        out = self if layers is None or layers >= self.num_hidden_layers else _keep_layers(self, layers)
        return out if engram_rows is None else _engram_rows(out, engram_rows)


_NON_TEXT = {"vision", "weight_block_size", "expert_dtype"}


# ----------------------------------------------------------------------------- shape and types

def _kind(value: object) -> str:
    """How JSON would name a value's type, for messages."""
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", tuple: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def _section(cfg: dict, name: str, default: Any) -> Any:
    """``cfg[name]``, which must be a JSON object when present (null reads as absent)."""
    value = cfg.get(name)
    if value is None:
        return default
    if not isinstance(value, dict):
        _fail(name, f"must be a JSON object, got {_kind(value)} ({value!r:.40})")
    return value


def _is_int(v: object) -> bool:
    # bool is an int subclass in Python, but `true` is never a size in a config.json
    return isinstance(v, int) and not isinstance(v, bool)


def _block_size(value: Any) -> int:
    """quantization_config.weight_block_size: [rows, cols] (the official form) or one int."""
    sizes = value if isinstance(value, (list, tuple)) else [value]
    if not sizes or not all(_is_int(v) and v > 0 for v in sizes):
        _fail("quantization_config.weight_block_size", f"must be a list of positive integers, got {value!r:.40}")
    return sizes[0]


def _fits(value: object, hint: Any) -> str | None:
    """None when ``value`` fits the field's annotation, else what the field expects."""
    if hint is int:
        return None if _is_int(value) else "an integer"
    if hint is float:  # JSON writes 10000.0 as 10000 just as well
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else "a number"
    if hint is bool:
        return None if isinstance(value, bool) else "true or false"
    if hint is str:
        return None if isinstance(value, str) else "a string"
    if hint is dict:
        return None if isinstance(value, dict) else "a JSON object"
    if hint is tuple:  # every tuple field is a per-layer list of integers (ratios, layer ids, sizes)
        return None if isinstance(value, tuple) and all(_is_int(v) for v in value) else "a list of integers"
    args = typing.get_args(hint)
    if type(None) in args:
        if value is None:
            return None
        inner = next(a for a in args if a is not type(None))
        why = _fits(value, inner)
        return None if why is None else f"{why} or null"
    return None if isinstance(value, hint) else hint.__name__


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check_types(obj: object, prefix: str = "") -> None:
    """Every field holds a value of its annotated type (before any check does arithmetic)."""
    for name, hint in _hints(type(obj)).items():
        value = getattr(obj, name)
        why = _fits(value, hint)
        if why is not None:
            _fail(prefix + name, f"must be {why}, got {_kind(value)} ({value!r:.40})")


# ----------------------------------------------------------------------------- validation

def _fail(name: str, why: str) -> None:
    raise ConfigError(f"config field {name!r}: {why}")


def _check_sizes(a: ModelArgs) -> None:
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
                 "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim", "n_routed_experts",
                 "num_experts_per_tok", "moe_intermediate_size", "hc_mult", "sliding_window", "vocab_size"):
        if int(getattr(a, name)) <= 0:
            _fail(name, f"must be a positive integer, got {getattr(a, name)!r}")
    if a.num_key_value_heads != 1:
        _fail("num_key_value_heads", "V4.1 has one shared K=V latent; must be 1")
    if a.head_dim % 32:
        _fail("head_dim", f"{a.head_dim} must be a multiple of 32 (FP8 window and FP4 record blocks)")
    if a.index_head_dim % 32:
        _fail("index_head_dim", f"{a.index_head_dim} must be a multiple of 32 (FP4 index key blocks)")
    if a.qk_rope_head_dim % 2 or not 0 < a.qk_rope_head_dim <= min(a.head_dim, a.index_head_dim):
        _fail("qk_rope_head_dim", f"{a.qk_rope_head_dim} must be even and fit in head_dim and index_head_dim")
    if (a.num_attention_heads * a.head_dim) % a.o_groups or a.num_attention_heads % a.o_groups:
        _fail("o_groups", f"{a.o_groups} must divide num_attention_heads ({a.num_attention_heads})")
    if a.num_experts_per_tok > a.n_routed_experts:
        _fail("num_experts_per_tok", f"{a.num_experts_per_tok} > n_routed_experts ({a.n_routed_experts})")
    if a.scoring_func not in ("sqrtsoftplus", "softmax", "sigmoid"):
        _fail("scoring_func", f"unknown scoring function {a.scoring_func!r}")


def _check_schedule(a: ModelArgs) -> None:
    n = a.num_hidden_layers
    if len(a.compress_ratios) not in (n, n + a.num_nextn_predict_layers):
        _fail("compress_ratios", f"has {len(a.compress_ratios)} entries; expected {n} "
              f"(+ {a.num_nextn_predict_layers} draft stages)")
    ratios = a.ratios
    if any(r not in (0, 1, 2, 4, 8, 16, 32, 64, 128) for r in ratios):
        _fail("compress_ratios", f"unsupported ratio in {list(ratios)}")
    if list(a.kv_source_layer_ids) != sorted(set(a.kv_source_layer_ids)):
        _fail("kv_source_layer_ids", "must be strictly increasing")
    for s in a.kv_source_layer_ids:
        if not 0 <= s < n or ratios[s] == 0:
            _fail("kv_source_layer_ids", f"layer {s} is not a compressed (ratio > 0) layer of the backbone")
    for i, r in enumerate(ratios):
        if r and not any(s <= i for s in a.kv_source_layer_ids):
            _fail("kv_source_layer_ids", f"layer {i} reads compressed KV but no source comes at or before it")
        if r and ratios[a.kv_source(i)] != r:
            _fail("compress_ratios", f"layer {i} has ratio {r} but its KV source {a.kv_source(i)} has "
                  f"ratio {ratios[a.kv_source(i)]}")


def _check_index(a: ModelArgs) -> None:
    ratios = a.ratios
    for s in a.index_source_layer_ids:
        if not 0 <= s < a.num_hidden_layers or ratios[s] == 0:
            _fail("index_source_layer_ids", f"layer {s} is not a compressed layer of the backbone")
    for s in a.kv_source_layer_ids:
        if s not in a.index_source_layer_ids:
            _fail("index_source_layer_ids", f"KV source {s} must also be an index source (it owns the keys)")
    c = a.candidate_source_layer_id
    if c >= 0 and (c not in a.kv_source_layer_ids or c not in a.index_source_layer_ids):
        _fail("candidate_source_layer_id", f"layer {c} must be both a KV source and an index source")
    if c >= 0 and (a.candidate_topk_blocks <= 0 or a.candidate_block_size <= 0):
        _fail("candidate_topk_blocks", "candidate_topk_blocks and candidate_block_size must be positive")
    if a.index_topk <= 0:
        _fail("index_topk", "must be positive")


def _check_engram(a: ModelArgs) -> None:
    if len(a.engram_num_embeddings) != len(a.engram_layer_ids):
        _fail("engram_num_embeddings", "needs one entry per engram layer")
    for layer in a.engram_layer_ids:
        if not 0 <= layer < a.num_hidden_layers:
            _fail("engram_layer_ids", f"layer {layer} is outside the backbone")
    if a.engram_layer_ids and a.engram_max_ngram_size < 2:
        _fail("engram_max_ngram_size", "must be at least 2")
    for t in a.dspark_target_layer_ids if a.num_nextn_predict_layers else ():
        if not 0 <= t < a.num_hidden_layers:
            _fail("dspark_target_layer_ids", f"layer {t} is outside the backbone")


def validate(a: ModelArgs) -> None:
    _check_types(a)
    _check_sizes(a)
    _check_schedule(a)
    _check_index(a)
    _check_engram(a)


# ----------------------------------------------------------------------------- engram tables

def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def engram_primes(vocab_size: int, n_heads: int, max_ngram: int, n_layers: int) -> list[list[list[int]]]:
    """Primes [layer][ngram-2][head], walking upward from ``vocab_size``, never reused."""
    seen: set[int] = set()
    out = []
    for _ in range(n_layers):
        per_layer = []
        for _ in range(max_ngram - 1):
            current, sizes = vocab_size - 1, []
            for _ in range(n_heads):
                current += 1
                while not _is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                sizes.append(current)
            per_layer.append(sizes)
        out.append(per_layer)
    return out


# ----------------------------------------------------------------------------- shortened schedules

def _keep_layers(a: ModelArgs, n: int) -> ModelArgs:
    """``a`` at ``n`` of its layers (:meth:`ModelArgs.shortened`), renumbered in order."""
    kept = _every_kind(a)
    if len(kept) > n:
        raise ConfigError(f"layers: {n} cannot hold every kind of layer of this schedule; {len(kept)} can "
                          f"(layers {sorted(kept)})")
    rest = [i for i in range(a.num_hidden_layers) if i not in kept]
    for i in _spread(rest):
        more = kept | _with_sources(a, i)
        if len(more) <= n:
            kept = more
        if len(kept) == n:
            break
    return _renumbered(a, sorted(kept))


def _every_kind(a: ModelArgs) -> set[int]:
    """The first layer of each kind, with the sources it reads."""
    roles = [(a.ratios[i], a.role(i), a.uses_candidates(i), i == a.candidate_source_layer_id, i in a.engram_layer_ids)
             for i in range(a.num_hidden_layers)]
    kept: set[int] = set()
    for kind in dict.fromkeys(roles):
        kept |= _with_sources(a, roles.index(kind))
    after = [i for i in range(a.num_hidden_layers) if a.uses_candidates(i) or i == a.candidate_source_layer_id]
    for i in after:  # a Reuse layer after a Reindex reader of the pool: it reads the pool's top-k
        if i + 1 < a.num_hidden_layers and a.role(i + 1) == "reuse":
            kept |= _with_sources(a, i + 1)
            break
    return kept


def _with_sources(a: ModelArgs, i: int) -> set[int]:
    """Layer ``i`` and the layers it reads: its KV source, its index source, the candidate source."""
    out = {i}
    if a.ratios[i]:
        out |= {a.kv_source(i), a.index_source(i)}
        if a.uses_candidates(i):
            out |= {a.candidate_source_layer_id}
    return out


def _spread(items: list[int]) -> list[int]:
    """``items`` in an order that covers their span evenly first (halves, quarters, ...)."""
    order, seen, step = [], set(), len(items)
    while step >= 1:
        for k in range(0, len(items), step):
            if k not in seen:
                seen.add(k)
                order.append(items[k])
        step //= 2
    return order


def _renumbered(a: ModelArgs, kept: list[int]) -> ModelArgs:
    new = {old: i for i, old in enumerate(kept)}
    engram = [(new[layer], rows) for layer, rows in zip(a.engram_layer_ids, a.engram_num_embeddings) if layer in new]
    targets = tuple(range(len(kept) - len(a.dspark_target_layer_ids), len(kept)))  # the last layers, as in V4.1
    c = a.candidate_source_layer_id
    return a.replace(
        num_hidden_layers=len(kept),
        compress_ratios=tuple(a.compress_ratios[i] for i in kept) + tuple(a.compress_ratios[a.num_hidden_layers:]),
        kv_source_layer_ids=tuple(new[s] for s in a.kv_source_layer_ids if s in new),
        index_source_layer_ids=tuple(new[s] for s in a.index_source_layer_ids if s in new),
        candidate_source_layer_id=new.get(c, -1) if c >= 0 else c,
        engram_layer_ids=tuple(layer for layer, _ in engram), engram_num_embeddings=tuple(r for _, r in engram),
        dspark_target_layer_ids=targets if a.num_nextn_predict_layers else a.dspark_target_layer_ids)


def _engram_rows(a: ModelArgs, rows: int) -> ModelArgs:
    """Engram tables of about ``rows`` rows: the primes walked up from ``rows / columns``."""
    if not a.engram_layer_ids:
        return a
    start = max(2, rows // a.engram_n_cols)
    sums = _engram_sums(start, a.engram_n_heads, a.engram_max_ngram_size, a.engram_layer_ids)
    return a.replace(engram_vocab_size=start, engram_num_embeddings=sums)


# ----------------------------------------------------------------------------- presets

def _v41_flash() -> ModelArgs:
    return ModelArgs(vision=VisionArgs())


def _small() -> ModelArgs:
    """The V4.1 schedule (40 layers, same sources, window, top-k and candidate pool) at a
    width that fits one H200 in bf16: D=2048, 16 heads x 512, 64 experts top-6 of width
    768, engram tables of ~2.4M rows, the bundled 1024-token tokenizer: 12.9B backbone and
    14.6B total parameters (`dsagent model info --preset small`)."""
    base = ModelArgs()
    return base.replace(
        vocab_size=1024, hidden_size=2048, num_attention_heads=16, q_lora_rank=512,
        o_groups=4, o_lora_rank=512, index_n_heads=16, n_routed_experts=64,
        moe_intermediate_size=768, engram_vocab_size=100000,
        engram_num_embeddings=_engram_sums(100000, 8, 4, (1, 14)), engram_compressed_vocab_size=660,
        dspark_n_routed_experts=16, dspark_noise_token_id=7, image_token_id=8,  # bundled tokenizer ids
        vision=VisionArgs(num_hidden_layers=8, hidden_size=512, num_attention_heads=8, intermediate_size=1408))


def _tiny() -> ModelArgs:
    """CPU size with every kind of layer: 2 SWA layers (one with Engram), a ratio-2 encoder
    with two KV sources (Full/Reuse), a ratio-1 decoder with the candidate source, a
    Reindex layer and Reuse layers; full-size 512-dim latents so KV records keep the real
    byte layouts (528 / 288 / 68 B)."""
    return ModelArgs(
        vocab_size=1024, hidden_size=128, num_hidden_layers=10, num_attention_heads=4,
        head_dim=512, qk_rope_head_dim=64, q_lora_rank=64, o_groups=2, o_lora_rank=64,
        compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1), kv_source_layer_ids=(2, 4, 6),
        index_source_layer_ids=(2, 4, 6, 8), candidate_source_layer_id=6,
        candidate_topk_blocks=8, candidate_block_size=4, index_n_heads=4, index_head_dim=128,
        index_topk=16, sliding_window=128, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=128, engram_layer_ids=(1, 4), engram_n_heads=2, engram_head_dim=32,
        engram_vocab_size=1000, engram_num_embeddings=_engram_sums(1000, 2, 4, (1, 4)),
        engram_compressed_vocab_size=660, num_nextn_predict_layers=0, dspark_target_layer_ids=(7, 8, 9),
        dspark_n_routed_experts=4, dspark_num_experts_per_tok=2, dspark_markov_rank=32,
        dspark_noise_token_id=7, image_token_id=8,  # ids of </think> and the image token in the bundled tokenizer
        vision=VisionArgs(num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                          intermediate_size=128, max_image_tokens=64, min_pixels=126 * 126))


def _engram_sums(vocab: int, heads: int, max_ngram: int, layers: tuple) -> tuple:
    return tuple(sum(sum(p) for p in layer) for layer in engram_primes(vocab, heads, max_ngram, len(layers)))


PRESETS = {"v41-flash": _v41_flash, "small": _small, "tiny": _tiny}
