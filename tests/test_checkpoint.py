"""Official-format checkpoints: families, packing, write -> read round trip, validation, census.

Uses a small synthetic state dict with a name of every family (no model needed); the
end-to-end model test runs only once ``model.model`` and ``model.args`` exist.
"""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from model.checkpoint import (
    CheckpointError,
    census,
    fake_quantize_like_checkpoint,
    fp8_scale_block,
    iter_checkpoint,
    layer_group,
    natural_key,
    quantize_state_dict,
    read_checkpoint,
    read_config,
    read_weight_map,
    stored_format,
    tensor_format,
    write_checkpoint,
)
from model.quant import dequantize_fp4_weight, dequantize_fp8_weight, quantize_fp8_weight

D, V, HC = 64, 96, 4


def _layer(i: int, experts: int = 3) -> dict[str, tuple[int, ...]]:
    p = f"layers.{i}."
    shapes = {
        p + "attn_norm.weight": (D,), p + "ffn_norm.weight": (D,),
        p + "attn.wq_a.weight": (32, D), p + "attn.q_norm.weight": (32,),
        p + "attn.wq_b.weight": (96, 32), p + "attn.wkv.weight": (48, D),  # 48: not a block multiple
        p + "attn.kv_norm.weight": (48,), p + "attn.wo_a.weight": (64, 40), p + "attn.wo_b.weight": (D, 64),
        p + "attn.attn_sink": (4,),
        p + "ffn.gate.weight": (experts, D), p + "ffn.gate.bias": (experts,), p + "ffn.gate.bias_vl": (experts,),
    }
    for part in ("attn", "ffn"):
        shapes |= {p + f"hc_{part}_fn": (24, HC * D), p + f"hc_{part}_base": (24,), p + f"hc_{part}_scale": (3,)}
    for e in range(experts):
        shapes |= {p + f"ffn.experts.{e}.w1.weight": (16, D), p + f"ffn.experts.{e}.w2.weight": (D, 16),
                   p + f"ffn.experts.{e}.w3.weight": (16, D)}
    for w, shape in (("w1", (16, D)), ("w2", (D, 16)), ("w3", (16, D))):
        shapes[p + f"ffn.shared_experts.{w}.weight"] = shape
    return shapes


def synthetic_shapes() -> dict[str, tuple[int, ...]]:
    shapes = {"embed.weight": (V, D), "head.weight": (V, D), "norm.weight": (D,),
              "hc_head_fn": (HC, HC * D), "hc_head_base": (HC,), "hc_head_scale": (1,),
              "image_start": (D,), "aligner.w1.weight": (D, 72), "aligner.w1.bias": (D,),
              "vision.patch_embed.proj.weight": (32, 12), "vision.blocks.0.norm1.weight": (32,),
              "mtp.0.main_proj.weight": (D, 3 * D), "mtp.0.main_norm.weight": (D,)}
    for i in range(3):
        shapes |= _layer(i)
    shapes |= {"layers.1.engram.embed.weight": (100, 64), "layers.1.engram.wkv.weight": (80, 96),
               "layers.1.engram.q_weight": (HC, D), "layers.1.engram.k_weight": (HC, D),
               "layers.2.attn.compressor.wkv.weight": (48, D), "layers.2.attn.compressor.wgate.weight": (48, D),
               "layers.2.attn.compressor.norm.weight": (48,), "layers.2.attn.indexer.wq_b.weight": (64, 32),
               "layers.2.attn.indexer.weights_proj.weight": (4, D), "layers.2.attn.indexer.wk.weight": (32, 48),
               "layers.2.attn.indexer.k_norm.weight": (32,)}
    return shapes


def synthetic_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i, (name, shape) in enumerate(sorted(synthetic_shapes().items())):
        magnitude = 10.0 ** (i % 7 - 4)  # spread over scales so E8M0 exponents vary
        sd[name] = torch.randn(shape, generator=g) * magnitude
    return sd


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text('{"version": "1.0", "model": {"type": "BPE"}}')
    return path


@pytest.fixture(scope="module")
def written(tmp_path_factory, tokenizer_json) -> tuple[Path, dict[str, torch.Tensor]]:
    sd = synthetic_state_dict()
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    write_checkpoint(out, {"model_type": "deepseek_v41"}, sd, tokenizer_json=tokenizer_json, shard_bytes=40_000)
    return out, sd


def _copy_ckpt(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.rglob("*"):
        if f.is_file():
            (dst / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            (dst / f.relative_to(src)).write_bytes(f.read_bytes())
    return dst


def _replace_tensor(ckpt: Path, name: str, tensor: torch.Tensor) -> None:
    shard = ckpt / read_weight_map(ckpt)[name]
    tensors = load_file(shard)
    tensors[name] = tensor
    save_file(tensors, str(shard), metadata={"format": "pt"})


# ----------------------------------------------------------------------------- families

@pytest.mark.parametrize("name, fmt", [
    ("layers.0.attn.wq_a.weight", "fp8"), ("layers.3.attn.wo_b.weight", "fp8"),
    ("layers.2.attn.indexer.wq_b.weight", "fp8"), ("layers.0.ffn.shared_experts.w2.weight", "fp8"),
    ("layers.1.engram.embed.weight", "fp8"), ("layers.14.engram.wkv.weight", "fp8"),
    ("mtp.0.main_proj.weight", "fp8"), ("layers.5.ffn.experts.383.w3.weight", "fp4"),
    ("mtp.1.ffn.experts.0.w1.weight", "fp4"),
    ("layers.0.hc_attn_fn", "f32"), ("layers.0.hc_ffn_scale", "f32"), ("hc_head_base", "f32"),
    ("layers.0.attn.attn_sink", "f32"), ("layers.0.ffn.gate.bias", "f32"), ("layers.0.ffn.gate.bias_vl", "f32"),
    ("embed.weight", "bf16"), ("head.weight", "bf16"), ("layers.0.ffn.gate.weight", "bf16"),
    ("layers.2.attn.compressor.wkv.weight", "bf16"), ("layers.20.attn.compressor.norm.weight", "bf16"),
    ("layers.2.attn.indexer.wk.weight", "bf16"), ("layers.2.attn.indexer.weights_proj.weight", "bf16"),
    ("layers.1.engram.q_weight", "bf16"), ("vision.blocks.0.attn.wo.weight", "bf16"),
    ("aligner.w1.bias", "bf16"), ("image_newline", "bf16"),
])
def test_tensor_format_families(name, fmt):
    assert tensor_format(name) == fmt


def test_expert_dtype_fp8_and_non_2d_weights_stay_bf16():
    assert tensor_format("layers.0.ffn.experts.1.w1.weight", expert_dtype="fp8") == "fp8"
    assert stored_format("layers.0.attn.wq_a.weight", (8,)) == "bf16"
    with pytest.raises(CheckpointError, match="expert_dtype"):
        tensor_format("layers.0.ffn.experts.1.w1.weight", expert_dtype="int4")


def test_fp8_scale_block_reads_block_from_shapes():
    assert fp8_scale_block((48, 64), (2, 2), 32) == (32, 32)
    assert fp8_scale_block((100, 64), (100, 2), 32) == (1, 32)
    assert fp8_scale_block((256, 512), (2, 4), 32) == (128, 128)  # a wo_a stored with 128-blocks
    assert fp8_scale_block((48, 64), (3, 2), 32) is None  # 16 x 32 tiles: neither square nor row-wise
    assert fp8_scale_block((48, 64), (5, 2), 32) is None


def test_natural_order_groups_layers():
    names = ["layers.10.a", "layers.2.b", "embed.weight", "layers.2.a", "mtp.0.x"]
    assert sorted(names, key=natural_key) == ["embed.weight", "layers.2.a", "layers.2.b", "layers.10.a", "mtp.0.x"]
    assert layer_group("layers.3.ffn.experts.7.w1.weight") == "layers.3"
    assert layer_group("vision.blocks.4.attn.wqkv.weight") == "vision.blocks.4"
    assert layer_group("head.weight") == "head"


# ----------------------------------------------------------------------------- packing

_E2M1 = {0.0: 0, 0.5: 1, 1.0: 2, 1.5: 3, 2.0: 4, 3.0: 5, 4.0: 6, 6.0: 7}


def _code(v: float) -> int:
    return _E2M1[abs(v)] | (8 if math.copysign(1.0, v) < 0 else 0)  # -0.0 keeps its sign bit


@pytest.mark.parametrize("in_f", [64, 33])
def test_fp4_pack_layout_matches_plain_reference(in_f):
    g = torch.Generator().manual_seed(1)
    grid = torch.tensor(list(_E2M1))
    values = grid[torch.randint(0, 8, (3, in_f), generator=g)] * torch.where(torch.rand(3, in_f, generator=g) < .5, -1, 1)
    values[:, 0] = 6.0  # every block's amax is 6 * scale, so the scale is exact
    values[:, 32:33] = -6.0
    scale_exp = torch.tensor([[-3.0], [0.0], [5.0]])
    w = values * torch.exp2(scale_exp)
    stored = quantize_state_dict({"layers.0.ffn.experts.0.w1.weight": w})
    packed, scale = stored["layers.0.ffn.experts.0.w1.weight"], stored["layers.0.ffn.experts.0.w1.scale"]
    assert packed.dtype == torch.int8 and packed.shape == (3, math.ceil(in_f / 2))
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (3, math.ceil(in_f / 32))
    for r in range(3):
        assert scale.view(torch.uint8)[r].tolist() == [127 + int(scale_exp[r])] * scale.shape[1]
        for j in range(packed.shape[1]):
            low = _code(float(values[r, 2 * j]))
            high = _code(float(values[r, 2 * j + 1])) if 2 * j + 1 < in_f else 0
            assert int(packed[r, j].view(torch.uint8)) == low | (high << 4), (r, j)
    back = fake_quantize_like_checkpoint({"layers.0.ffn.experts.0.w1.weight": w})
    assert torch.equal(back["layers.0.ffn.experts.0.w1.weight"], w)


def test_fp8_blocks_use_ceil_on_ragged_dims():
    w = torch.randn(40, 72) * torch.linspace(0.01, 50, 72)
    stored = quantize_state_dict({"layers.0.attn.wkv.weight": w})
    q, s = stored["layers.0.attn.wkv.weight"], stored["layers.0.attn.wkv.scale"]
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 3)
    got = fake_quantize_like_checkpoint({"layers.0.attn.wkv.weight": w})["layers.0.attn.wkv.weight"]
    for bi in range(2):
        for bj in range(3):
            rows, cols = slice(32 * bi, 32 * bi + 32), slice(32 * bj, 32 * bj + 32)
            tile = w[rows, cols]
            step = 2.0 ** math.ceil(math.log2(max(tile.abs().max().item(), 1e-4) / 448))
            ref = (tile / step).to(torch.float8_e4m3fn).float() * step
            assert torch.equal(got[rows, cols], ref), (bi, bj)


def test_engram_table_is_row_wise():
    w = torch.randn(5, 64) * torch.tensor([[1e-3], [1.0], [10.0], [0.1], [100.0]])
    stored = quantize_state_dict({"layers.1.engram.embed.weight": w})
    scale = stored["layers.1.engram.embed.scale"]
    assert scale.shape == (5, 2) and scale.dtype == torch.float8_e8m0fnu
    assert len(set(scale.view(torch.uint8)[:, 0].tolist())) == 5
    got = fake_quantize_like_checkpoint({"layers.1.engram.embed.weight": w})["layers.1.engram.embed.weight"]
    assert torch.equal(got, dequantize_fp8_weight(stored["layers.1.engram.embed.weight"], scale))


def test_integer_tensors_are_refused():
    with pytest.raises(CheckpointError, match="int64"):
        quantize_state_dict({"layers.0.ffn.gate.tid2eid": torch.zeros(4, 2, dtype=torch.int64)})


# ----------------------------------------------------------------------------- write -> read

def test_round_trip_equals_fake_quantize(written):
    ckpt, sd = written
    loaded = read_checkpoint(ckpt, {k: tuple(v.shape) for k, v in sd.items()})
    expected = fake_quantize_like_checkpoint(sd)
    assert list(loaded) == sorted(sd, key=natural_key)
    for name, t in expected.items():
        assert loaded[name].dtype == torch.float32 and torch.equal(loaded[name], t), name
    assert not torch.equal(loaded["layers.0.attn.wq_a.weight"], sd["layers.0.attn.wq_a.weight"])
    assert torch.equal(loaded["layers.0.hc_attn_fn"], sd["layers.0.hc_attn_fn"])


def test_bf16_load_keeps_f32_family(written):
    ckpt, sd = written
    loaded = read_checkpoint(ckpt, {k: tuple(v.shape) for k, v in sd.items()}, dtype=torch.bfloat16)
    expected = fake_quantize_like_checkpoint(sd, dtype=torch.bfloat16)
    assert loaded["layers.0.attn.attn_sink"].dtype == torch.float32
    assert loaded["layers.0.ffn.experts.0.w1.weight"].dtype == torch.bfloat16
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())


def test_stored_dtypes_and_shapes(written):
    ckpt, _ = written
    headers = {}
    for shard in set(read_weight_map(ckpt).values()):
        with safe_open(str(ckpt / shard), framework="pt") as f:
            headers |= {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}
    assert headers["layers.0.attn.wq_a.weight"] == ("F8_E4M3", [32, 64])
    assert headers["layers.0.attn.wq_a.scale"] == ("F8_E8M0", [1, 2])
    assert headers["layers.0.attn.wkv.scale"] == ("F8_E8M0", [2, 2])
    assert headers["layers.0.ffn.experts.2.w2.weight"] == ("I8", [64, 8])
    assert headers["layers.0.ffn.experts.2.w2.scale"] == ("F8_E8M0", [64, 1])
    assert headers["layers.1.engram.embed.scale"] == ("F8_E8M0", [100, 2])
    assert headers["layers.0.hc_ffn_base"] == ("F32", [24])
    assert headers["layers.0.ffn_norm.weight"] == ("BF16", [64])
    assert "layers.0.attn_norm.scale" not in headers


def test_files_config_and_tokenizer(written, tokenizer_json):
    ckpt, sd = written
    config = read_config(ckpt)
    assert config["model_type"] == "deepseek_v41"
    assert config["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "dynamic",
                                             "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
                                             "expert_dtype": "fp4"}
    assert (ckpt / "tokenizer" / "tokenizer.json").read_bytes() == tokenizer_json.read_bytes()
    assert not any(k.startswith("model.") for k in read_weight_map(ckpt))


def test_sharding_splits_and_index_is_consistent(written):
    ckpt, _ = written
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert sorted(p.name for p in ckpt.glob("*.safetensors")) == shards
    for name, shard in index["weight_map"].items():
        if name.endswith(".scale"):
            assert index["weight_map"][name.removesuffix(".scale") + ".weight"] == shard
    assert index["metadata"]["total_size"] == census(ckpt)["bytes"]


def test_writer_is_deterministic(tmp_path, tokenizer_json):
    sd = synthetic_state_dict(seed=3)
    for name in ("a", "b"):
        write_checkpoint(tmp_path / name, {"x": 1}, sd, tokenizer_json=tokenizer_json, shard_bytes=30_000)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file())
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)


def test_iter_checkpoint_yields_each_layer_once_with_progress(written):
    ckpt, sd = written
    calls = []
    groups = [g for g, tensors in iter_checkpoint(ckpt, {k: tuple(v.shape) for k, v in sd.items()},
                                                  progress=lambda d, t: calls.append((d, t)))
              if all(layer_group(n) == g for n in tensors)]
    assert len(groups) == len(set(groups)) == len({layer_group(n) for n in sd})
    assert groups.index("layers.0") < groups.index("layers.1") < groups.index("layers.2")
    assert calls == [(i, len(sd)) for i in range(1, len(sd) + 1)]


def test_compressed_load_returns_stored_tensors(written):
    ckpt, sd = written
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    raw = read_checkpoint(ckpt, shapes, compressed=True)
    full = read_checkpoint(ckpt, shapes)
    assert raw["layers.0.attn.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert torch.equal(dequantize_fp8_weight(raw["layers.0.attn.wq_b.weight"], raw["layers.0.attn.wq_b.scale"]),
                       full["layers.0.attn.wq_b.weight"])
    w1 = "layers.1.ffn.experts.0.w1."
    assert torch.equal(dequantize_fp4_weight(raw[w1 + "weight"], raw[w1 + "scale"]), full[w1 + "weight"])
    assert torch.equal(raw["norm.weight"], full["norm.weight"])


def test_wo_a_with_128_blocks_loads(tmp_path, tokenizer_json):
    sd = {"layers.0.attn.wo_a.weight": torch.randn(256, 128)}
    ckpt = write_checkpoint(tmp_path / "c", {}, sd, tokenizer_json=None)
    q, s = quantize_fp8_weight(sd["layers.0.attn.wo_a.weight"], 128)
    _replace_tensor(ckpt, "layers.0.attn.wo_a.weight", q)
    _replace_tensor(ckpt, "layers.0.attn.wo_a.scale", s)
    loaded = read_checkpoint(ckpt, {"layers.0.attn.wo_a.weight": (256, 128)})
    assert torch.equal(loaded["layers.0.attn.wo_a.weight"], dequantize_fp8_weight(q, s))


def test_ignore_prefixes_skips_towers(written):
    ckpt, sd = written
    text_only = {k: tuple(v.shape) for k, v in sd.items() if not k.startswith(("vision.", "aligner."))}
    with pytest.raises(CheckpointError, match="unexpected: vision.patch_embed.proj.weight"):
        read_checkpoint(ckpt, text_only)
    loaded = read_checkpoint(ckpt, text_only, ignore_prefixes=("vision.", "aligner."))
    assert set(loaded) == set(text_only)


# ----------------------------------------------------------------------------- validation

def test_every_problem_is_listed_in_one_error(written, tmp_path):
    ckpt = _copy_ckpt(written[0], tmp_path / "bad")
    shapes = {k: tuple(v.shape) for k, v in written[1].items()}
    _replace_tensor(ckpt, "layers.0.attn.wq_a.weight", torch.zeros(32, D))  # FP8 family stored as F32
    _replace_tensor(ckpt, "layers.0.attn.wkv.scale", torch.ones(3, 2).to(torch.float8_e8m0fnu))
    lost_shard = read_weight_map(ckpt)["layers.2.ffn.experts.1.w2.weight"]
    (ckpt / lost_shard).unlink()
    shapes["layers.0.ffn_norm.weight"] = (D + 1,)
    shapes["layers.0.attn.not_there.weight"] = (4,)
    del shapes["norm.weight"]
    with pytest.raises(CheckpointError) as err:
        iter_checkpoint(ckpt, shapes)  # raised by the call itself, before any tensor is read
    msg = str(err.value)
    assert isinstance(err.value, ValueError)
    assert "missing: layers.0.attn.not_there.weight" in msg
    assert "unexpected: norm.weight" in msg
    assert "shape: layers.0.ffn_norm.weight is [64], expected [65]" in msg
    assert "dtype: layers.0.attn.wq_a.weight is F32, expected F8_E4M3 (fp8 family)" in msg
    assert "scale: layers.0.attn.wkv.scale is [3, 2], inconsistent with weight [48, 64]" in msg
    assert f"missing shard: {lost_shard}" in msg
    assert "missing: layers.2.ffn.experts.1.w2.weight" not in msg  # reported once, as its shard


def test_fp4_scale_shape_checked(written, tmp_path):
    ckpt = _copy_ckpt(written[0], tmp_path / "bad")
    _replace_tensor(ckpt, "layers.0.ffn.experts.0.w1.scale", torch.ones(16, 3).to(torch.float8_e8m0fnu))
    with pytest.raises(CheckpointError, match=r"shape: layers.0.ffn.experts.0.w1.scale is \[16, 3\], expected \[16, 2\]"):
        read_checkpoint(ckpt, {k: tuple(v.shape) for k, v in written[1].items()})


def test_directory_errors(tmp_path, written):
    with pytest.raises(CheckpointError, match="not a directory"):
        read_config(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no config.json"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no model.safetensors.index.json"):
        census(tmp_path)
    with pytest.raises(CheckpointError, match="not an empty directory"):
        write_checkpoint(written[0], {}, {"norm.weight": torch.ones(4)}, tokenizer_json=None)


def test_index_naming_a_tensor_its_shard_lacks(written, tmp_path):
    ckpt = _copy_ckpt(written[0], tmp_path / "bad")
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"]["ghost.weight"] = index["weight_map"]["norm.weight"]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="not in its shard: ghost.weight"):
        census(ckpt)


@pytest.mark.parametrize("keep", [0.5, 100, 5], ids=["half", "header-cut", "stub"])
def test_a_truncated_shard_is_a_checkpoint_error_naming_it(written, tmp_path, keep):
    """A shard cut short (an interrupted copy or download) is named, as an error the CLI maps to
    exit 1; the tensors it holds are not listed one by one as missing or mis-typed."""
    from dsagent.errors import ERROR, exit_code_for

    ckpt = _copy_ckpt(written[0], tmp_path / "cut")
    shard = read_weight_map(ckpt)["layers.1.attn.wq_a.weight"]
    data = (ckpt / shard).read_bytes()
    (ckpt / shard).write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    shapes = {k: tuple(v.shape) for k, v in written[1].items()}
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(ckpt, shapes)
    msg = str(err.value)
    assert f"damaged shard: {shard} cannot be read" in msg and "truncated or corrupt" in msg
    assert "has shards that are missing or cannot be read" in msg and "copy or download" in msg
    assert "missing: " not in msg and "dtype: " not in msg
    code, line = exit_code_for(err.value)
    assert code == ERROR and shard in line and "internal error" not in line
    with pytest.raises(CheckpointError, match=f"damaged shard: {shard}"):
        census(ckpt)


# ----------------------------------------------------------------------------- census

def test_census_counts(written):
    ckpt, sd = written
    c = census(ckpt)
    fams = {f: [n for n in sd if stored_format(n, sd[n].shape) == f] for f in ("fp8", "fp4", "bf16", "f32")}
    assert c["by_family"]["fp4"]["tensors"] == 2 * len(fams["fp4"]) == 2 * 3 * 3 * 3
    assert c["by_family"]["fp8"]["tensors"] == 2 * len(fams["fp8"])
    assert c["by_family"]["f32"]["tensors"] == len(fams["f32"])
    assert c["by_family"]["bf16"]["tensors"] == len(fams["bf16"])
    assert c["by_dtype"]["I8"]["tensors"] == len(fams["fp4"])
    assert c["by_dtype"]["F8_E8M0"]["tensors"] == len(fams["fp4"]) + len(fams["fp8"])
    assert c["tensors"] == sum(v["tensors"] for v in c["by_dtype"].values())
    assert c["bytes"] == sum(v["bytes"] for v in c["by_family"].values())
    for fam, names in fams.items():
        assert c["by_family"][fam]["parameters"] == sum(sd[n].numel() for n in names), fam
    assert c["by_family"]["f32"]["bytes"] == 4 * sum(sd[n].numel() for n in fams["f32"])
    assert c["by_dtype"]["F32"] == {"tensors": len(fams["f32"]), "bytes": c["by_family"]["f32"]["bytes"]}


# ----------------------------------------------------------------------------- with the model

_HAVE_MODEL = all(importlib.util.find_spec(m) is not None for m in ("model.model", "model.args", "model.loading"))


@pytest.mark.skipif(not _HAVE_MODEL, reason="model.model / model.args not written yet")
def test_model_write_load_forward_equals_fake_quantized_model(tmp_path):
    from model.loading import BUNDLED_TOKENIZER, load

    model = load("tiny", seed=0)
    args, sd = model.args, model.state_dict()
    write_checkpoint(tmp_path / "m", args.to_config(), sd, tokenizer_json=BUNDLED_TOKENIZER,
                     expert_dtype=args.expert_dtype, block=args.weight_block_size, shard_bytes=4_000_000)
    assert len(set(read_weight_map(tmp_path / "m").values())) > 1
    loaded = load(tmp_path / "m")
    reference = load("tiny", seed=0)
    reference.load_state_dict(fake_quantize_like_checkpoint(sd, expert_dtype=args.expert_dtype,
                                                            block=args.weight_block_size))
    tokens = torch.randint(0, args.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want, unquantized = loaded(tokens), reference(tokens), model(tokens)
    assert torch.equal(got, want)
    assert not torch.equal(got, unquantized)  # the quantisation really happened


def test_loading_a_checkpoint_stays_off_torchs_python_decompositions():
    """The model is built on the meta device and filled from the files; an op computed on meta
    tensors there (an embedding's init, the RoPE tables' arithmetic, ``to_empty``) imports torch's
    symbolic-shape machinery (sympy, dynamo: ~1.5 s of every CLI start, once measured). Checked in
    a fresh interpreter by the modules it leaves imported, not by a clock."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    code = ("import sys; from model.loading import load; load(sys.argv[1]); "
            "print(sorted(m for m in ('sympy', 'torch._dynamo') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code, str(root / "model" / "assets" / "default")], cwd=root,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", r.stdout


def test_fingerprint_ignores_the_training_record_but_not_the_config(tmp_path) -> None:
    """A checkpoint's KV fingerprint: its notes (``TRAINING.json``) edited, the same; its
    config edited, another (a session's stored KV then rebuilds from its token log)."""
    import shutil

    from model.args import ModelArgs
    from model.loading import fingerprint

    src = Path(__file__).resolve().parents[1] / "model" / "assets" / "default"
    ckpt = Path(shutil.copytree(src, tmp_path / "ckpt"))

    class Shaped:  # what fingerprint reads of a model: its args
        args = ModelArgs.from_file(ckpt)

    before = fingerprint(Shaped, ckpt)
    record = json.loads((ckpt / "TRAINING.json").read_text())
    (ckpt / "TRAINING.json").write_text(json.dumps(dict(record, note="edited")))
    assert fingerprint(Shaped, ckpt) == before
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(config, indent=2))  # the same values, other bytes
    assert fingerprint(Shaped, ckpt) != before
