"""The grouped MoE path against the per-expert loop, the stacked expert weights, and
``bench_linears``' FLOP accounting.

The grouped path (``model.moe.GroupedExperts``) sorts the (token, slot) pairs by expert
and runs w1/w3/w2 as ``torch._grouped_mm`` over three [E, out, in] stacks whose slices are
the experts' own Linear weights. On this CPU build ``torch._grouped_mm`` takes fp32, bf16
and fp16 (a loop of mm per group inside torch; rows past the last offset are left
uninitialised, offsets must be int32, the output dtype must be the input's, every row
stride a multiple of 16 bytes, no float64, no backward). Measured here: grouped == loop
bit for bit in fp32 and in bf16 (max |diff| 0.0 on a MoE and on the tiny model's logits),
since each expert's rows meet the same mm in the same order and ``index_add_`` adds a
token's expert outputs in ascending expert order like the loop. The tolerances below
(fp32 1e-6, bf16 2^-7, relative to the largest output) leave room only for a BLAS that
blocks a sliced operand differently. The CUDA test runs the sm90/sm100 kernel; its
tolerance is a bf16 rounding of each expert's output (not measured here: no GPU).
"""
from __future__ import annotations

import math

import pytest
import torch
from torch.overrides import TorchFunctionMode

import model
from model.args import ModelArgs
from model.bench import bench_linears
from model.loading import BUNDLED_TOKENIZER, bind_tokenizer, build, cast_model
from model.moe import MoE, grouped_mm_supported
from model.training import add_weight_qat, remove_weight_qat

TINY = ModelArgs.preset("tiny")  # D 128, 8 experts of width 128, top-2
TOL = {torch.float32: 1e-6, torch.bfloat16: 2 ** -7}


def make_moe(dtype=torch.float32, seed: int = 0) -> MoE:
    """A tiny MoE with skewed routing: expert 0 never picked, expert 1 by every text token;
    image tokens (bias_vl) never pick expert 1 and all pick expert 7."""
    g = torch.Generator().manual_seed(seed)
    moe = MoE(TINY)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
        moe.gate.bias.copy_(torch.tensor([-100.0, 100.0, 0, 0, 0, 0, 0, 0]))
        moe.gate.bias_vl.copy_(torch.tensor([-100.0, -100.0, 0, 0, 0, 0, 0, 100.0]))
    moe.to(dtype).stack_experts()
    return moe


def inputs(shape: tuple, dtype, seed: int = 1, image: bool = False):
    """Hidden states [*shape, D] large enough that the swiglu clamps (limit 10) bite."""
    g = torch.Generator().manual_seed(seed)
    x = (20 * torch.randn(*shape, TINY.hidden_size, generator=g)).to(dtype)
    mask = torch.rand(shape, generator=g) < 0.5 if image else None
    return x, mask


class Calls:
    """Counts the forward calls of a module while in the ``with`` block."""

    def __init__(self, module: torch.nn.Module):
        self.module, self.n = module, 0

    def __enter__(self):
        self.handle = self.module.register_forward_hook(lambda *_: setattr(self, "n", self.n + 1))
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def routed(moe: MoE, x, mask, grouped: bool, monkeypatch) -> torch.Tensor:
    monkeypatch.setenv("DSAGENT_GROUPED_MOE", "1" if grouped else "0")
    with torch.no_grad(), Calls(moe.grouped) as calls:
        y = moe(x, mask)
    assert calls.n == int(grouped)  # the switch chose the path
    return y


def assert_close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    err = (a.float() - b.float()).abs().max().item()
    assert err <= tol * b.float().abs().max().item(), err


# ----------------------------------------------------------------------------- grouped == loop

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (2, 150)])
@pytest.mark.parametrize("image", [False, True])
def test_grouped_equals_loop_on_uneven_loads(dtype, shape, image, monkeypatch):
    moe = make_moe(dtype)
    x, mask = inputs(shape, dtype, image=image)
    _, picked = moe.gate(x.reshape(-1, x.shape[-1]), None if mask is None else mask.reshape(-1))
    loads = torch.bincount(picked.flatten(), minlength=8)
    assert loads[0] == 0  # an expert without tokens inside the grouped GEMMs
    assert moe.experts[1].w1(x).max() > TINY.swiglu_limit  # the clamps matter
    if shape[1] > 1:
        assert loads.max() >= 2 * loads[2:].float().mean()  # uneven
    assert_close(routed(moe, x, mask, True, monkeypatch), routed(moe, x, mask, False, monkeypatch), TOL[dtype])


def test_image_tokens_route_through_bias_vl(monkeypatch):
    """The image mask reaches the gate on both paths: all-image and all-text differ."""
    moe = make_moe()
    x, _ = inputs((1, 16), torch.float32)
    text, images = torch.zeros(1, 16, dtype=torch.bool), torch.ones(1, 16, dtype=torch.bool)
    for grouped in (True, False):
        assert not torch.equal(routed(moe, x, text, grouped, monkeypatch), routed(moe, x, images, grouped, monkeypatch))


class HostReads(TorchFunctionMode):
    """Test double that records calls which read tensor values on the host (syncs on CUDA)."""
    READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
             torch.Tensor.__index__, torch.Tensor.__float__, torch.Tensor.unique, torch.unique,
             torch.Tensor.nonzero, torch.nonzero, torch.Tensor.cpu, torch.bincount}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        one_arg_where = func is torch.where and len(args) == 1
        bool_index = func is torch.Tensor.__getitem__ and getattr(args[1], "dtype", None) == torch.bool
        if func in self.READS or one_arg_where or bool_index:
            self.seen.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("grouped", [True, False])
def test_only_the_loop_reads_expert_ids_on_the_host(grouped, monkeypatch):
    moe = make_moe()
    x, mask = inputs((1, 9), torch.float32, image=True)
    monkeypatch.setenv("DSAGENT_GROUPED_MOE", "1" if grouped else "0")
    with torch.no_grad(), HostReads() as reads:
        moe(x, mask)
    assert bool(reads.seen) != grouped, reads.seen


def test_autograd_takes_the_loop_and_training_is_unchanged_by_stacking():
    """With gradients the loop runs; outputs and gradients equal an unstacked MoE's bit for bit."""
    stacked, plain = make_moe(), MoE(TINY)
    plain.load_state_dict(stacked.state_dict())
    x, mask = inputs((2, 20), torch.float32, image=True)
    results = []
    for moe in (stacked, plain):
        with Calls(moe.grouped) as calls:
            y = moe(x, mask)
        y.square().sum().backward()
        assert calls.n == 0
        results.append((y, {n: p.grad for n, p in moe.named_parameters() if p.grad is not None}))
    (y1, g1), (y2, g2) = results
    assert torch.equal(y1, y2) and g1.keys() == g2.keys()
    assert all(torch.equal(g1[n], g2[n]) for n in g1)


def test_dense_training_path_equals_the_loop_with_gradients_and_reads_nothing_on_the_host(monkeypatch):
    """The sync-free training path (every expert on every token, gate-weighted) gives the
    loop's outputs and gradients — gate included — under QAT weights too, and never reads
    expert ids on the host. It runs on CUDA only; here it is switched on by hand."""
    results = []
    for dense in (True, False):
        net = build(TINY, seed=4)
        add_weight_qat(net)
        moe = net.layers[0].ffn
        with torch.no_grad():
            moe.gate.bias.copy_(torch.tensor([-100.0, 100.0, 0, 0, 0, 0, 0, 0]))  # skewed: expert 0 idle
        monkeypatch.setattr(MoE, "runs_dense", lambda self, x, _on=dense: _on)
        x, mask = inputs((2, 20), torch.float32, image=True)
        x = (x / 20).requires_grad_(True)
        with HostReads() as reads:
            y = moe(x, mask)
        assert bool(reads.seen) != dense, reads.seen
        y.square().sum().backward()
        results.append((y.detach(), x.grad, {n: p.grad for n, p in moe.named_parameters() if p.grad is not None}))
    (y1, x1, g1), (y2, x2, g2) = results
    torch.testing.assert_close(y1, y2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x1, x2, rtol=1e-4, atol=1e-5)
    assert any(n.startswith("gate.") for n in g1) and g1.keys() >= g2.keys()
    for name in g2:
        torch.testing.assert_close(g1[name], g2[name], rtol=1e-4, atol=1e-5, msg=name)
    for name in set(g1) - set(g2):  # the dense path also differentiates experts no token picked: zero
        assert not g1[name].any(), name


def test_dense_path_is_for_training_on_cuda_with_few_experts(monkeypatch):
    moe = make_moe()
    x = torch.zeros(3, TINY.hidden_size)
    assert not moe.runs_dense(x)  # the CPU: the loop
    cuda_like = type("T", (), {"is_cuda": True})()
    assert moe.runs_dense(cuda_like) and len(moe.experts) == 4 * moe.gate.top_k
    with torch.no_grad():
        assert not moe.runs_dense(cuda_like)
    monkeypatch.setenv("DSAGENT_DENSE_MOE", "0")
    assert not moe.runs_dense(cuda_like)


def test_weight_qat_takes_the_loop_until_removed(monkeypatch):
    """Under training's QAT the experts compute with quantised weights the stacks do not hold."""
    net = build(TINY)
    moe = net.layers[0].ffn
    x, _ = inputs((1, 5), torch.float32)
    monkeypatch.delenv("DSAGENT_GROUPED_MOE", raising=False)
    add_weight_qat(net)
    with torch.no_grad(), Calls(moe.grouped) as calls:
        moe(x)
    assert calls.n == 0
    remove_weight_qat(net)
    assert_shared(net)
    with torch.no_grad(), Calls(moe.grouped) as calls:
        moe(x)
    assert calls.n == 1


def test_tiny_model_logits_grouped_equal_loop(monkeypatch):
    net = model.load("tiny")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, TINY.vocab_size, (2, 40), generator=g)
    mask = torch.zeros(2, 40, dtype=torch.bool)
    mask[:, 10:26] = True
    embeds = torch.randn(2, 40, TINY.hidden_size, generator=g)
    logits = {}
    for grouped in (True, False):
        monkeypatch.setenv("DSAGENT_GROUPED_MOE", "1" if grouped else "0")
        with torch.no_grad(), Calls(net.layers[5].ffn.grouped) as calls:
            logits[grouped] = net(ids, image_embeds=embeds, image_mask=mask)
        assert calls.n == int(grouped)
    assert_close(logits[True], logits[False], TOL[torch.float32])


# ----------------------------------------------------------------------------- stacked weights

def moes(net: torch.nn.Module) -> list[MoE]:
    return [m for m in net.modules() if isinstance(m, MoE)]


def assert_shared(net: torch.nn.Module) -> None:
    """Every routed expert weight is its stack's slice: same memory, nothing duplicated."""
    for moe in moes(net):
        for name in ("w1", "w2", "w3"):
            stack = getattr(moe.grouped, name).weight
            for i, e in enumerate(moe.experts):
                w = getattr(e, name).weight
                assert w.data_ptr() == stack[i].data_ptr() and w.dtype == stack.dtype and w.shape == stack.shape[1:]
                assert w.untyped_storage().data_ptr() == stack.untyped_storage().data_ptr()


def test_load_stacks_and_writes_through():
    net = model.load("tiny")
    assert_shared(net)
    moe = net.layers[3].ffn
    before = moe.experts[5].w2.weight.clone()
    moe.grouped.w2.weight[5].add_(1.0)
    assert torch.equal(moe.experts[5].w2.weight, before + 1.0)


def test_conversions_and_assigning_loads_keep_the_sharing():
    net = build(TINY)
    cast_model(net, torch.bfloat16)
    assert_shared(net)
    assert moes(net)[0].grouped.w1.weight.dtype == torch.bfloat16
    fresh = {k: v.clone() + 1 for k, v in net.state_dict().items()}
    net.load_state_dict(fresh, assign=True)
    assert_shared(net)
    assert torch.equal(net.layers[2].ffn.grouped.w3.weight[4], fresh["layers.2.ffn.experts.4.w3.weight"])
    net.to(torch.float32)
    assert_shared(net)


def test_state_dict_names_and_round_trip_unchanged(tmp_path):
    from safetensors.torch import load_file, save_file

    net = model.load("tiny")
    unstacked = build(TINY, device="meta")
    assert list(net.state_dict()) == list(unstacked.state_dict())  # no new names, same order
    save_file(net.state_dict(), str(tmp_path / "w.safetensors"))
    other = build(TINY, seed=5)
    other.load_state_dict(load_file(str(tmp_path / "w.safetensors")))
    assert_shared(other)
    bind_tokenizer(other, BUNDLED_TOKENIZER)
    ids = torch.randint(3, TINY.vocab_size, (1, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(other(ids), net(ids))


def test_checkpoint_load_stacks(tmp_path, monkeypatch):
    from model.checkpoint import write_checkpoint

    src = model.load("tiny")
    write_checkpoint(tmp_path / "ck", TINY.to_config(), src.state_dict(), tokenizer_json=BUNDLED_TOKENIZER)
    net = model.load(tmp_path / "ck")
    assert_shared(net)
    ids = torch.randint(3, TINY.vocab_size, (1, 24), generator=torch.Generator().manual_seed(6))
    logits = {}
    for grouped in (True, False):
        monkeypatch.setenv("DSAGENT_GROUPED_MOE", "1" if grouped else "0")
        with torch.no_grad():
            logits[grouped] = net(ids)
    assert_close(logits[True], logits[False], TOL[torch.float32])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_grouped_matches_loop(monkeypatch):
    moe = make_moe(torch.bfloat16).cuda()
    assert_shared(moe)
    x, mask = inputs((2, 300), torch.bfloat16, image=True)
    x, mask = x.cuda(), mask.cuda()
    if not grouped_mm_supported(x, TINY.moe_intermediate_size):
        pytest.skip("no sync-free torch._grouped_mm on this GPU (needs sm90/sm100)")
    # bf16: each expert's output is rounded once on both paths, after sums in different orders
    assert_close(routed(moe, x, mask, True, monkeypatch), routed(moe, x, mask, False, monkeypatch), 2 ** -6)


# ----------------------------------------------------------------------------- bench_linears

def expected_flops(a: ModelArgs, tokens: int) -> dict[str, int]:
    """FLOPs of one exact prefill chunk by hand: 2·M·K·N per GEMM, every layer on every token,
    the head on the last position only; wo_a is an einsum on its weight, not a Linear call."""
    D, L, inter, k = a.hidden_size, a.num_hidden_layers, a.moe_intermediate_size, a.num_experts_per_tok
    attn = D * a.q_lora_rank + a.q_lora_rank * a.num_attention_heads * a.head_dim + D * a.head_dim \
        + a.o_groups * a.o_lora_rank * D  # wq_a, wq_b, wkv, wo_b
    return {"attention": 2 * tokens * attn * L, "routed_experts": 2 * tokens * k * 3 * D * inter * L,
            "shared_experts": 2 * tokens * 3 * D * inter * L, "head": 2 * D * a.vocab_size,
            "engram": 2 * tokens * a.engram_n_cols * a.engram_head_dim * D * (a.hc_mult + 1) * len(a.engram_layer_ids)}


@pytest.mark.parametrize("grouped", [True, False])
def test_bench_linears_counts_flops_by_hand(grouped, monkeypatch):
    monkeypatch.setenv("DSAGENT_GROUPED_MOE", "1" if grouped else "0")
    out = bench_linears(model.load("tiny"), tokens=32, matmul_size=256, repeats=3)
    assert out["moe_path"] == ("grouped" if grouped else "loop")
    for kind, flops in expected_flops(TINY, 32).items():
        assert out["by_kind"][kind]["flops"] == flops, kind
    assert out["linear_flops"] == sum(k["flops"] for k in out["by_kind"].values())
    calls = out["by_kind"]["routed_experts"]["calls"]  # grouped: w1, w3, w2 per layer; loop: per expert with tokens
    assert calls == 3 * TINY.num_hidden_layers if grouped else calls > 3 * TINY.num_hidden_layers
    assert out["linears_not_called"]["attn.wo_a"] == list(range(TINY.num_hidden_layers))
    for key in ("matmul_tflops", "linear_tflops", "linear_over_matmul", "linear_share_of_prefill"):
        assert math.isfinite(out[key]) and out[key] > 0, key
    assert out["linear_seconds"] < out["prefill_seconds"]


def test_bench_linears_counts_a_packed_models_flops_by_format():
    """Packed weights (FP8 projections and shared experts, FP4 routed experts): the same FLOPs
    by hand (a packed weight's last dimension is not its inputs), the FP4 experts' up projection
    one call of two products (w1 with w3), and the FLOPs split by the format each weight holds."""
    out = bench_linears(model.load("tiny", weights="packed"), tokens=32, matmul_size=256, repeats=3)
    expected = expected_flops(TINY, 32)
    for kind, flops in expected.items():
        assert out["by_kind"][kind]["flops"] == flops, kind
    assert out["by_kind"]["routed_experts"]["calls"] == 2 * TINY.num_hidden_layers
    formats = out["by_format"]
    assert formats["fp4"]["flops"] == expected["routed_experts"]
    assert formats["fp8"]["flops"] >= expected["attention"] + expected["shared_experts"]
    assert sum(f["flops"] for f in formats.values()) == out["linear_flops"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_training_takes_the_dense_path_and_matches_the_loop(monkeypatch):
    """On CUDA with gradients the dense path runs (no host reads) and gives the loop's
    outputs and input gradients (fp32, TF32 off)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    results = []
    for dense in ("1", "0"):
        monkeypatch.setenv("DSAGENT_DENSE_MOE", dense)
        moe = make_moe().cuda()
        x, mask = inputs((2, 33), torch.float32, image=True)
        x, mask = (x / 20).cuda().requires_grad_(True), mask.cuda()
        assert moe.runs_dense(x.view(-1, x.shape[-1])) == (dense == "1")
        with HostReads() as reads:
            y = moe(x, mask)
        assert bool(reads.seen) != (dense == "1"), reads.seen
        y.square().sum().backward()
        results.append((y.detach(), x.grad))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_a_ranks_grouped_experts_are_its_loop_over_its_range(rank):
    """One rank of four holds experts [2 rank, 2 rank + 2): its grouped path gives what its loop
    gives (other ranks' experts left out, their pairs zero), the pairs routed elsewhere sorted
    past its last group, whose rows no GEMM writes. The sum over the ranks is the whole MoE's
    (tests/test_parallel.py runs it over processes)."""
    from model.linear import World

    whole = make_moe()
    part = MoE(TINY, world=World(rank, 4))
    part.load_state_dict({k: v for k, v in whole.state_dict().items()  # the shared expert's slices unused here
                          if k in part.state_dict() and not k.startswith("shared_experts.")}, strict=False)
    part.stack_experts()
    assert part.grouped.first == 2 * rank and part.grouped.w1.weight.shape[0] == 2
    x, _ = inputs((24,), torch.float32)
    with torch.no_grad():
        weights, indices = part.gate(x, None)
        grouped, loop = part.grouped(x, weights, indices), part._loop(x, weights, indices)
        assert part.runs_grouped(x)
    tol = TOL[torch.float32] * loop.abs().max()
    torch.testing.assert_close(grouped, loop, rtol=0, atol=tol)
    mine = ((indices >= 2 * rank) & (indices < 2 * rank + 2)).any(1)
    assert bool((grouped[~mine] == 0).all()) and bool(grouped[mine].abs().amax(1).gt(0).all())
