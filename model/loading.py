"""Build a ready-to-run Transformer from a preset name or a checkpoint directory.

Owns: choosing between preset (seeded random weights) and checkpoint, random weight
initialisation, and binding the tokenizer-derived Engram token map. Does not own the
file format (``model.checkpoint``) or the architecture (``model.model``).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from model.args import PRESETS, ConfigError, ModelArgs
from model.engram import compressed_token_map, find_tokenizer_json
from model.model import Transformer
from model.moe import stack_experts

BUNDLED_TOKENIZER = Path(__file__).parent / "assets" / "tokenizer" / "tokenizer.json"


def load(path_or_preset: str | Path, device="cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
         progress=None) -> Transformer:
    """A preset name gives seeded random weights; a directory gives its checkpoint."""
    if str(path_or_preset) in PRESETS:
        args = ModelArgs.preset(str(path_or_preset))
        model = build(args, device=device, dtype=dtype, seed=seed)
        tokenizer = BUNDLED_TOKENIZER if BUNDLED_TOKENIZER.is_file() else None
    else:
        path = Path(path_or_preset)
        if not path.is_dir():
            raise ConfigError(f"{path} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint directory")
        args = ModelArgs.from_file(path)
        model = build(args, device="meta", dtype=dtype)
        load_weights(model, path, device=device, dtype=dtype, progress=progress)
        tokenizer = find_tokenizer_json(path)
    bind_tokenizer(model, tokenizer)
    model.tokenizer_json = tokenizer  # the tokenizer its ids mean: written back with it, read by the scripts
    return model.eval()


def build(args: ModelArgs, device="cpu", dtype: torch.dtype = torch.float32, seed: int | None = 0) -> Transformer:
    """A model of ``args`` in ``dtype``: seeded random weights, routed experts stacked (see
    ``MoE.stack_experts``); on the meta device, shapes only (``load_weights`` fills it)."""
    with torch.device(device):
        model = Transformer(args)
    if str(device) == "meta":
        return cast_model(model, dtype)
    init_weights(model, seed or 0)
    return stack_experts(cast_model(model, dtype))


def cast_model(model: Transformer, dtype: torch.dtype) -> Transformer:
    """Cast to ``dtype`` but keep the tensors the checkpoint stores in F32 (hc, sinks, gate biases)."""
    model.to(dtype)
    for name, p in model.named_parameters():
        if _keeps_fp32(name):
            p.data = p.data.float()
    return model


def _keeps_fp32(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return leaf.startswith("hc_") or leaf in ("attn_sink", "bias", "bias_vl")


def bind_tokenizer(model: Transformer, tokenizer_json: Path | None) -> None:
    if not model.args.engram_layer_ids:
        return
    if tokenizer_json is None:
        raise ConfigError("this model has Engram layers and needs its tokenizer (tokenizer/tokenizer.json)")
    token_map, _ = compressed_token_map(tokenizer_json)
    model.bind_token_map(token_map)


@torch.no_grad()
def init_weights(model: Transformer, seed: int) -> None:
    """Seeded random weights with sane scales: N(0, 1/fan_in) linears, unit norms, small hc.
    The generator lives on the model's device (fast for GPU-sized presets), so the same seed
    gives other weights on another device type; the fingerprint records it."""
    g = torch.Generator(device=model.device).manual_seed(seed)
    for name, p in model.named_parameters():
        p.copy_(_init_value(name, p, g))


def _init_value(name: str, p: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    shape, dev = p.shape, p.device
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
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def load_weights(model: Transformer, path: Path, device="cpu", dtype=torch.float32, progress=None) -> None:
    """Fill a meta-device model from an official checkpoint directory (sharded or single file),
    one layer group at a time, so peak memory is the model in ``dtype`` plus one group."""
    expected = expected_shapes(model)
    if (path / "model.safetensors.index.json").is_file():
        from model.checkpoint import iter_checkpoint

        groups = iter_checkpoint(path, expected, dtype=dtype, device="cpu", progress=progress,
                                 ignore_prefixes=_unbuilt_prefixes(model))
    else:
        groups = [("all", _read_single_file(path, expected))]
    for _, tensors in groups:
        tensors = {k: v.to(device, torch.float32 if _keeps_fp32(k) else dtype) for k, v in tensors.items()}
        model.load_state_dict(tensors, strict=False, assign=True)
    left = [n for n, p in model.named_parameters() if p.is_meta]
    assert not left, f"checkpoint reader left parameters unloaded: {left[:5]}"
    model.ropes.make_on(device)  # its fp32 tables, made where the weights now live
    stack_experts(model.to(device))  # after the loads: each assigning load would stack again


def _unbuilt_prefixes(model: Transformer) -> tuple:
    """Checkpoint families this build does not use (draft stages it did not build; vision without a tower)."""
    drafts = () if hasattr(model, "mtp") else ("mtp.",)
    return drafts if model.args.vision is not None else drafts + ("vision.", "aligner.", "image_")


def _read_single_file(path: Path, expected: dict) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    file = path / "model.safetensors"
    if not file.is_file():
        raise ConfigError(f"{path} has neither model.safetensors.index.json nor model.safetensors")
    tensors = {k: v for k, v in load_file(str(file)).items() if k in expected}
    missing = sorted(set(expected) - set(tensors))
    bad = [f"{k}: {tuple(v.shape)} != {expected[k]}" for k, v in tensors.items() if tuple(v.shape) != expected[k]]
    if missing or bad:
        raise ConfigError(f"{file}: missing {missing[:20]} mis-shaped {bad[:20]}")
    return {k: v.float() for k, v in tensors.items()}


def fingerprint(model: Transformer, source: str | Path, seed: int = 0) -> str:
    """Identity of what a KV cache depends on: architecture, weights, tokenizer, KV format.
    A checkpoint's weights are identified by its index/config files and shard sizes (cheap);
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
        for f in sorted(path.glob("*.json")) + sorted(path.glob("*.safetensors")):
            h.update(f.name.encode() + str(f.stat().st_size).encode())
            if f.suffix == ".json":
                h.update(f.read_bytes())
        tok = find_tokenizer_json(path)
    if tok is not None and tok.is_file():
        h.update(tok.read_bytes())
    return h.hexdigest()
