"""Official-format checkpoints of DeepSeek-V4.1-Flash (ARCHITECTURE.md §3, §2.10, §1.5).

Owns: which tensor family each official name belongs to (FP8 e4m3 + E8M0 block scales,
FP4 e2m1 experts packed two per byte + E8M0 scales per 32 inputs, BF16, F32), packing a
state dict into that layout, writing ``config.json`` + sharded safetensors +
``model.safetensors.index.json`` + ``tokenizer/tokenizer.json``, reading it back
memory-mapped and layer by layer with validation that lists every problem at once (whole
tensors, or a rank's rows or columns of some: only those bytes are asked of the shards), and
the dtype census behind ``dsagent model info``.

Does not own: the number formats themselves (``model.quant``), which names a model has
or their shapes (the caller passes ``expected``: official name -> logical shape), model
construction, or progress bars (a ``progress(done, total)`` callback is all it calls).
It never imports the model, so it works on any tensor list.
"""
from __future__ import annotations

import json
import math
import re
import shutil
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from model.quant import (
    FP8_MAX,
    dequantize_fp4_weight,
    dequantize_fp8_weight,
    pow2_ceil,
    quantize_fp4_weight,
    quantize_fp8_weight,
    ue8m0_encode,
)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer/tokenizer.json"
FP4_BLOCK = 32  # FP4 experts: one E8M0 scale per 32 inputs, whatever weight_block_size says
DEFAULT_BLOCK = 32  # V4.1 weight_block_size [32, 32]
STORED_DTYPE = {"fp8": "F8_E4M3", "fp4": "I8", "bf16": "BF16", "f32": "F32"}
SCALE_DTYPE = "F8_E8M0"
_MAX_LISTED = 40  # problems listed per kind before "... and N more"

Shape = tuple[int, ...]
Part = tuple[int, int, int]  # (dim, start, stop): the rows (dim 0) or columns (dim 1) of a tensor read
Progress = Callable[[int, int], None]


class CheckpointError(ValueError):
    """A checkpoint directory is missing, malformed or does not match the model."""


# ----------------------------------------------------------------------------- tensor families

def _any_of(*patterns: str) -> re.Pattern:
    return re.compile("|".join(f"(?:{p})" for p in patterns))


# V4 names (mtp e_proj/h_proj, hc_head_*, compressor.ape) are included: same families in §3.2.
_FP8 = _any_of(
    r"(^|\.)attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight$",
    r"(^|\.)attn\.indexer\.wq_b\.weight$",
    r"(^|\.)ffn\.shared_experts\.w[123]\.weight$",
    r"(^|\.)engram\.(wkv|embed)\.weight$",
    r"^mtp\.\d+\.(main_proj|e_proj|h_proj)\.weight$",
)
_FP4 = _any_of(r"(^|\.)ffn\.experts\.\d+\.w[123]\.weight$")
_F32 = _any_of(
    r"(^|\.)hc_(attn|ffn|head)_(fn|base|scale)$",
    r"(^|\.)attn\.attn_sink$",
    r"(^|\.)ffn\.gate\.(bias|bias_vl)$",
    r"(^|\.)compressor\.ape$",
)
_ROW_WISE_FP8 = re.compile(r"(^|\.)engram\.embed\.weight$")


def tensor_format(name: str, expert_dtype: str = "fp4") -> str:
    """The family of an official tensor name: "fp8", "fp4", "bf16" or "f32" (§3.3)."""
    if _FP4.search(name):
        return _check_expert_dtype(expert_dtype)
    if _FP8.search(name):
        return "fp8"
    if _F32.search(name):
        return "f32"
    return "bf16"


def _check_expert_dtype(expert_dtype: str) -> str:
    if expert_dtype not in ("fp4", "fp8"):
        raise CheckpointError(f"expert_dtype must be 'fp4' or 'fp8', not {expert_dtype!r}")
    return expert_dtype


def stored_format(name: str, shape: Sequence[int], expert_dtype: str = "fp4") -> str:
    """The family a tensor is stored in: only 2-D weights of the FP8/FP4 families are packed."""
    fmt = tensor_format(name, expert_dtype)
    return fmt if fmt in ("bf16", "f32") or len(shape) == 2 else "bf16"


def scale_name(name: str) -> str:
    """``X.weight`` -> ``X.scale``, the E8M0 sibling of a packed weight."""
    return name.removesuffix(".weight") + ".scale"


def fp8_block_shape(name: str, block: int) -> tuple[int, int]:
    """The (rows, cols) block the writer uses: engram tables are row-wise, the rest square."""
    return (1, block) if _ROW_WISE_FP8.search(name) else (block, block)


def _ceil_shape(shape: Sequence[int], block: Sequence[int]) -> Shape:
    return tuple(-(-n // b) for n, b in zip(shape, block))


def fp8_scale_block(shape: Sequence[int], scale_shape: Sequence[int], block: int) -> tuple[int, int] | None:
    """The block an FP8 scale implies for a weight of ``shape``, or None if inconsistent.

    Tries the configured square block, then row-wise, then reads a square or row-wise
    block off the shapes (a V4.1 ``wo_a`` may carry 128-blocks while the config says 32).
    """
    if len(shape) != 2 or len(scale_shape) != 2 or 0 in scale_shape:
        return None
    exact = tuple(n // s if n % s == 0 else 0 for n, s in zip(shape, scale_shape))
    for candidate in ((block, block), (1, block), exact):
        square_or_rows = candidate[0] in (1, candidate[1])
        if 0 not in candidate and square_or_rows and _ceil_shape(shape, candidate) == tuple(scale_shape):
            return candidate
    return None


# ----------------------------------------------------------------------------- packing one tensor

def quantize_fp8_rows(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise FP8 (engram tables): [rows, cols] -> (e4m3 [rows, cols], e8m0 [rows, ceil(cols/B)]).

    Same rounding as ``quant.quantize_fp8_weight`` with a 1 x ``block`` tile.
    """
    rows, cols = w.shape
    padded = F.pad(w.float(), (0, -(-cols // block) * block - cols))
    tiles = padded.reshape(rows, -1, block)
    scale = pow2_ceil(tiles.abs().amax(-1).clamp_min(1e-4) / FP8_MAX)
    q = (tiles / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).reshape(rows, -1)[:, :cols]
    return q.to(torch.float8_e4m3fn), ue8m0_encode(scale).view(torch.float8_e8m0fnu)


def _quantize_fp8(name: str, w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    if fp8_block_shape(name, block)[0] == 1:
        return quantize_fp8_rows(w, block)
    return quantize_fp8_weight(w, block)


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 with zero padding up to a whole block; packed bytes cut back to ceil(in/2)."""
    in_f = w.shape[1]
    padded = F.pad(w.float(), (0, -(-in_f // FP4_BLOCK) * FP4_BLOCK - in_f))
    packed, scale = quantize_fp4_weight(padded, FP4_BLOCK)
    return packed[:, : -(-in_f // 2)].contiguous(), scale


def _pad_bytes(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad a one-byte tensor (fp8 or int8) to [rows, cols], keeping its dtype."""
    if tuple(t.shape) == (rows, cols):
        return t
    out = torch.zeros(rows, cols, dtype=torch.uint8, device=t.device)
    out[: t.shape[0], : t.shape[1]] = t.view(torch.uint8)
    return out.view(t.dtype)


def _dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = scale.shape[0] * block[0], scale.shape[1] * block[1]
    w = dequantize_fp8_weight(_pad_bytes(q, rows, cols), scale)
    return w[: q.shape[0], : q.shape[1]]


def _dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, in_f: int) -> torch.Tensor:
    padded = _pad_bytes(packed, packed.shape[0], scale.shape[1] * FP4_BLOCK // 2)
    return dequantize_fp4_weight(padded, scale)[:, :in_f]


def quantize_tensor(name: str, t: torch.Tensor, *, expert_dtype: str = "fp4",
                    block: int = DEFAULT_BLOCK) -> dict[str, torch.Tensor]:
    """One logical tensor -> its stored tensors (``name`` and, when packed, ``X.scale``)."""
    if not t.is_floating_point():
        raise CheckpointError(f"{name}: {t.dtype} tensors have no official checkpoint format")
    fmt = stored_format(name, t.shape, expert_dtype)
    t = t.detach().cpu()
    if fmt == "fp8":
        q, s = _quantize_fp8(name, t, block)
    elif fmt == "fp4":
        q, s = quantize_fp4(t)
    else:
        return {name: t.to(torch.bfloat16 if fmt == "bf16" else torch.float32).contiguous()}
    return {name: q.contiguous(), scale_name(name): s.contiguous()}


def dequantize_tensor(fmt: str, stored: torch.Tensor, scale: torch.Tensor | None,
                      shape: Sequence[int], *, block: int = DEFAULT_BLOCK,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored tensor(s) -> the logical tensor; F32-family tensors stay float32."""
    if fmt == "fp8":
        blk = fp8_scale_block(stored.shape, scale.shape, block)
        assert blk is not None, "scale shape was validated before dequantising"
        return _dequantize_fp8(stored, scale, blk).to(dtype)
    if fmt == "fp4":
        return _dequantize_fp4(stored, scale, shape[1]).to(dtype)
    return stored.to(torch.float32 if fmt == "f32" else dtype)


# ----------------------------------------------------------------------------- state dicts

def natural_key(name: str) -> tuple:
    """Sort key putting ``layers.2`` before ``layers.10`` (name order grouped by layer)."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))


def layer_group(name: str) -> str:
    """The load unit of a name: up to its first numeric part (``layers.3``, ``mtp.0``,
    ``vision.blocks.7``), else its first part (``embed``, ``head``, ``norm``)."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


def quantize_state_dict(state_dict: Mapping[str, torch.Tensor], *, expert_dtype: str = "fp4",
                        block: int = DEFAULT_BLOCK) -> dict[str, torch.Tensor]:
    """Logical state dict -> stored tensors in official layout, in natural name order."""
    out: dict[str, torch.Tensor] = {}
    for name in sorted(state_dict, key=natural_key):
        out.update(quantize_tensor(name, state_dict[name], expert_dtype=expert_dtype, block=block))
    return out


def dequantize_state_dict(stored: Mapping[str, torch.Tensor], shapes: Mapping[str, Sequence[int]], *,
                          expert_dtype: str = "fp4", block: int = DEFAULT_BLOCK,
                          dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Stored tensors -> logical tensors of ``shapes`` (the names and shapes of the model)."""
    out = {}
    for name in sorted(shapes, key=natural_key):
        fmt = stored_format(name, shapes[name], expert_dtype)
        scale = stored.get(scale_name(name)) if fmt in ("fp8", "fp4") else None
        out[name] = dequantize_tensor(fmt, stored[name], scale, shapes[name], block=block, dtype=dtype)
    return out


def fake_quantize_like_checkpoint(state_dict: Mapping[str, torch.Tensor], *, expert_dtype: str = "fp4",
                                  block: int = DEFAULT_BLOCK,
                                  dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """What ``read_checkpoint(dtype=dtype)`` returns after ``write_checkpoint(state_dict)``."""
    shapes = {k: tuple(v.shape) for k, v in state_dict.items()}
    stored = quantize_state_dict(state_dict, expert_dtype=expert_dtype, block=block)
    return dequantize_state_dict(stored, shapes, expert_dtype=expert_dtype, block=block, dtype=dtype)


# ----------------------------------------------------------------------------- writer

def quantization_config(expert_dtype: str = "fp4", block: int = DEFAULT_BLOCK) -> dict:
    """The ``quantization_config`` of §1.5 (V4.1 form)."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [block, block],
            "scale_fmt": "ue8m0", "expert_dtype": _check_expert_dtype(expert_dtype)}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _plan_shards(stored: Mapping[str, torch.Tensor], shard_bytes: int) -> list[list[str]]:
    """Greedy split in name order; a weight and its scale never straddle two shards."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in stored:
        if name.endswith(".scale") and name.removesuffix(".scale") + ".weight" in stored:
            shards[-1].append(name)
            continue
        pair = _nbytes(stored[name]) + _nbytes(stored.get(scale_name(name), torch.empty(0)))
        if shards[-1] and size + pair > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += pair
    return shards


def _shard_file(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _prepare_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise CheckpointError(f"{out_dir} exists and is not an empty directory; choose a new --out")
    out_dir.mkdir(parents=True, exist_ok=True)


def write_checkpoint(out_dir: str | Path, config: dict, state_dict: Mapping[str, torch.Tensor], *,
                     tokenizer_json: Path | None, shard_bytes: int = 200_000_000,
                     expert_dtype: str = "fp4", block: int = DEFAULT_BLOCK) -> Path:
    """Write ``state_dict`` (official names, logical tensors) as an official checkpoint.

    Same input, same bytes. ``out_dir`` must be new or empty. Returns ``out_dir``.
    """
    out_dir = Path(out_dir)
    stored = quantize_state_dict(state_dict, expert_dtype=expert_dtype, block=block)
    _prepare_out_dir(out_dir)
    weight_map = _write_shards(out_dir, stored, shard_bytes)
    index = {"metadata": {"total_size": sum(_nbytes(t) for t in stored.values())}, "weight_map": weight_map}
    _write_json(out_dir / INDEX_FILE, index)
    _write_json(out_dir / CONFIG_FILE, {**config, "quantization_config": quantization_config(expert_dtype, block)})
    if tokenizer_json is not None:
        (out_dir / TOKENIZER_FILE).parent.mkdir(exist_ok=True)
        shutil.copyfile(tokenizer_json, out_dir / TOKENIZER_FILE)
    return out_dir


def _write_shards(out_dir: Path, stored: Mapping[str, torch.Tensor], shard_bytes: int) -> dict[str, str]:
    shards = _plan_shards(stored, shard_bytes)
    weight_map = {}
    for i, names in enumerate(shards):
        file = _shard_file(i, len(shards))
        save_file({n: stored[n] for n in names}, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
    return weight_map


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------- reader: files

def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise CheckpointError(f"no {path.name} in {path.parent}; is this a checkpoint directory ({what})?")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return obj


def _check_dir(ckpt_dir: str | Path) -> Path:
    root = Path(ckpt_dir)
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory; pass the checkpoint folder (with config.json)")
    return root


def read_config(ckpt_dir: str | Path) -> dict:
    """The checkpoint's ``config.json`` as a dict."""
    return _read_json(_check_dir(ckpt_dir) / CONFIG_FILE, "config")


def read_weight_map(ckpt_dir: str | Path) -> dict[str, str]:
    """Tensor name -> shard file, from ``model.safetensors.index.json``."""
    index = _read_json(_check_dir(ckpt_dir) / INDEX_FILE, "shard index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{ckpt_dir}/{INDEX_FILE} has no weight_map of tensor name -> shard file")
    return weight_map


def quant_settings(config: Mapping) -> tuple[str, int]:
    """(expert_dtype, FP8 block) from a config: quantization_config first, then top level."""
    qc = config.get("quantization_config") or {}
    expert_dtype = qc.get("expert_dtype", config.get("expert_dtype", "fp4"))
    block = qc.get("weight_block_size", [DEFAULT_BLOCK, DEFAULT_BLOCK])
    if not (isinstance(block, list) and len(block) == 2 and block[0] == block[1] and block[0] > 0):
        raise CheckpointError(f"weight_block_size must be [B, B], got {block!r}")
    return _check_expert_dtype(expert_dtype), int(block[0])


@dataclass(frozen=True)
class StoredTensor:
    """What a shard header says about one stored tensor."""

    shard: str
    dtype: str
    shape: Shape


def _open_shards(root: Path, weight_map: Mapping[str, str], stack: ExitStack,
                 problems: list[str]) -> tuple[dict, dict[str, StoredTensor | None]]:
    """Open every shard (memory-mapped) and read its header; missing shards and shards
    whose header does not read (a file cut short: the header must cover every byte)
    become problems.

    A tensor that could not be read maps to None: it is already reported, not "missing".
    """
    handles, infos = {}, {}
    for shard in sorted(set(weight_map.values())):
        path = root / shard
        if not path.is_file():
            count = sum(1 for v in weight_map.values() if v == shard)
            problems.append(f"missing shard: {shard} (the index names it for {count} tensors)")
            continue
        try:
            handles[shard] = stack.enter_context(safe_open(str(path), framework="pt"))
        except Exception as e:  # safetensors raises its own SafetensorError, or OSError
            problems.append(f"damaged shard: {shard} cannot be read ({_reason(e)}; {path.stat().st_size} bytes): "
                            "it is truncated or corrupt")
    for name, shard in weight_map.items():
        infos[name] = _header_entry(handles[shard], name, shard, problems) if shard in handles else None
    return handles, infos


def _reason(e: BaseException) -> str:
    return str(e).removeprefix("Error while deserializing header: ") or type(e).__name__


def _header_entry(handle, name: str, shard: str, problems: list[str]) -> StoredTensor | None:
    try:
        sl = handle.get_slice(name)
    except Exception:  # safetensors raises a plain SafetensorError for an absent key
        problems.append(f"not in its shard: {name} (the index says {shard})")
        return None
    return StoredTensor(shard, sl.get_dtype(), tuple(sl.get_shape()))


# ----------------------------------------------------------------------------- reader: validation

def _fmt_shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(n) for n in shape) + "]"


def _check_stored(problems: list[str], infos: Mapping[str, StoredTensor], name: str, fmt: str,
                  dtype: str, shape: Shape | None) -> StoredTensor | None:
    """Check one stored tensor's presence, dtype and (when given) shape; None if absent."""
    info = infos.get(name)
    if name not in infos:
        problems.append(f"missing: {name}")
    elif info is None:
        return None
    elif info.dtype != dtype:
        problems.append(f"dtype: {name} is {info.dtype}, expected {dtype} ({fmt} family)")
    elif shape is not None and info.shape != shape:
        problems.append(f"shape: {name} is {_fmt_shape(info.shape)}, expected {_fmt_shape(shape)}")
    else:
        return info
    return None


def _check_tensor(problems: list[str], infos: Mapping[str, StoredTensor], name: str, shape: Shape,
                  fmt: str, block: int) -> None:
    """All checks of one logical tensor, its scale included."""
    if fmt == "fp4":
        stored_shape = (shape[0], -(-shape[1] // 2))
        _check_stored(problems, infos, name, fmt, "I8", stored_shape)
        _check_stored(problems, infos, scale_name(name), fmt, SCALE_DTYPE, (shape[0], -(-shape[1] // FP4_BLOCK)))
        return
    weight = _check_stored(problems, infos, name, fmt, STORED_DTYPE[fmt], shape)
    if fmt != "fp8":
        return
    scale = _check_stored(problems, infos, scale_name(name), fmt, SCALE_DTYPE, None)
    if weight is not None and scale is not None and fp8_scale_block(shape, scale.shape, block) is None:
        want = _fmt_shape(_ceil_shape(shape, fp8_block_shape(name, block)))
        problems.append(f"scale: {scale_name(name)} is {_fmt_shape(scale.shape)}, inconsistent with "
                        f"weight {_fmt_shape(shape)} (expected {want} for block {block})")


def _ignored(name: str, ignore_prefixes: Sequence[str]) -> bool:
    return any(name.startswith(p) for p in ignore_prefixes)


def _unexpected(weight_map: Mapping[str, str], plan: Mapping[str, str],
                ignore_prefixes: Sequence[str]) -> list[str]:
    known = set(plan) | {scale_name(n) for n, fmt in plan.items() if fmt in ("fp8", "fp4")}
    return [f"unexpected: {n}" for n in sorted(weight_map, key=natural_key)
            if n not in known and not _ignored(n, ignore_prefixes)]


_SHARD_KINDS = ("missing shard", "damaged shard")


def _raise_problems(root: Path, problems: list[str], headline: str = "does not match the model") -> None:
    if not problems:
        return
    kinds: dict[str, list[str]] = {}
    for p in problems:
        kinds.setdefault(p.split(":", 1)[0], []).append(p)
    lines = []
    for items in kinds.values():
        lines += items[:_MAX_LISTED] + ([f"... and {len(items) - _MAX_LISTED} more"] if len(items) > _MAX_LISTED else [])
    if set(kinds) <= set(_SHARD_KINDS):  # the files, not the model they were made for
        headline = "has shards that are missing or cannot be read"
        advice = "copy or download the checkpoint's shard files again (a shard cut short by a copy or download fails so)"
    else:
        advice = ("check that the checkpoint was made for this model configuration (config.json), "
                  "or regenerate it with `dsagent model init`")
    raise CheckpointError(f"checkpoint {root} {headline} ({len(problems)} problems):\n  " + "\n  ".join(lines)
                          + "\n" + advice)


# ----------------------------------------------------------------------------- reader: loading

@dataclass
class _Reader:
    """Open shards of a validated checkpoint and what to load from them."""

    handles: dict
    infos: dict[str, StoredTensor | None]
    shapes: dict[str, Shape]
    plan: dict[str, str]  # logical name -> stored family
    block: int
    unread: dict[str, int]  # shard -> its stored tensors the plan has still to read

    def tensor(self, name: str, device: str | torch.device, part: Part | None = None) -> torch.Tensor:
        """A stored tensor, or only ``part`` of it (``get_slice``: the shard is asked for those bytes),
        on ``device``: on the CPU a view of the shard's memory map where safetensors gives one
        (0.8 does), which keeps that map after its shard is closed (``_read``)."""
        shard = self.infos[name].shard
        try:
            if part is None:
                stored = self.handles[shard].get_tensor(name)
            else:
                dim, start, stop = part
                whole = self.handles[shard].get_slice(name)
                stored = (whole[start:stop] if dim == 0 else whole[:, start:stop]).contiguous()
        except Exception as e:  # the header read, but the bytes did not (an I/O error on the memory map)
            raise CheckpointError(f"shard {shard}: cannot read {name} ({_reason(e)}); the file is damaged or "
                                  "unreadable: copy or download it again") from None
        stored = stored.to(device)
        self._read(shard)
        return stored

    def _read(self, shard: str) -> None:
        """One more of ``shard``'s tensors read; after its last one the shard is closed, and its
        memory map goes with it unless a tensor still views it: the pages read from it leave
        the resident set, where otherwise every shard's would stay there to the load's end."""
        self.unread[shard] -= 1
        if not self.unread[shard]:
            self.handles.pop(shard).__exit__(None, None, None)  # the ExitStack's later exit does nothing

    def scale_block(self, name: str) -> tuple[int, int]:
        """The (rows, columns) of packed ``name`` that one of its scales covers."""
        if self.plan[name] == "fp4":
            return 1, FP4_BLOCK
        return fp8_scale_block(self.shapes[name], self.infos[scale_name(name)].shape, self.block)

    def _with_scale(self, name: str, device: str | torch.device, part: Part) -> tuple[torch.Tensor, torch.Tensor]:
        """``part`` of packed ``name`` as stored, and the scales of the blocks it touches."""
        dim, start, stop = part
        assert self.plan[name] == "fp8" or dim == 0, "an FP4 tensor is read by rows (a byte holds two columns)"
        step = self.scale_block(name)[dim]
        return (self.tensor(name, device, part),
                self.tensor(scale_name(name), device, (dim, start // step, -(-stop // step))))

    def logical(self, name: str, dtype: torch.dtype, device: str | torch.device,
                part: Part | None = None) -> torch.Tensor:
        fmt, shape = self.plan[name], self.shapes[name]
        if fmt not in ("fp8", "fp4"):
            return dequantize_tensor(fmt, self.tensor(name, device, part), None, shape, dtype=dtype)
        if part is None:
            return dequantize_tensor(fmt, self.tensor(name, device), self.tensor(scale_name(name), device), shape,
                                     block=self.block, dtype=dtype)
        dim, start, stop = part
        blk = self.scale_block(name)
        first = start // blk[dim] * blk[dim]  # widened to whole blocks, dequantised, cut back to the part
        q, scale = self._with_scale(name, device, (dim, first, stop))
        w = _dequantize_fp8(q, scale, blk) if fmt == "fp8" else _dequantize_fp4(q, scale, shape[1])
        return w.narrow(dim, start - first, stop - start).to(dtype).contiguous()

    def stored(self, name: str, device: str | torch.device, part: Part | None = None) -> dict[str, torch.Tensor]:
        """A packed weight and its scale exactly as stored, for kernels that take them directly;
        with ``part``, those bytes and their scales' rows or columns: whole blocks only."""
        if part is None:
            return {n: self.tensor(n, device) for n in (name, scale_name(name))}
        dim, start, stop = part
        step = self.scale_block(name)[dim]
        if start % step or (stop % step and stop != self.shapes[name][dim]):
            what = ("rows", "columns")[dim]
            raise CheckpointError(f"{name}: {what} [{start}, {stop}) are not whole {step}-blocks of its scale, "
                                  f"so that part cannot be held as stored; read it dequantised, or split it so "
                                  f"each part is whole blocks")
        return dict(zip((name, scale_name(name)), self._with_scale(name, device, part)))


def _open_validated(root: Path, expected: Mapping[str, Sequence[int]], ignore_prefixes: Sequence[str],
                    stack: ExitStack) -> _Reader:
    expert_dtype, block = quant_settings(read_config(root))
    weight_map = read_weight_map(root)
    shapes = {n: tuple(s) for n, s in expected.items() if not _ignored(n, ignore_prefixes)}
    plan = {n: stored_format(n, shapes[n], expert_dtype) for n in sorted(shapes, key=natural_key)}
    problems: list[str] = []
    handles, infos = _open_shards(root, weight_map, stack, problems)
    for name, fmt in plan.items():
        _check_tensor(problems, infos, name, shapes[name], fmt, block)
    _raise_problems(root, problems + _unexpected(weight_map, plan, ignore_prefixes))
    unread: dict[str, int] = {}
    for name, fmt in plan.items():
        for stored in (name, scale_name(name)) if fmt in ("fp8", "fp4") else (name,):
            unread[infos[stored].shard] = unread.get(infos[stored].shard, 0) + 1
    return _Reader(handles, infos, shapes, plan, block, unread)


def iter_checkpoint(ckpt_dir: str | Path, expected: Mapping[str, Sequence[int]], *,
                    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    progress: Progress | None = None, ignore_prefixes: Sequence[str] = (),
                    compressed: bool = False, parts: Mapping[str, Part] | None = None,
                    devices: Mapping[str, str | torch.device] | None = None,
                    ) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """Validate now, then lazily yield ``(layer_group, {name: tensor})`` one load unit at a time.

    ``expected`` maps official names to logical shapes. Every problem (missing,
    unexpected, mis-shaped, mis-typed, inconsistent scale, missing shard) is collected
    and raised as one :class:`CheckpointError` by this call, before anything is loaded.
    Packed families are dequantised to ``dtype`` (the F32 family stays float32); with
    ``compressed=True`` they come back as stored (``X.weight`` e4m3 / packed int8 plus
    ``X.scale`` e8m0) for kernels that consume them directly. Shards are memory-mapped, each
    tensor copied to ``device`` as it is read (on a GPU, dequantised there) and each shard
    closed after its last tensor (the shards in name order, as the writer makes them: one open
    at a time). On the CPU a tensor yielded as stored may be a view of its shard's map.
    ``devices``: name -> where that tensor (and its scale) goes instead of ``device`` (a table
    kept in host memory while the rest goes to a GPU).
    ``parts``: name -> (dim, start, stop), a tensor of which only those rows (dim 0) or columns
    (dim 1) are read (``safe_open(...).get_slice``; a rank's share), a packed one with the
    scales of the blocks it touches; as stored (``compressed``) such a part must be whole blocks.
    Validation is of the whole tensors all the same.
    """
    for name, (dim, start, stop) in (parts or {}).items():
        assert dim in (0, 1) and 0 <= start < stop <= expected[name][dim], (name, dim, start, stop)
    stack = ExitStack()
    try:
        reader = _open_validated(_check_dir(ckpt_dir), expected, ignore_prefixes, stack)
    except BaseException:
        stack.close()
        raise
    where = {name: (devices or {}).get(name, device) for name in reader.plan}
    return _iter_groups(stack, reader, dtype, where, progress, compressed, parts or {})


def _iter_groups(stack: ExitStack, reader: _Reader, dtype: torch.dtype, where: Mapping[str, str | torch.device],
                 progress: Progress | None, compressed: bool,
                 parts: Mapping[str, Part]) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    group, tensors = None, {}
    with stack:
        for done, (name, fmt) in enumerate(reader.plan.items(), 1):
            if layer_group(name) != group and tensors:
                yield group, tensors
                tensors = {}
            group = layer_group(name)
            if compressed and fmt in ("fp8", "fp4"):
                tensors.update(reader.stored(name, where[name], parts.get(name)))
            else:
                tensors[name] = reader.logical(name, dtype, where[name], parts.get(name))
            if progress is not None:
                progress(done, len(reader.plan))
        if tensors:
            yield group, tensors


def read_checkpoint(ckpt_dir: str | Path, expected: Mapping[str, Sequence[int]], *,
                    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    progress: Progress | None = None, ignore_prefixes: Sequence[str] = (),
                    compressed: bool = False) -> dict[str, torch.Tensor]:
    """All tensors of :func:`iter_checkpoint` in one dict (name order, grouped by layer)."""
    out: dict[str, torch.Tensor] = {}
    for _, tensors in iter_checkpoint(ckpt_dir, expected, dtype=dtype, device=device, progress=progress,
                                      ignore_prefixes=ignore_prefixes, compressed=compressed):
        out.update(tensors)
    return out


# ----------------------------------------------------------------------------- census

_DTYPE_BYTES = {"F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1, "BF16": 2,
                "F16": 2, "I16": 2, "F32": 4, "I32": 4, "F64": 8, "I64": 8}


def _family(name: str, names: Mapping[str, StoredTensor], expert_dtype: str) -> str:
    """A stored tensor's family; a ``.scale`` counts with its packed weight."""
    weight = name.removesuffix(".scale") + ".weight"
    if name.endswith(".scale") and weight in names:
        return _family(weight, names, expert_dtype)
    fmt = stored_format(name, names[name].shape, expert_dtype)
    return fmt if names[name].dtype in (STORED_DTYPE[fmt], SCALE_DTYPE) else names[name].dtype.lower()


def _add(bucket: dict, key: str, nbytes: int, params: int | None = None) -> None:
    entry = bucket.setdefault(key, {"tensors": 0, "bytes": 0} if params is None else
                              {"tensors": 0, "bytes": 0, "parameters": 0})
    entry["tensors"] += 1
    entry["bytes"] += nbytes
    if params is not None:
        entry["parameters"] += params


def _parameters(name: str, info: StoredTensor, family: str) -> int:
    if info.dtype == SCALE_DTYPE and name.endswith(".scale"):
        return 0
    return math.prod(info.shape) * (2 if family == "fp4" else 1)


def census(ckpt_dir: str | Path) -> dict:
    """Tensor counts, bytes and logical parameters per family and per safetensors dtype.

    ``{"tensors", "bytes", "shards", "by_family": {fam: {"tensors", "bytes", "parameters"}},
    "by_dtype": {dtype: {"tensors", "bytes"}}}``; a ``.scale`` counts in its weight's family.
    """
    root = _check_dir(ckpt_dir)
    expert_dtype, _ = quant_settings(read_config(root))
    weight_map = read_weight_map(root)
    with ExitStack() as stack:
        problems: list[str] = []
        _, infos = _open_shards(root, weight_map, stack, problems)
    _raise_problems(root, problems, "is incomplete")
    result = {"tensors": len(infos), "bytes": 0, "shards": len(set(weight_map.values())),
              "by_family": {}, "by_dtype": {}}
    for name, info in infos.items():
        nbytes = math.prod(info.shape) * _DTYPE_BYTES.get(info.dtype, 0)
        family = _family(name, infos, expert_dtype)
        _add(result["by_family"], family, nbytes, _parameters(name, info, family))
        _add(result["by_dtype"], info.dtype, nbytes)
        result["bytes"] += nbytes
    return result
