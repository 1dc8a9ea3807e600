"""Build a ready-to-run Transformer from a preset name or a checkpoint directory.

Owns: choosing between preset (seeded random weights) and checkpoint, random weight
initialisation, which part of each whole tensor a rank holds (``rank_slices``: what it reads
of a checkpoint's shards, what it keeps of a seeded whole model), and binding the
tokenizer-derived Engram token map. Does not own the file format (``model.checkpoint``) or
the architecture (``model.model``).
"""
from __future__ import annotations

import math
from collections.abc import Container
from pathlib import Path

import torch

from model.args import PRESETS, ConfigError, ModelArgs
from model.engram import compressed_token_map, find_tokenizer_json
from model.linear import ALONE, FP4_BLOCK, Linear, Table, VocabEmbedding, World
from model.model import Transformer
from model.moe import stack_experts

BUNDLED_TOKENIZER = Path(__file__).parent / "assets" / "tokenizer" / "tokenizer.json"


WEIGHTS = ("plain", "packed")  # how a model holds the checkpoint's FP8 / FP4 families


def load(path_or_preset: str | Path, device="cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
         progress=None, weights: str = "plain", args: ModelArgs | None = None, world: World = ALONE,
         engram: str = "device") -> Transformer:
    """A preset name gives seeded random weights; a directory gives its checkpoint. ``weights``:
    ``plain`` dequantises the FP8 / FP4 families into ``dtype``; ``packed`` keeps them as the
    checkpoint stores them (``model.linear``). ``args``: the preset's, reshaped (fewer layers,
    smaller Engram tables: ``ModelArgs.shortened``). ``world``: this rank's part of the model
    (``docs/tensor-and-expert-parallel-design.md``): its slices read from a checkpoint's
    shards, or taken from the preset's seeded whole model; packed or plain. ``engram``: where
    the Engram tables are kept (``model.model.ENGRAM_PLACES``): on ``device`` (a rank its share
    of the rows) or whole in ``host`` memory (packed, from a checkpoint: the shards' memory maps)."""
    if weights not in WEIGHTS:
        raise ConfigError(f"weights must be one of {', '.join(WEIGHTS)}, not {weights!r}")
    if str(path_or_preset) in PRESETS:
        args = args or ModelArgs.preset(str(path_or_preset))
        model = build(args, device=device, dtype=dtype, seed=seed, weights=weights, world=world, engram=engram)
        tokenizer = BUNDLED_TOKENIZER if BUNDLED_TOKENIZER.is_file() else None
    else:
        path = Path(path_or_preset)
        if not path.is_dir():
            raise ConfigError(f"{path} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint directory")
        args = ModelArgs.from_file(path)
        sharded = (path / "model.safetensors.index.json").is_file()  # a single file holds floats: packed after
        model = build(args, device="meta", dtype=dtype, weights=weights if sharded else "plain", world=world,
                      engram=engram)
        load_weights(model, path, device=device, dtype=dtype, progress=progress)
        if weights == "packed" and not sharded:
            stack_experts(pack_weights(model))  # the float stacks let go, the FP4 experts stacked
        tokenizer = find_tokenizer_json(path)
    bind_tokenizer(model, tokenizer, preset=str(path_or_preset) in PRESETS)
    model.tokenizer_json = tokenizer  # the tokenizer its ids mean: written back with it, read by the scripts
    return model.eval()


def build(args: ModelArgs, device="cpu", dtype: torch.dtype = torch.float32, seed: int | None = 0,
          weights: str = "plain", world: World = ALONE, engram: str = "device") -> Transformer:
    """A model of ``args`` in ``dtype``: seeded random weights, routed experts stacked (see
    ``MoE.stack_experts``); on the meta device, shapes only (``load_weights`` fills it).
    ``weights="packed"``: the FP8 / FP4 families quantised as the checkpoint writer would,
    made part by part (each layer's float image alone in memory, then packed), the same
    values as a ``plain`` build packed whole. ``world``: this rank's part of that same seeded
    whole model (``local_state`` of it), made part by part too. ``engram="host"``: the Engram
    tables made in host memory (the same values: drawn on ``device``, then copied there)."""
    if str(device) == "meta":
        with torch.device("meta"):
            model = cast_model(Transformer(args, world, engram), dtype)
        return pack_weights(model) if weights == "packed" else model
    if weights == "plain" and world.size == 1:
        with torch.device(device):
            model = Transformer(args, engram=engram)
        init_weights(model, seed or 0)
        return stack_experts(cast_model(model, dtype))
    return _build_by_parts(args, device, dtype, seed or 0, weights, world, engram)


def _build_by_parts(args: ModelArgs, device, dtype: torch.dtype, seed: int, weights: str, world: World,
                    engram: str) -> Transformer:
    """The seeded whole model made one part at a time (``_parts``), in the order and rounding of
    ``init_weights`` and a cast, packed where ``weights`` says; over several ranks each part is
    cut to the rank's share (``local_state``) and let go, so memory holds one whole part at most."""
    with torch.device("meta"):
        model = cast_model(Transformer(args, world, engram), dtype)  # each part made in its dtype: one float copy at a time
        whole = model if world.size == 1 else cast_model(Transformer(args, engram=engram), dtype)
    if weights == "packed" and whole is not model:
        pack_weights(model)  # the rank's stored shapes (its slices must be whole blocks)
    held = None if whole is model else model.state_dict().keys()  # packed: the rank's only, it lets the rest go
    g = torch.Generator(device=device).manual_seed(seed)  # as init_weights: one stream, in name order
    for name, p in list(whole._parameters.items()):  # the model's own (image span vectors): first in that order
        setattr(whole, name, torch.nn.Parameter(torch.empty_like(p, device=device)))
        with torch.no_grad():
            getattr(whole, name).copy_(_init_value(name, getattr(whole, name), g).to(dtype))
        setattr(model, name, getattr(whole, name))
    for prefix, part in _parts(whole):
        part.to_empty(device=device)
        with torch.no_grad():
            for name, p in part.named_parameters(prefix=prefix):
                # rounded as a plain build's cast rounds: to dtype, and the fp32 families back from it
                p.copy_(_init_value(name, p, g).to(dtype))
        if weights == "packed":
            pack_weights(part, prefix, args, held)
        if whole is not model:
            mine = local_state(model, part.state_dict(prefix=f"{prefix}."))
            model.load_state_dict({k: v.clone(memory_format=torch.contiguous_format) for k, v in mine.items()},
                                  strict=False, assign=True)
            part.to_empty(device="meta")  # the whole part's floats let go
    model.ropes.make_on(device)
    return stack_experts(model)


def _parts(model: Transformer):
    """(name prefix, module) of every direct child, a layer list as its layers: with the
    model's own parameters they hold every parameter once, in ``named_parameters`` order."""
    for name, child in model.named_children():
        if isinstance(child, torch.nn.ModuleList):
            yield from ((f"{name}.{i}", layer) for i, layer in enumerate(child))
        else:
            yield name, child


def pack_weights(module: torch.nn.Module, prefix: str = "", args: ModelArgs | None = None,
                 held: Container[str] | None = None) -> torch.nn.Module:
    """Every ``model.linear.Linear`` and ``Table`` under ``module`` whose checkpoint family is
    FP8 or FP4 (``model.checkpoint.stored_format`` of its name) held packed, of those whose
    weight is in ``held`` when given; returns ``module``."""
    from model.checkpoint import stored_format

    args = args or module.args
    for name, m in module.named_modules(prefix=prefix):
        if isinstance(m, (Linear, Table)) and m.fmt == "plain" and (held is None or f"{name}.weight" in held):
            fmt = stored_format(f"{name}.weight", tuple(m.weight.shape), args.expert_dtype)
            if fmt in ("fp8", "fp4"):
                m.block = args.weight_block_size
                _check_whole_blocks(name, m, fmt)
                m.pack(fmt)
    return module


def _scale_block(fmt: str, block: int) -> tuple[int, int]:
    """The (rows, columns) one scale of a packed weight covers."""
    return (block, block) if fmt == "fp8" else (1, FP4_BLOCK)


def _split_dim(m: Linear) -> int:
    """The dim of the whole weight a split Linear's ranks share out: 1 (its inputs) for a row split."""
    return 1 if m.split == "row" else 0


def _check_whole_blocks(name: str, m: Linear | Table, fmt: str) -> None:
    """A rank's part of a weight held as stored is whole blocks, so its scales slice with it
    (``docs/tensor-and-expert-parallel-design.md``, constraints)."""
    if not isinstance(m, Linear) or m.split is None or m.world.size == 1:
        return
    dim = _split_dim(m)
    share, step = (m.out_features, m.in_features)[dim], _scale_block(fmt, m.block)[dim]
    if share % step:
        whole, what = (m.full_out, m.full_in)[dim], ("rows", "columns")[dim]
        raise ConfigError(f"{name}.weight: a rank's {share} of its {whole} {what} (over {m.world.size} ranks) "
                          f"are not whole {step}-blocks of its {fmt.upper()} scales, so it cannot be held packed; "
                          f"load plain weights, or over a number of ranks that leaves each rank whole blocks")


def cast_model(model: torch.nn.Module, dtype: torch.dtype, prefix: str = "") -> torch.nn.Module:
    """Cast to ``dtype`` but keep the tensors the checkpoint stores in F32 (hc, sinks, gate biases)."""
    model.to(dtype)
    for name, p in model.named_parameters(prefix=prefix):
        if keeps_fp32(name):
            p.data = p.data.float()
    return model


def keeps_fp32(name: str) -> bool:
    """The tensors a model of any dtype holds in fp32: the mHC mixes, the attention sinks and
    the router's balance biases — not the ViT's and aligner's Linear biases, which are added
    to products in the model's dtype."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf.startswith("hc_") or leaf == "attn_sink" or name.endswith(("gate.bias", "gate.bias_vl"))


def stand_in_token_map(args: ModelArgs) -> list[int]:
    """A preset's Engram token map where the bundled tokenizer has fewer ids than its vocabulary
    (``v41-flash``): id i to compressed id i mod the compressed vocabulary, the real map's shape."""
    return [i % args.engram_compressed_vocab_size for i in range(args.vocab_size)]


def bind_tokenizer(model: Transformer, tokenizer_json: Path | None, preset: bool = False) -> None:
    """The Engram token map of ``tokenizer_json``; a ``preset`` of more ids than it has (``v41-flash``'s
    129K against the bundled 1,024) gets :func:`stand_in_token_map` instead."""
    if not model.args.engram_layer_ids:
        return
    if tokenizer_json is None:
        raise ConfigError("this model has Engram layers and needs its tokenizer (tokenizer/tokenizer.json)")
    token_map, _ = compressed_token_map(tokenizer_json)
    if preset and len(token_map) < model.args.vocab_size:
        token_map = stand_in_token_map(model.args)
    model.bind_token_map(token_map)


@torch.no_grad()
def init_weights(model: torch.nn.Module, seed: int, prefix: str = "", device=None) -> None:
    """Seeded random weights with sane scales: N(0, 1/fan_in) linears, unit norms, small hc.
    The generator lives on the model's device (fast for GPU-sized presets), so the same seed
    gives other weights on another device type; the fingerprint records it. ``prefix``: the
    module's place in a model (its parameters are named as there, e.g. ``mtp.``);
    ``device``: where the generator lives when ``model`` has no ``device`` of its own."""
    g = torch.Generator(device=device or model.device).manual_seed(seed)
    for name, p in model.named_parameters():
        p.copy_(_init_value(prefix + name, p, g))


def _init_value(name: str, p: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """``p``'s seeded value, drawn on ``g``'s device (a table in host memory: copied there after)."""
    leaf = name.rsplit(".", 1)[-1]
    shape, dev = p.shape, g.device
    if leaf in ("bias", "bias_vl", "attn_sink") or leaf.endswith("_base"):
        return torch.zeros(shape, device=dev)
    if leaf.endswith("_scale") or leaf in ("q_weight", "k_weight") or "norm" in name:
        return torch.ones(shape, device=dev)
    noise = torch.randn(shape, generator=g, device=dev)
    if leaf.endswith("_fn"):
        return noise * 0.02
    if name.endswith("embed.weight"):
        return noise
    return noise / math.sqrt(shape[-1])


def expected_shapes(model: Transformer) -> dict[str, tuple[int, ...]]:
    """Official name -> logical shape: a packed weight as the float weight it stands for, its
    scale not listed (the checkpoint reader pairs it with its weight)."""
    packed, owners = _packed_modules(model), _owners(model)
    out = {}
    for k, v in model.state_dict().items():
        m = owners.get(k)
        if k.endswith(".scale") and k.removesuffix(".scale") + ".weight" in packed:
            continue
        if k.endswith(".weight") and isinstance(m, Linear):
            out[k] = (m.full_out, m.full_in)
        elif isinstance(m, VocabEmbedding):
            out[k] = (model.args.vocab_size, v.shape[1])
        elif isinstance(m, Table):
            out[k] = (m.full_rows, v.shape[1])
        elif k.endswith(".attn_sink"):
            out[k] = (model.args.num_attention_heads,)
        else:
            out[k] = tuple(v.shape)
    return out


def _owners(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Parameter name -> the module that holds it."""
    return {f"{n}.{k}" if n else k: m for n, m in model.named_modules() for k in m._parameters}


def _packed_modules(model: torch.nn.Module) -> dict[str, Linear | Table]:
    """Weight name -> the packed Linear or Table that holds it."""
    return {f"{n}.weight": m for n, m in model.named_modules()
            if isinstance(m, (Linear, Table)) and m.fmt != "plain"}


def load_weights(model: Transformer, path: Path, device="cpu", dtype=torch.float32, progress=None) -> None:
    """Fill a meta-device model from an official checkpoint directory (sharded or single file),
    one layer group at a time, each tensor copied to ``device`` as it is read and dequantised
    there (a table kept in host memory read to the host), so peak memory is the model in
    ``dtype`` plus one group, and on a GPU the host holds about one shard
    (``model.checkpoint.iter_checkpoint``). A packed Linear takes the stored bytes and scales as
    they are; every other tensor is dequantised. Over several ranks a rank asks the shards for
    its slices only (``rank_slices``) and for none of other ranks' experts."""
    expected, packed = expected_shapes(model), _packed_modules(model)
    host = {f"{n}.{k}": "cpu" for n, m in model.named_modules() if isinstance(m, Table) and m.host for k in m._parameters}
    if (path / "model.safetensors.index.json").is_file():
        from model.checkpoint import iter_checkpoint

        slices = {name: part for name, part in rank_slices(model).items() if name in expected}
        groups = iter_checkpoint(path, expected, dtype=dtype, device=device, progress=progress,
                                 ignore_prefixes=_unbuilt_prefixes(model) + _other_ranks(model),
                                 compressed=bool(packed), parts=slices, devices=host)
    else:
        groups = [("all", local_state(model, _read_single_file(path, expected)))]
    for _, tensors in groups:
        if packed:
            tensors = _unpacked_but(tensors, packed, expected, model.args, dtype)
        tensors = {k: v.to(host.get(k, device)) if _is_stored(k, packed) else
                   v.to(host.get(k, device), torch.float32 if keeps_fp32(k) else dtype) for k, v in tensors.items()}
        model.load_state_dict(tensors, strict=False, assign=True)
    left = [n for n, p in model.named_parameters() if p.is_meta]
    assert not left, f"checkpoint reader left parameters unloaded: {left[:5]}"
    model.ropes.make_on(device)  # its fp32 tables, made where the weights now live
    stack_experts(model.to(device))  # after the loads: each assigning load would stack again


def _is_stored(name: str, packed: dict) -> bool:
    """A packed Linear's weight or scale: kept in its stored dtype."""
    return name in packed or name.removesuffix(".scale") + ".weight" in packed


def _unpacked_but(tensors: dict, packed: dict, expected: dict, args: ModelArgs, dtype) -> dict:
    """A group read as stored, with every packed family that no packed Linear holds dequantised
    (the Engram tables and projection, the vision tower's)."""
    from model.checkpoint import dequantize_tensor, scale_name, stored_format

    out = {}
    for name, t in tensors.items():
        if name.endswith(".scale") or name in packed:
            if name.endswith(".scale") and name.removesuffix(".scale") + ".weight" not in packed:
                continue  # read with its weight below
            out[name] = t
            continue
        fmt = stored_format(name, expected[name], args.expert_dtype)
        scale = tensors.get(scale_name(name))
        out[name] = t if scale is None else dequantize_tensor(fmt, t, scale, expected[name],
                                                              block=args.weight_block_size, dtype=dtype)
    return out


def local_state(model: Transformer, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A rank's part of whole tensors ``full`` (a whole model's state dict, float or packed, or
    one part of it) for ``model`` (built over its world): each name's slice of ``rank_slices``,
    the rest whole; names the rank does not hold (other ranks' experts) left out. The slices
    are views of ``full``."""
    slices, held = rank_slices(model), model.state_dict().keys()
    out = {}
    for name, t in full.items():
        if name not in held:
            continue
        if name in slices:
            dim, start, stop = slices[name]
            t = t.narrow(dim, start, stop - start)
        out[name] = t
    return out


def rank_slices(model: Transformer) -> dict[str, tuple[int, int, int]]:
    """Official name -> (dim, start, stop): the rows (dim 0) or columns (dim 1) of a whole tensor
    that ``model``'s rank holds (``docs/tensor-and-expert-parallel-design.md``): each split
    Linear's weight (a packed one's scale by the blocks of its part), the embedding's vocabulary
    rows, an Engram table's rows, the sinks of its heads. A name not listed is held whole, or not at all (other ranks'
    experts, ``_other_ranks``). Empty for one process alone."""
    if model.world.size == 1:
        return {}
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, Linear) and m.split is not None:
            out.update(_linear_slices(name, m))
        elif isinstance(m, VocabEmbedding):
            out[f"{name}.weight"] = (0, m.rows.start, m.rows.stop)
        elif isinstance(m, Table) and m.world.size > 1:  # its rows, and a packed one's scales: one a row
            out.update({f"{name}.{k}": (0, m.rows.start, m.rows.stop) for k in m._parameters})
    heads = model.world.part(model.args.num_attention_heads, "num_attention_heads")
    out.update({name: (0, heads.start, heads.stop) for name, _ in model.named_parameters()
                if name.endswith(".attn_sink")})
    return out


def _linear_slices(name: str, m: Linear) -> dict[str, tuple[int, int, int]]:
    """A split Linear's part of its whole weight, and of a packed one's scales."""
    dim = _split_dim(m)
    part = m.world.part((m.full_out, m.full_in)[dim], ("output features", "input features")[dim])
    out = {f"{name}.weight": (dim, part.start, part.stop)}
    if m.fmt != "plain":
        assert m.fmt == "fp8" or dim == 0, "a packed FP4 weight splits by rows (a byte holds two columns)"
        step = _scale_block(m.fmt, m.block)[dim]
        out[f"{name}.scale"] = (dim, part.start // step, -(-part.stop // step))
    return out


def _other_ranks(model: Transformer) -> tuple:
    """The routed experts other ranks hold (checkpoint name prefixes), for a rank's reader to skip."""
    if model.world.size == 1:
        return ()
    out = []
    for i, block in enumerate(model.layers):
        mine = block.ffn.experts
        out += [f"layers.{i}.ffn.experts.{e}." for e in range(model.args.n_routed_experts) if e not in mine]
    for k, stage in enumerate(getattr(model, "mtp", ())):
        mine = stage.ffn.experts
        out += [f"mtp.{k}.ffn.experts.{e}." for e in range(model.args.dspark_n_routed_experts) if e not in mine]
    return tuple(out)


def _unbuilt_prefixes(model: Transformer) -> tuple:
    """Checkpoint families this build does not use (draft stages it did not build; vision without a tower)."""
    drafts = () if hasattr(model, "mtp") else ("mtp.",)
    return drafts if model.args.vision is not None else drafts + ("vision.", "aligner.", "image_")


def _read_single_file(path: Path, expected: dict) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    file = path / "model.safetensors"
    if not file.is_file():
        raise ConfigError(f"{path} has neither model.safetensors.index.json nor model.safetensors")
    try:
        tensors = {k: v for k, v in load_file(str(file)).items() if k in expected}
    except Exception as e:  # safetensors' own error types: a header or data cut short, not a safetensors file
        raise ConfigError(f"{file} does not read as safetensors ({e}); copy the checkpoint again") from None
    missing = sorted(set(expected) - set(tensors))
    bad = [f"{k}: {tuple(v.shape)} != {expected[k]}" for k, v in tensors.items() if tuple(v.shape) != expected[k]]
    if missing or bad:
        raise ConfigError(f"{file}: missing {missing[:20]} mis-shaped {bad[:20]}")
    return {k: v.float() for k, v in tensors.items()}


def fingerprint(model: Transformer, source: str | Path, seed: int = 0) -> str:
    """Identity of what a KV cache depends on: architecture, weights, tokenizer, KV format.
    A checkpoint's weights are identified by its index/config files and shard sizes (cheap;
    not its training record, ``TRAINING.json``, whose notes say nothing a cache depends on);
    a preset by its name and seed."""
    import hashlib
    import json

    from model.cache import FORMAT_VERSION

    h = hashlib.sha256()
    h.update(json.dumps(model.args.to_config(), sort_keys=True, default=str).encode())
    h.update(f"kv-format:{FORMAT_VERSION}".encode())
    path = Path(source)
    if str(source) in PRESETS:  # random weights depend on the generator of the init device
        h.update(f"preset:{source}:seed:{seed}:init:{model.device.type}".encode())
        tok = BUNDLED_TOKENIZER
    else:
        files = [f for f in sorted(path.glob("*.json")) if f.name != "TRAINING.json"]
        for f in files + sorted(path.glob("*.safetensors")):
            h.update(f.name.encode() + str(f.stat().st_size).encode())
            if f.suffix == ".json":
                h.update(f.read_bytes())
        tok = find_tokenizer_json(path)
    if tok is not None and tok.is_file():
        h.update(tok.read_bytes())
    return h.hexdigest()
