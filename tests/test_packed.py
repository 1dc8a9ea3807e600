"""Weights kept as the checkpoint stores them (``load(..., weights="packed")``): the same bytes
on the model as in the files, the same logits as the dequantised model, the same values
whether a preset is packed whole or built part by part.

Bit for bit on the twins: the prefill GEMMs' kernels, which run where Triton does (the
interpreter included), sum in another order and are tested to a tolerance in
``test_packed_gemm``, so they are off here."""
from __future__ import annotations

import pytest
import torch

from model.checkpoint import read_checkpoint, write_checkpoint
from model.linear import Linear
from model.loading import BUNDLED_TOKENIZER, build, expected_shapes, load, pack_weights


@pytest.fixture(autouse=True)
def twins_for_prefill(monkeypatch):
    monkeypatch.setenv("DSAGENT_PACKED_GEMM", "0")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The tiny preset written as an official checkpoint in several shards (once a module)."""
    path = tmp_path_factory.mktemp("packed") / "m"
    model = load("tiny", seed=0)
    write_checkpoint(path, model.args.to_config(), model.state_dict(), tokenizer_json=BUNDLED_TOKENIZER,
                     expert_dtype=model.args.expert_dtype, block=model.args.weight_block_size, shard_bytes=4_000_000)
    return path


def test_a_packed_load_holds_the_stored_bytes_and_computes_the_dequantised_model(written):
    path = written
    packed, plain = load(path, weights="packed"), load(path)
    linears = [m for m in packed.modules() if isinstance(m, Linear)]
    fp8 = [m for m in linears if m.fmt == "fp8"]
    fp4 = [m for m in linears if m.fmt == "fp4"]
    assert fp8 and fp4 and len(fp4) == 3 * packed.args.n_routed_experts * packed.args.num_hidden_layers
    stored = read_checkpoint(path, expected_shapes(packed), compressed=True)
    for name, t in packed.state_dict().items():
        if name.endswith(".scale") or t.dtype in (torch.float8_e4m3fn, torch.int8):
            assert torch.equal(_bytes(t), _bytes(stored[name])), name
    tokens = torch.randint(0, packed.args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(packed(tokens), plain(tokens))


def test_a_packed_model_holds_about_the_checkpoints_bytes(written):
    path = written
    model = load(path, weights="packed", dtype=torch.bfloat16)
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    on_disk = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    assert held <= 1.05 * on_disk, (held, on_disk)
    plain = load(path, dtype=torch.bfloat16)
    assert held < 0.6 * sum(t.numel() * t.element_size() for t in plain.state_dict().values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_preset_built_packed_part_by_part_equals_one_packed_whole(dtype):
    """The same seeded stream, the same roundings: a benchmark of packed against plain weights
    compares one model's two forms."""
    from model.args import ModelArgs

    args = ModelArgs.preset("tiny")
    by_part, whole = build(args, dtype=dtype, weights="packed"), pack_weights(build(args, dtype=dtype))
    a, b = by_part.state_dict(), whole.state_dict()
    assert list(a) == list(b) and all(torch.equal(_bytes(a[k]), _bytes(b[k])) for k in a)
    assert build(args).state_dict().keys() <= a.keys()


def test_a_cast_leaves_the_packed_bytes_as_they_are():
    layer = Linear(64, 32, fmt="fp8")
    weight, scale = layer.weight.detach().clone(), layer.scale.detach().clone()
    layer.to(torch.bfloat16)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.scale.dtype == torch.float8_e8m0fnu
    assert torch.equal(_bytes(layer.weight), _bytes(weight)) and torch.equal(_bytes(layer.scale), _bytes(scale))
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert layer(x).dtype == torch.bfloat16


def test_a_packed_model_decodes_through_the_engine(written):
    from model.engine import Engine

    path = written
    outs = []
    for weights in ("packed", "plain"):
        model = load(path, weights=weights)
        engine = Engine(model, mode="ced", chunk=32)
        state = engine.new_state()
        engine.prefill(state, torch.randint(3, 1000, (1, 70), generator=torch.Generator().manual_seed(1)))
        token = state.last_logits.argmax(-1)
        outs.append([engine.decode(state, token).clone() for _ in range(3)])
    from model import kernels

    if kernels.enabled(outs[0][0]):  # the packed layers on their kernels (the interpreter's): sums in another order
        for a, b in zip(*outs):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())
    else:  # both on the twins: the dequantised weights' bits
        assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_packed_weights_take_the_fused_steps_twins(written, monkeypatch):
    """The fused decode step (on its PyTorch twins here) reads packed projections through the
    linear family: the same logits as the plain model's fused steps."""
    from model import decode_step
    from model.engine import Engine

    monkeypatch.setattr(decode_step, "takes_fused", decode_step.is_decode_step)
    path = written
    outs = []
    for weights in ("packed", "plain"):
        engine = Engine(load(path, weights=weights), mode="ced", chunk=32)
        state = engine.new_state()
        engine.prefill(state, torch.randint(3, 1000, (1, 70), generator=torch.Generator().manual_seed(2)))
        token = state.last_logits.argmax(-1)
        outs.append([engine.decode(state, token).clone() for _ in range(3)])
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_a_truncated_single_file_checkpoint_is_named(tmp_path):
    from model.args import ConfigError, ModelArgs
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(__import__("json").dumps(ModelArgs.preset("tiny").to_config()))
    save_file({"embed.weight": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match="model.safetensors does not read as safetensors"):
        load(tmp_path)
