"""The fused MoE decode kernels (``model.kernels.moe``) against the MoE's torch path, their twin.

Runs on CUDA when present, else under ``TRITON_INTERPRET=1`` (Triton's CPU interpreter) with
fewer cases, else skips; the torch path itself is what every other test runs on the CPU.
Tolerances: the kernels reduce their dot products in another order than torch, so fp32
agrees to ~1e-5; in bf16 a GEMM output rounded to bf16 can land one bf16 step away (2^-8
relative), and that step carries through the SwiGLU and ``w2``.
"""
from __future__ import annotations

import itertools
import importlib.util
import os

import pytest
import torch

import model.kernels as kernels
from model.args import ModelArgs
from model import decode_step as ds
from model.moe import MoE
from tests.hopper import compile_for_hopper
from tests.interpreted import interpretable

ON_CUDA = torch.cuda.is_available()
INTERPRETED = not ON_CUDA  # the kernels run under TRITON_INTERPRET=1 where they run at all
DEVICE = "cuda" if ON_CUDA else "cpu"
pytestmark = pytest.mark.skipif(not kernels.triton_available(),
                                reason="needs Triton with CUDA, or TRITON_INTERPRET=1 for its CPU interpreter")


def random_moe(scoring: str, dtype: torch.dtype, seed: int, **shape) -> MoE:
    """A MoE of the tiny preset (or ``shape``) with random weights, its experts stacked."""
    args = ModelArgs.preset("tiny").replace(scoring_func=scoring, **shape)
    g = torch.Generator().manual_seed(seed)
    moe = MoE(args)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            std = 0.01 if name.endswith("bias") else p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=g) * std)
    moe = moe.to(DEVICE, dtype).eval().requires_grad_(False)
    moe.stack_experts()  # as model.loading.build does
    return moe


def torch_path(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    before = os.environ.get("DSAGENT_FUSED_MOE")
    os.environ["DSAGENT_FUSED_MOE"] = "0"
    try:
        with torch.no_grad():
            return moe(x)
    finally:
        if before is None:
            del os.environ["DSAGENT_FUSED_MOE"]
        else:
            os.environ["DSAGENT_FUSED_MOE"] = before


CASES = (list(itertools.product([torch.float32, torch.bfloat16], ["sqrtsoftplus", "sigmoid", "softmax"], [1, 3, 16],
                                [1.0, 20.0]))
         if ON_CUDA else [(torch.float32, "sqrtsoftplus", 1, 1.0), (torch.bfloat16, "sqrtsoftplus", 3, 1.0),
                          (torch.float32, "sigmoid", 2, 20.0), (torch.bfloat16, "softmax", 16, 1.0)])


def decode_call(moe: MoE, x: torch.Tensor, **kw) -> torch.Tensor:
    """``kernels.moe_decode`` on ``moe``'s own weights (FP4 stacks with their scales, a packed
    shared expert as its GEMV reads it), as ``decode_step._moe_fused`` calls it."""
    g, shared = moe.gate, moe.shared_experts
    routed = (moe.grouped.w1, moe.grouped.w3, moe.grouped.w2)
    weights = (x, g.weight, g.bias, *(r.weight for r in routed),
               *(getattr(shared, name).gemv_weight() for name in ("w1", "w3", "w2")))
    config = dict(top_k=g.top_k, scoring=g.args.scoring_func, temp=g.args.gate_temp, norm=g.args.norm_topk_prob,
                  scale=g.args.routed_scaling_factor, limit=shared.limit,
                  scales=None if moe.grouped.fmt == "plain" else tuple(r.scale for r in routed))
    with torch.no_grad():
        return kernels.moe_decode(*weights, **config, **kw)


# under the interpreter only the form without channel loops (its ``range`` over a runtime width is
# not the interpreter's): every kernel of it runs there, and the others on the GPU
FORMS = ["by-pair", "by-pair-slots", "by-pair-early", "by-expert"] if ON_CUDA else ["by-pair-early"]


@pytest.fixture(autouse=True)
def _interpretable_defaults(monkeypatch):
    interpretable(monkeypatch)


def use_form(form: str, monkeypatch) -> None:
    """The experts' kernels by (token, slot) pair — "by-pair": the down sum slot by slot and
    the gate's and up kernel's channel loops; "by-pair-slots": the defaults (every slot's rows
    at once, ``DOWN_SLOTS``; the gate's and up kernel's weights asked for before the wait,
    ``GATE_EARLY`` / ``UP_EARLY``); "by-pair-early": the down sum's too (``DOWN_EARLY``, the
    form the interpreter runs whole) — or grouped by expert, whatever the token count."""
    from model.kernels import moe as kmoe

    monkeypatch.setattr(kmoe, "GROUPED_TOKENS", 1 if form == "by-expert" else kernels.MOE_TOKENS + 1)
    monkeypatch.setattr(kmoe, "DOWN_SLOTS", form in ("by-pair-slots", "by-pair-early"))
    early = {"by-pair": False, "by-pair-early": True}.get(form)  # by-pair-slots: the defaults
    if early is not None:
        for knob in ("GATE_EARLY", "UP_EARLY", "DOWN_EARLY"):
            monkeypatch.setattr(kmoe, knob, early)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype,scoring,n,spread", CASES)
def test_moe_kernel_matches_the_torch_path(dtype, scoring, n, spread, form, monkeypatch):
    """Tokens of unit RMS, and ``spread`` 20 for inputs whose SwiGLU hits the clamps; each
    form of the experts' kernels."""
    use_form(form, monkeypatch)
    moe = random_moe(scoring, dtype, seed=n)
    x = torch.randn(n, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(1)) * spread
    x = x.to(DEVICE, dtype)
    with torch.no_grad():
        assert ds.moe_runs_fused(moe, x)
        out = ds.moe_step(moe, x)
    ref = torch_path(moe, x)
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
    rtol = 1e-5 if dtype == torch.float32 else 2 ** -6
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=rtol * ref.float().abs().max().item())


@pytest.mark.skipif(INTERPRETED, reason="the grouped and looped forms: their channel loops are not the interpreter's")
def test_grouped_experts_serve_every_token_that_shares_them():
    """16 tokens over 8 experts, top-2: every expert serves several tokens, in different
    slots. The grouped form agrees with the form by pair to fp32 rounding, token by token
    (a row written to another token's place, or a slot left out, would be off by a whole
    expert's output), and picks itself at this token count."""
    from model.kernels import moe as kmoe

    moe = random_moe("sigmoid", torch.float32, seed=11)
    x = torch.randn(16, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(6)).to(DEVICE)
    with torch.no_grad():
        _, chosen = moe.gate(x, None)
    counts = torch.bincount(chosen.flatten().cpu(), minlength=8)
    assert (counts >= 2).all() and len({tuple(r) for r in chosen.cpu().sort(1).values.tolist()}) > 1
    by_pair, by_expert = decode_call(moe, x, grouped=False), decode_call(moe, x, grouped=True)
    assert 16 >= kmoe.GROUPED_TOKENS and torch.equal(decode_call(moe, x), by_expert)
    torch.testing.assert_close(by_expert, by_pair, rtol=1e-5, atol=1e-5 * by_pair.abs().max().item())


@pytest.mark.skipif(INTERPRETED, reason="the grouped and looped forms: their channel loops are not the interpreter's")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_down_sum_with_every_slot_at_once_matches_the_slot_by_slot_sum(dtype, monkeypatch):
    """``DOWN_SLOTS``: the same slots rounded and added in the same order, so the two down
    kernels differ only by their dots' order (fp32: rounding; bf16: a slot's product may
    round one bf16 step apart); top-3 of 8 and the shared expert (4 slots in a tile of 4),
    then top-4 (5 slots in a tile of 8, three masked)."""
    from model.kernels import moe as kmoe

    for top_k in (3, 4):
        moe = random_moe("sigmoid", dtype, seed=13 + top_k, num_experts_per_tok=top_k)
        x = torch.randn(3, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(8)).to(DEVICE, dtype)
        slot_by_slot = decode_call(moe, x, grouped=False)
        monkeypatch.setattr(kmoe, "DOWN_SLOTS", True)
        at_once = decode_call(moe, x, grouped=False)
        monkeypatch.setattr(kmoe, "DOWN_SLOTS", False)
        tol = 1e-5 if dtype == torch.float32 else 2 ** -7
        torch.testing.assert_close(at_once, slot_by_slot, rtol=tol, atol=tol * slot_by_slot.abs().max().item())
        # a slot left out or counted twice would be off by a whole expert's output
        assert (at_once - slot_by_slot).abs().max() < 0.05 * slot_by_slot.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_down_sum_asked_for_before_its_wait_matches_the_looped_one(dtype, monkeypatch):
    """``DOWN_EARLY``: the experts' ids and whole tile read before the wait, the intermediate
    channels in one tile (96 of 128, the rest masked) where the loop takes three chunks of 32:
    the same slots in the same order, the dots in another (fp32: rounding; bf16: a slot's
    product a bf16 step apart); 1 token and 3, top-3 of 8 and the shared expert (5 output
    rows a token, a block of 4 masked); each against the products summed in torch. Under the
    interpreter the early form alone."""
    from model.kernels import moe as kmoe

    monkeypatch.setattr(kmoe, "SLOTS_BLOCK_I", 32)
    g = torch.Generator().manual_seed(21)
    E, D, I, K = 8, 5, 96, 3
    w2, s2 = (torch.randn(*shape, generator=g).to(DEVICE, dtype) * I ** -0.5 for shape in ((E, D, I), (D, I)))
    for n in (1, 3):
        h = torch.randn(n * K + n, I, generator=g).to(DEVICE, dtype)
        chosen = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]).to(DEVICE)
        outs = {}
        for early in (True,) if INTERPRETED else (False, True):  # the loop's range(I) is not the interpreter's
            monkeypatch.setattr(kmoe, "DOWN_EARLY", early)
            outs[early] = kmoe.down_slots(h, w2, s2, chosen, torch.empty(n, D, dtype=dtype, device=DEVICE))
        want = torch.stack([sum((h[t * K + k].float() @ w2[chosen[t, k]].float().T).to(dtype).float()
                                for k in range(K)) + (h[n * K + t].float() @ s2.float().T).to(dtype).float()
                            for t in range(n)])
        tol = 1e-5 if dtype == torch.float32 else 2 ** -7
        for out in outs.values():
            torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol * want.abs().max().item())
        if False in outs:
            torch.testing.assert_close(outs[True], outs[False], rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("form", FORMS)
def test_moe_kernel_normalises_a_site_input_left_to_it(form, monkeypatch):
    """``x_norm``: tokens before the FFN site's RMSNorm (of RMS 5, not 1); the gate-logits launch
    normalises them and writes them for the experts: the output agrees with the MoE of the
    normalised tokens (the norm kernel's; the norm's rounding apart), for each form."""
    use_form(form, monkeypatch)
    moe = random_moe("sqrtsoftplus", torch.bfloat16, seed=17)
    D = moe.gate.weight.shape[1]
    g = torch.Generator().manual_seed(5)
    raw = (torch.randn(3, D, generator=g) * 5).to(DEVICE, torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(D, generator=g)).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        want = decode_call(moe, kernels.rms_norm(raw, weight, 1e-6))
    got = decode_call(moe, raw, x_norm=(weight, 1e-6))
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item())
    assert not torch.allclose(decode_call(moe, raw), want, rtol=0.05, atol=0.05 * want.abs().max().item())


@pytest.mark.parametrize("rows", [512, 2])
def test_moe_kernel_splits_the_gate_over_channel_chunks(rows, monkeypatch):
    """512 channels: the gate's logits are summed from 4 chunks of 128; with ``GATE_ROWS`` 2
    each chunk's 8 experts are 4 programs' (a row written to another block's place would route
    to other experts, a whole expert's output off)."""
    from model.kernels import moe as kmoe

    monkeypatch.setattr(kmoe, "GATE_ROWS", rows)
    moe = random_moe("sqrtsoftplus", torch.bfloat16, seed=5, hidden_size=512)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        out = ds.moe_step(moe, x)
        routed = kmoe.route(x, moe.gate.weight, moe.gate.bias, {}, top_k=moe.gate.top_k, scoring="sqrtsoftplus",
                            temp=moe.gate.args.gate_temp, norm=moe.gate.args.norm_topk_prob,
                            scale=moe.gate.args.routed_scaling_factor)
        weights, chosen = moe.gate(x, None)
    ref = torch_path(moe, x)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -6, atol=2 ** -6 * ref.float().abs().max().item())
    assert torch.equal(routed[2].sort(1).values, chosen.sort(1).values)
    torch.testing.assert_close(routed[1].sort(1).values, weights.float().sort(1).values, rtol=2 ** -7, atol=1e-6)


@pytest.mark.skipif(not ON_CUDA, reason="the small preset's widths, on the GPU")
@pytest.mark.parametrize("n,slots", [(1, False), (1, True), (4, False), (16, False)])
def test_moe_kernel_at_small_widths(n, slots, monkeypatch):
    """64 experts, top-6, 2,048 channels, 768 intermediate: the shapes the decode bench runs
    (one token by pair, the down sum slot by slot or every slot at once; 4 and 16 grouped by
    expert)."""
    from model.kernels import moe as kmoe

    monkeypatch.setattr(kmoe, "DOWN_SLOTS", slots)
    moe = random_moe("sqrtsoftplus", torch.bfloat16, seed=7, hidden_size=2048, moe_intermediate_size=768,
                     n_routed_experts=64, num_experts_per_tok=6)
    x = torch.randn(n, 2048, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        out = ds.moe_step(moe, x)
    ref = torch_path(moe, x)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -6, atol=2 ** -6 * ref.float().abs().max().item())


def test_moe_kernel_runs_only_on_a_few_text_tokens_outside_autograd(monkeypatch):
    calls = []
    real = kernels.moe_decode
    monkeypatch.setattr(kernels, "moe_decode", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    moe = random_moe("sqrtsoftplus", torch.float32, seed=0)
    D = moe.gate.weight.shape[1]
    with torch.no_grad():
        ds.moe_step(moe, torch.randn(2, 1, D, device=DEVICE))
        ds.moe_step(moe, torch.randn(1, kernels.MOE_TOKENS + 1, D, device=DEVICE))  # a prefill chunk: torch
        ds.moe_step(moe, torch.randn(1, 2, D, device=DEVICE), image_mask=torch.ones(1, 2, dtype=torch.bool, device=DEVICE))
        monkeypatch.setenv("DSAGENT_FUSED_MOE", "0")
        ds.moe_step(moe, torch.randn(1, 1, D, device=DEVICE))
    monkeypatch.delenv("DSAGENT_FUSED_MOE")
    moe.requires_grad_(True)
    ds.moe_step(moe, torch.randn(1, 1, D, device=DEVICE)).sum().backward()  # training: torch, with gradients
    assert calls == [2] and moe.gate.weight.grad is not None


def test_moe_kernel_writes_bf16_as_the_cast_rounds_it(monkeypatch):
    """``out_dtype`` bf16 (what MoE asks for a bf16 model): the kernel's fp32 sum rounded to
    nearest even, bit for bit what ``.to(torch.bfloat16)`` of its fp32 output gives."""
    moe = random_moe("sqrtsoftplus", torch.bfloat16, seed=9)
    x = torch.randn(3, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(4)).to(DEVICE, torch.bfloat16)
    for form in FORMS:
        use_form(form, monkeypatch)
        wide = decode_call(moe, x, grouped=form == "by-expert")
        narrow = decode_call(moe, x, grouped=form == "by-expert", out_dtype=torch.bfloat16)
        assert wide.dtype == torch.float32 and narrow.dtype == torch.bfloat16
        assert torch.equal(narrow, wide.to(torch.bfloat16))
    monkeypatch.undo()
    interpretable(monkeypatch)
    with torch.no_grad():
        assert torch.equal(ds.moe_step(moe, x), decode_call(moe, x, out_dtype=torch.bfloat16))  # the step's own call


def moe_launch(name: str, typed: dict, constants: dict, options: dict) -> dict:
    """A launch of ``model.kernels.moe``'s kernel ``name`` for ``compile_for_hopper``: the
    ``typed`` arguments, every other parameter a constexpr — those named in ``constants``,
    the rest at their defaults (the packed formats' scale pointers None, as a plain launch
    leaves them)."""
    import inspect

    from model.kernels import moe as kmoe

    params = inspect.signature(getattr(kmoe, name).fn).parameters
    defaults = {n: p.default for n, p in params.items() if n not in typed and p.default is not p.empty}
    return {"module": "model.kernels.moe", "name": name, "signature": {n: typed.get(n, "constexpr") for n in params},
            "constants": {**defaults, **constants}, "options": options}


@pytest.mark.skipif(ON_CUDA or importlib.util.find_spec("triton") is None,
                    reason="needs Triton installed; on a GPU the kernel itself compiles in the tests above")
@pytest.mark.parametrize("early,block_i", [(False, 256), (True, 1024)])
@pytest.mark.parametrize("bf16", [False, True])
def test_down_slots_kernel_compiles_for_hopper(early, block_i, bf16, tmp_path):
    """The down sum at `small`'s decode shape (top-6 and the shared expert, 8 warps) through
    the GPU compiler for sm_90, as a dependent launch: both ``DOWN_EARLY`` forms (the
    interpreter cannot run the looped one: its range over a runtime width), bf16 and fp32 —
    a helper that returned an fp32 tensor in one branch and a load in the other built in fp32
    and was refused in bf16."""
    f, h = ("*bf16", "*i16") if bf16 else ("*fp32", "*fp32")
    typed = {"h_ptr": h, "w2_ptr": f, "s2_ptr": f, "isel_ptr": "*i64", "out_ptr": h,
             **dict.fromkeys(("NK", "D", "I", "SI"), "i32")}
    constants = {"K": 6, "S_P2": 8, "BLOCK_O": 4, "BLOCK_I": block_i, "BF16": bf16, "OUT_BF16": bf16, "EARLY": early,
                 "PDL": True}
    r = compile_for_hopper([moe_launch("_down_slots_kernel", typed, constants,
                                       {"launch_pdl": True, "num_warps": 8})], tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


@pytest.mark.skipif(ON_CUDA or importlib.util.find_spec("triton") is None,
                    reason="needs Triton installed; on a GPU the kernel itself compiles in the tests above")
@pytest.mark.parametrize("early,block_i,block_d", [(False, 4, 256), (True, 2, 2048)])
def test_up_kernel_compiles_for_hopper(early, block_i, block_d, tmp_path):
    """The up kernel at `small`'s decode shape (2,048 channels, bf16) for sm_90 as a dependent
    launch, both forms: ``UP_EARLY``'s whole rows (the shared expert's loaded before the wait,
    in one branch of the program, a routed slot's after it, in the other) and the looped one."""
    typed = {**dict.fromkeys(("x_ptr", "w1_ptr", "w3_ptr", "s1_ptr", "s3_ptr"), "*bf16"), "wsel_ptr": "*fp32",
             "isel_ptr": "*i64", "h_ptr": "*i16", **dict.fromkeys(("NK", "D", "I", "SI"), "i32"), "limit": "fp32"}
    constants = {"K": 6, "BLOCK_I": block_i, "BLOCK_D": block_d, "BF16": True, "CLAMP": True, "EARLY": early,
                 "PDL": True}
    r = compile_for_hopper([moe_launch("_up_kernel", typed, constants, {"launch_pdl": True, "num_warps": 4})],
                           tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


def test_up_tile_takes_fewer_rows_for_wider_inputs_then_the_loop(monkeypatch):
    """``up_tile``: `small`'s 2,048 bf16 channels hold 2 whole rows of w1 and w3 (16 KB); fp32
    rows of that width, one; `v41-flash`'s 5,120 (8,192 padded: 32 KB a row) the channel
    loop, whose tile keeps a program's registers as at `small` — and so without ``UP_EARLY``."""
    from model.kernels import moe as kmoe

    monkeypatch.setattr(kmoe, "UP_EARLY", True)
    assert kmoe.up_tile(2048, 2) == (True, 2, 2048)
    assert kmoe.up_tile(2048, 4) == (True, 1, 2048)
    assert kmoe.up_tile(300, 4) == (True, 2, 512)
    assert kmoe.up_tile(5120, 2) == (False, kmoe.UP_BLOCK_I, kmoe.UP_BLOCK_D)
    monkeypatch.setattr(kmoe, "UP_EARLY", False)
    assert kmoe.up_tile(2048, 2) == (False, kmoe.UP_BLOCK_I, kmoe.UP_BLOCK_D)
