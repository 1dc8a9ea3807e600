"""Parameter and KV census of a V4.1 config, counted from real module shapes.

Owns ``census(args)``: the numbers behind ``dsagent model info``; ``decode_read_bytes`` (what
a decode step reads) and ``prefill_flops`` (what a prefill computes, by part) for the
benchmarks. The backbone is built as :class:`model.model.Transformer` on the ``meta`` device
(no memory, no weights) and its parameters are counted by official name. Does not own: reading checkpoints (the dtype
census of a directory is ``model.checkpoint.census``), printing (the CLI renders).

Definitions (ARCHITECTURE.md §5.3):

- **backbone**: ``embed``, ``head``, the final ``norm`` and every ``layers.*`` parameter
  except the Engram ones (``layers.N.engram.*``).
- **engram**: every ``layers.N.engram.*`` parameter: the hashed tables (``engram.embed``)
  and their projections (``engram.wkv``, ``q_weight``, ``k_weight``).
- **vision**: the ViT, the aligner and the three image vectors (``vision.*``,
  ``aligner.*``, ``image_*``), built by the Transformer when the config has a vision part.
- **dspark**: the draft stages ``mtp.*`` the Transformer builds when the config has
  ``num_nextn_predict_layers``. ``params_total`` = backbone + engram + vision + dspark.
- **active per decoded token**: every backbone parameter a token touches: for each layer
  its attention (with the CSA2 compressor / indexer it owns), mHC, router, shared expert
  and ``num_experts_per_tok`` routed experts; the ``head`` and final ``norm``; one
  embedding row; and for each Engram layer its projections plus the ``n_cols`` table rows
  it reads. DSpark drafting and vision are not counted (they are separate passes).
- **active per prefilled token** (amortised over a long prompt): the encoder layers
  (``i < args.decoder_start``) as above, one embedding row, and the decoder KV source's
  projection of the encoder output (its ``attn_norm``, ``compressor.*``, ``indexer.wk`` /
  ``k_norm`` and, if it has one, its Engram). The decoder layers run only on the last
  ``sliding_window`` tokens and the head only on the last token, so they amortise to zero.

The routed experts make a full meta build slow (~46K modules for ``v41-flash``). The
model is therefore built with only ``num_experts_per_tok`` routed experts and every
layer's ``ffn.*`` entries are taken from one real ``MoE(args)``: ``MoE`` takes no layer
argument, so all layers share its shapes (``tests/test_census.py`` checks this against a
full build of ``tiny``).
"""
from __future__ import annotations

import re

import torch

from model.args import ModelArgs, engram_primes
from model.checkpoint import FP4_BLOCK, fp8_block_shape, stored_format
from model.linear import World
from model.loading import keeps_fp32
from model.model import Transformer
from model.moe import MoE
from model.quant import index_record_bytes, main_record_bytes, window_record_bytes

_LAYER = re.compile(r"layers\.(\d+)\.(.*)")


# ----------------------------------------------------------------------------- counting

def backbone_shapes(args: ModelArgs) -> dict[str, torch.Size]:
    """The shape of each parameter of ``Transformer(args)`` by name, from modules built on meta."""
    with torch.device("meta"):
        model = Transformer(args.replace(n_routed_experts=args.num_experts_per_tok))
        ffn = {name: p.shape for name, p in MoE(args).named_parameters()}
    shapes = {name: p.shape for name, p in model.named_parameters()
              if ".ffn." not in name or name.startswith("mtp.")}  # draft stages keep their real MoE
    for i in range(args.num_hidden_layers):
        shapes.update({f"layers.{i}.ffn.{name}": shape for name, shape in ffn.items()})
    return shapes


def backbone_counts(args: ModelArgs) -> dict[str, int]:
    """Elements per parameter name of ``Transformer(args)`` (:func:`backbone_shapes`)."""
    return {name: shape.numel() for name, shape in backbone_shapes(args).items()}


def part_of(name: str) -> str:
    """The census part of one official parameter name."""
    if name.startswith("embed."):
        return "embed"
    if name.startswith(("vision.", "aligner.", "image_")):
        return "vision"
    if name.startswith(("head.", "norm.")):
        return "head"
    if name.startswith("mtp."):
        return "dspark"
    rest = _LAYER.fullmatch(name).group(2)
    prefixes = (("engram.embed.", "engram_tables"), ("engram.", "engram_proj"),
                ("attn.compressor.", "csa2_sources"), ("attn.indexer.", "csa2_sources"),
                ("attn.", "attention"), ("attn_norm.", "attention"), ("hc_", "mhc"),
                ("ffn.experts.", "routed_experts"), ("ffn.shared_experts.", "shared_expert"))
    return next((part for prefix, part in prefixes if rest.startswith(prefix)), "router")


def _by_layer(counts: dict) -> dict[int, dict]:
    """Layer number -> {name within the layer: value} of ``counts`` (any values: counts, shapes)."""
    layers: dict[int, dict] = {}
    for name, n in counts.items():
        m = _LAYER.fullmatch(name)
        if m:
            layers.setdefault(int(m.group(1)), {})[m.group(2)] = n
    return layers


def _expert_params(layer: dict[str, int]) -> int:
    """Parameters of one routed expert of this layer (expert 0; all share its shapes)."""
    return sum(n for name, n in layer.items() if name.startswith("ffn.experts.0."))


def _layer_active(args: ModelArgs, layer: dict[str, int]) -> int:
    """What one token touches in one layer (see the module docstring)."""
    fixed = sum(n for name, n in layer.items()
                if not name.startswith(("ffn.experts.", "engram.embed.")))
    rows = args.engram_n_cols * args.engram_head_dim if "engram.embed.weight" in layer else 0
    return fixed + args.num_experts_per_tok * _expert_params(layer) + rows


def _source_projection(args: ModelArgs, layer: dict[str, int]) -> int:
    """The decoder KV source's work on a prefilled token: project the encoder output."""
    keep = ("attn_norm.", "attn.compressor.", "attn.indexer.wk.", "attn.indexer.k_norm.", "engram.wkv.",
            "engram.q_weight", "engram.k_weight")
    rows = args.engram_n_cols * args.engram_head_dim if "engram.embed.weight" in layer else 0
    return sum(n for name, n in layer.items() if name.startswith(keep)) + rows


# ----------------------------------------------------------------------------- census

def _layer_rows(args: ModelArgs, layers: dict[int, dict[str, int]]) -> list[dict]:
    rows = []
    for i in range(args.num_hidden_layers):
        rows.append({
            "index": i, "ratio": args.ratios[i], "role": args.role(i), "kv_source": args.kv_source(i),
            "index_source": args.index_source(i), "candidates": args.uses_candidates(i),
            "candidate_source": i == args.candidate_source_layer_id, "engram": i in args.engram_layer_ids,
            "part": "encoder" if i < args.decoder_start else "decoder",
            "params": sum(layers[i].values()), "params_active_decode": _layer_active(args, layers[i])})
    return rows


def _engram_rows(args: ModelArgs, layers: dict[int, dict[str, int]]) -> list[dict]:
    primes = engram_primes(args.engram_vocab_size, args.engram_n_heads, args.engram_max_ngram_size,
                           len(args.engram_layer_ids))
    rows = []
    for slot, layer in enumerate(args.engram_layer_ids):
        primes_sum = sum(sum(p) for p in primes[slot])
        rows_built = layers[layer]["engram.embed.weight"] // args.engram_head_dim
        rows.append({"layer": layer, "primes_sum": primes_sum, "num_embeddings": rows_built,
                     "match": primes_sum == rows_built == args.engram_num_embeddings[slot]})
    return rows


def _whole(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x


def census(args: ModelArgs) -> dict:
    """Parameter counts, KV bytes and the layer schedule of ``args`` (definitions above)."""
    counts = backbone_counts(args)
    layers = _by_layer(counts)
    parts: dict[str, int] = {}
    for name, n in counts.items():
        parts[part_of(name)] = parts.get(part_of(name), 0) + n
    engram = parts.get("engram_tables", 0) + parts.get("engram_proj", 0)
    vision, dspark = parts.get("vision", 0), parts.get("dspark", 0)
    backbone = sum(counts.values()) - engram - vision - dspark
    head = parts["head"]
    decode = head + args.hidden_size + sum(_layer_active(args, layers[i]) for i in layers)
    prefill = args.hidden_size + sum(_layer_active(args, layers[i]) for i in layers if i < args.decoder_start)
    if args.decoder_start < args.num_hidden_layers:
        prefill += _source_projection(args, layers[args.decoder_start])
    return {
        "params_total": backbone + engram + dspark + vision,
        "params_backbone": backbone, "params_engram": engram, "params_dspark": dspark,
        "params_vision": vision, "params_active_decode": decode, "params_active_prefill": prefill,
        "params_by_part": parts,
        "kv_global_bytes_per_token": _whole(args.kv_bytes_per_token()),
        "kv_window_bytes": args.num_hidden_layers * args.sliding_window * window_record_bytes(args.head_dim),
        "layers": _layer_rows(args, layers),
        "engram_tables": _engram_rows(args, layers),
    }


def decode_read_bytes(args: ModelArgs, ctx: int, weight_bytes: int = 2) -> dict[str, int]:
    """Bytes one batch-1 decode step reads at ``ctx`` tokens of context: the active weights
    (``params_active_decode`` at ``weight_bytes`` each), every layer's FP8 window rows, the
    FP4 records each sparse layer selects (top-k of its source's records) and the FP4 index
    keys each Full / Reindex layer scores (every visible one, as the step does; a layer that
    honours the candidate pool, the pool's records alone)."""
    window = records = index = 0
    for layer in range(args.num_hidden_layers):
        window += min(ctx, args.sliding_window) * window_record_bytes(args.head_dim)
        role = args.role(layer)
        if role == "swa":
            continue
        n = ctx // args.ratios[args.kv_source(layer)]
        records += min(args.index_topk, n) * main_record_bytes(args.head_dim)
        if role in ("full", "reindex"):
            pool = args.candidate_topk_blocks * args.candidate_block_size if args.uses_candidates(layer) else n
            index += min(n, pool) * index_record_bytes(args.index_head_dim)
    weights = census(args)["params_active_decode"] * weight_bytes
    return {"weights": weights, "window": window, "records": records, "index_keys": index,
            "total": weights + window + records + index}


# ----------------------------------------------------------------------------- prefill FLOPs

# a layer's projections by the part of a prefill they count in (the rest of its matrices: "linear")
_FLOP_PARTS = (("attn.compressor.", "compressor"), ("attn.indexer.wk.", "compressor"), ("hc_", "mhc"),
               ("ffn.gate.", "router"))


def prefill_flops(args: ModelArgs, tokens: int, mode: str = "ced", start: int = 0) -> dict:
    """The model FLOPs of a prefill of ``tokens`` new tokens at positions [start, start +
    tokens), in ``mode`` "exact" (every layer on every token) or "ced" (the encoder layers on
    every token, the decoder's KV source projecting every token, the decoder layers on the
    last ``sliding_window``, whose window then holds those alone), counted from the config:
    what the algorithm needs, not what a kernel happens to compute (masked entries, padding
    and dequantisation are not counted).
    A multiply-add is 2 FLOPs. -> {"total": ..., "by_part": {part: FLOPs}} with the parts:
    - ``linear``: every projection a token runs through (attention, the indexer's query and
      head weights, shared and ``num_experts_per_tok`` routed experts, Engram; the ``head``
      on the last token);
    - ``compressor``: the KV sources' ``wkv`` / ``wgate`` on every token, the index key's
      ``wk`` on every record made, and the pooling of each record's ``ratio`` tokens;
    - ``attention``: Q·K and P·V over each query's window entries (up to ``sliding_window``,
      itself included) and its selected records (up to ``index_topk`` of those it sees; in a
      layer that honours the candidate pool, of the pool's);
    - ``indexer``: the weighted-ReLU scores of each Full / Reindex layer's query against
      every index key it sees (the pool's, where it honours the pool);
    - ``mhc``: the two sites' stream projections (``hc_*_fn``); ``router``: the gate."""
    if mode not in ("ced", "exact"):
        raise ValueError(f"prefill mode must be 'ced' or 'exact', not {mode!r}")
    shapes = backbone_shapes(args)
    layers = _by_layer(shapes)
    ced = mode == "ced" and args.supports_ced
    end = start + tokens
    parts = dict.fromkeys(("linear", "compressor", "attention", "indexer", "mhc", "router"), 0)
    for i in range(args.num_hidden_layers):
        if i in args.kv_source_layer_ids:  # a source makes its records from every token, in either mode
            ratio = args.ratios[i]
            _add(parts, _source_flops(args, i, layers[i], tokens, end // ratio - start // ratio))
        if ced and i >= args.decoder_start:
            if i == args.decoder_start:  # its Engram on every token, for the source's input; again in the replay
                _add(parts, {p: f * tokens for p, f in _matrix_flops(layers[i], ("engram.wkv.",)).items()})
            first = max(start, end - args.sliding_window)  # the decoder replay
        else:
            first = start
        # the decoder replay's window holds the replayed tokens alone when it starts past the new
        # tokens' first (the decoder never saw the ones before); else every earlier position's
        _add(parts, _layer_flops(args, i, layers[i], torch.arange(first, end, dtype=torch.int64),
                                 first if first > start else 0))
    parts["linear"] += 2 * shapes["head.weight"].numel() * min(tokens, 1)
    return {"mode": "ced" if ced else "exact", "tokens": tokens, "start": start,
            "total": sum(parts.values()), "by_part": parts}


def _add(parts: dict, more: dict) -> None:
    for k, v in more.items():
        parts[k] += v


def _matrix_flops(layer: dict[str, torch.Size], prefixes: tuple, exclude: tuple = ()) -> dict[str, int]:
    """2 x elements of each matrix of ``layer`` whose name starts with one of ``prefixes``
    (every one when empty) and with none of ``exclude``, by part (:data:`_FLOP_PARTS`)."""
    out: dict[str, int] = {}
    for name, shape in layer.items():
        product = name.endswith(".weight") or (name.startswith("hc_") and name.endswith("_fn"))
        if not product or len(shape) != 2 or not name.startswith(prefixes or ("",)) or name.startswith(exclude):
            continue
        part = next((p for prefix, p in _FLOP_PARTS if name.startswith(prefix)), "linear")
        out[part] = out.get(part, 0) + 2 * shape.numel()
    return out


def _source_flops(args: ModelArgs, i: int, layer: dict[str, torch.Size], tokens: int, records: int) -> dict[str, int]:
    """What KV source layer ``i`` spends making ``records`` records and index keys from
    ``tokens`` tokens: its compressor's projections on each token, each record's ``wk`` and pooling."""
    ratio = args.ratios[i]
    out = {part: f * tokens for part, f in _matrix_flops(layer, ("attn.compressor.",)).items()}
    wk = _matrix_flops(layer, ("attn.indexer.wk.",)).get("compressor", 0)
    pool = 3 * ratio * args.head_dim if ratio > 1 else 0  # the softmax-gated sum of a group
    _add(out, {"compressor": records * (wk + pool)})
    return out


def _layer_flops(args: ModelArgs, i: int, layer: dict[str, torch.Size], pos: torch.Tensor,
                 known: int = 0) -> dict[str, int]:
    """Layer ``i`` run on the tokens at ``pos`` (int64): its projections on each (its KV
    source's apart, :func:`_source_flops`), its attention and its indexer's scores at each
    position; its window holds the entries of positions from ``known`` on."""
    n, ratio = len(pos), args.ratios[i]
    per_token = _matrix_flops(layer, (), ("engram.embed.", "attn.compressor.", "attn.indexer.wk.", "ffn.experts."))
    per_token["linear"] += args.num_experts_per_tok * sum(_matrix_flops(layer, ("ffn.experts.0.",)).values())
    out = {part: f * n for part, f in per_token.items()}
    keys = (pos - known).clamp(max=args.sliding_window - 1) + 1  # window entries, itself included
    if ratio:
        seen = (pos + 1) // ratio  # records visible
        # the candidate pool (a Reuse layer reads its index source's): the newest block
        # (pinned, maybe partial) and the best others
        if args.uses_candidates(args.index_source(i)):
            block, n_blocks = args.candidate_block_size, args.candidate_topk_blocks
            newest = seen - (seen - 1).clamp(min=0) // block * block
            seen = torch.where(seen > n_blocks * block, (n_blocks - 1) * block + newest, seen)
        keys = keys + seen.clamp(max=args.index_topk)
        if args.role(i) in ("full", "reindex"):
            _add(out, {"indexer": 2 * args.index_n_heads * (args.index_head_dim + 1) * int(seen.sum())})
    _add(out, {"attention": 4 * args.num_attention_heads * args.head_dim * int(keys.sum())})
    return out


def _add(parts: dict, more: dict) -> None:
    for k, v in more.items():
        parts[k] = parts.get(k, 0) + v


# ----------------------------------------------------------------------------- bytes a rank holds

def rank_bytes(args: ModelArgs, ranks: int = 1, *, packed: bool = True, float_bytes: int = 2) -> dict[str, int]:
    """Bytes of weights one rank of ``ranks`` holds (tensor parallel = expert parallel =
    ``ranks``, ``model.linear.World``): each parameter as stored — ``packed``: the FP8 / FP4
    families as the checkpoint stores them (e4m3 bytes + a ue8m0 scale a block; e2m1 pairs +
    a scale a 32), else dequantised to ``float_bytes`` — times the share of it a rank holds
    (read off a build over the world on the meta device: the split projections, vocabulary
    and attention sinks; the routed experts, the draft stages' too, 1 / ``ranks`` of them; the
    rest whole). The Engram tables are given apart: ``engram_tables`` whole (one copy in host
    memory), ``engram_share`` the rows rank 0 holds where the ranks split them (the largest)."""
    # few routed experts (a multiple of ranks, at least the top-k): the build is quick, and they
    # are counted apart, 1 / ranks of the real ones
    small = args.replace(n_routed_experts=ranks * -(-args.num_experts_per_tok // ranks))
    with torch.device("meta"):
        whole = dict(Transformer(small).named_parameters())
        mine = {k: p.numel() for k, p in Transformer(small, World(0, ranks)).named_parameters()}
        ffn = {name: p.shape for name, p in MoE(args).named_parameters()}  # the router's shapes follow the experts'
    expert = {name.removeprefix("experts.0."): shape for name, shape in ffn.items() if name.startswith("experts.0.")}
    out = {"ranks": ranks, "backbone": 0, "routed_experts": 0, "engram_tables": 0, "engram_share": 0, "vision": 0,
           "dspark": 0}
    for name, p in whole.items():
        if ".ffn.experts." in name:
            continue
        shape = ffn[name.split(".ffn.", 1)[1]] if ".ffn." in name and name.startswith("layers.") else p.shape
        size = _stored_bytes(name, shape, args, packed, float_bytes)
        part = part_of(name)
        key = {"engram_tables": "engram_tables", "vision": "vision", "dspark": "dspark"}.get(part, "backbone")
        share = size * mine.get(name, 0) // p.numel()
        out[key] += size if key == "engram_tables" else share
        out["engram_share"] += share if key == "engram_tables" else 0
    per_expert = sum(_stored_bytes(f"layers.0.ffn.experts.0.{n}", s, args, packed, float_bytes)
                     for n, s in expert.items())
    out["routed_experts"] = args.num_hidden_layers * per_expert * args.n_routed_experts // ranks
    per_draft = sum(_stored_bytes(f"mtp.0.ffn.experts.0.{n}", s, args, packed, float_bytes) for n, s in expert.items())
    out["dspark"] += args.num_nextn_predict_layers * per_draft * args.dspark_n_routed_experts // ranks
    out["gpu_total"] = out["backbone"] + out["routed_experts"] + out["vision"] + out["dspark"]
    return out


def _stored_bytes(name: str, shape, args: ModelArgs, packed: bool, float_bytes: int) -> int:
    """One parameter's bytes as a model holds it (``model.loading``: packed families as stored,
    the fp32 ones in fp32, the rest in ``float_bytes``)."""
    numel = int(torch.Size(shape).numel())
    fmt = stored_format(name, tuple(shape), args.expert_dtype)
    if not packed or fmt not in ("fp8", "fp4"):
        return numel * (4 if keeps_fp32(name) or fmt == "f32" else float_bytes)
    if fmt == "fp4":
        return numel // 2 + -(-numel // FP4_BLOCK)
    rows, cols = fp8_block_shape(name, args.weight_block_size)
    return numel + -(-shape[0] // rows) * -(-shape[1] // cols)
