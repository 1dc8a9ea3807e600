"""FP4 routed experts held as the checkpoint stores them, stacked and run at once: the stacks
(``MoE.stack_experts``) against the experts' own tensors, the grouped twin on them against
the per-expert loop, a packed model's decode step, and the fused decode kernels
(``model.kernels.moe`` with ``scales``) against the same kernels on the dequantised weights.

The twin's tests run everywhere. The kernels run on CUDA when present, else under
``TRITON_INTERPRET=1``, else skip; their builds for the H200 need Triton installed, no GPU.
FP4 (and the shared expert's FP8) values are exact in fp32 and bf16. Grouped by expert each
kernel decodes its tile to the shape the plain kernel loads and sums it alike, so under the
interpreter it gives the plain kernels' bits on the dequantised weights (on a GPU a decoded
tile's registers may be laid out otherwise than a loaded one's, and there the MoE kernel
tests' tolerances are the bound); by pair the row kernels sum each row's 32-input blocks apart
and then the blocks, another order, so the tolerances are the bound everywhere. The grouped twin meets
each expert's rows with the same mm as the loop, bit for bit on this CPU; the tolerances of
``test_moe_grouped`` leave room for a BLAS that blocks a sliced operand otherwise.
"""
from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch

import model.kernels as kernels
import model.moe as moe_module
from model import decode_step as ds
from model.args import ModelArgs
from model.linear import Linear, World
from model.loading import build, local_state
from model.moe import MoE
from tests.hopper import compile_for_hopper
from tests.interpreted import interpretable
from tests.test_moe_grouped import TOL, Calls, HostReads, assert_close
from tests.test_moe_kernel import decode_call, moe_launch, torch_path, use_form

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
TWIN = "cpu"  # the twin's tests: torch's grouped GEMM takes fp32 on the CPU only (bf16 on sm90 CUDA)
TINY = ModelArgs.preset("tiny")  # D 128, 8 experts of width 128, top-2
needs_triton = pytest.mark.skipif(not kernels.triton_available(),
                                  reason="needs Triton with CUDA, or TRITON_INTERPRET=1 for its CPU interpreter")


def packed_moe(dtype: torch.dtype, seed: int = 0, world: World = World(), device: str = DEVICE) -> MoE:
    """A tiny MoE of random weights held as a packed model holds them (routed experts FP4, the
    shared expert FP8), its experts stacked."""
    g = torch.Generator().manual_seed(seed)
    moe = MoE(TINY, world=world)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            std = 0.01 if name.endswith("bias") else p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=g) * std)
    for expert in moe.experts:
        for name in ("w1", "w2", "w3"):
            getattr(expert, name).pack("fp4")
    for name in ("w1", "w2", "w3"):
        getattr(moe.shared_experts, name).pack("fp8")
    moe = moe.to(device, dtype).eval().requires_grad_(False)
    moe.stack_experts()
    return moe


def dequantised(packed: MoE, dtype: torch.dtype) -> MoE:
    """The same MoE with every packed weight replaced by its dequantised floats, stacked."""
    dense = MoE(TINY)
    state = {}
    for name, t in packed.state_dict().items():
        owner = name.removesuffix(".weight").removesuffix(".scale")
        m = packed.get_submodule(owner) if name.endswith((".weight", ".scale")) else None
        if isinstance(m, Linear) and m.fmt != "plain":
            if name.endswith(".weight"):
                state[name] = m.dense_weight(dtype)
            continue
        state[name] = t
    dense.load_state_dict(state)
    dense = dense.to(DEVICE, dtype).eval().requires_grad_(False)
    dense.stack_experts()
    return dense


# ----------------------------------------------------------------------------- the stacks

def assert_views(moe: MoE) -> None:
    """Every routed expert's bytes and scales are their stacks' slices: same memory."""
    for name in ("w1", "w2", "w3"):
        grouped = getattr(moe.grouped, name)
        assert grouped.fmt == "fp4" and grouped.weight.dtype == torch.int8
        for i, expert in enumerate(moe.experts):
            layer = getattr(expert, name)
            for own, stack in ((layer.weight, grouped.weight), (layer.scale, grouped.scale)):
                assert own.dtype == stack.dtype and own.data_ptr() == stack[i].data_ptr()
                assert torch.equal(own.view(torch.uint8), stack[i].view(torch.uint8))


def test_fp4_experts_are_stacked_as_views_of_their_own_bytes_and_scales():
    """[E, O, I/2] bytes and [E, O, I/32] scales; the state dict's names and values unchanged,
    nothing duplicated; a cast (the scales become new tensors) stacks again."""
    moe = packed_moe(torch.float32)
    assert moe.grouped.fmt == "fp4"
    assert moe.grouped.w1.weight.shape == (8, TINY.moe_intermediate_size, TINY.hidden_size // 2)
    assert moe.grouped.w2.scale.shape == (8, TINY.hidden_size, TINY.moe_intermediate_size // 32)
    assert_views(moe)
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    stacks = moe.grouped.w1.weight
    moe.stack_experts()
    assert moe.grouped.w1.weight is stacks  # already views: a no-op
    moe.to(torch.bfloat16)
    assert_views(moe)
    after = moe.state_dict()
    assert after.keys() == before.keys() and not any(".grouped." in k for k in after)
    assert all(torch.equal(after[k].float() if after[k].is_floating_point() else after[k],
                           before[k].float() if before[k].is_floating_point() else before[k])
               for k in before if "experts." in k and not k.startswith("shared"))


def test_a_rank_stacks_the_fp4_experts_of_its_range():
    part = packed_moe(torch.float32, world=World(1, 4))
    assert part.grouped.first == 2 and part.grouped.split and part.grouped.w1.weight.shape[0] == 2
    assert_views(part)


# ----------------------------------------------------------------------------- the grouped twin

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_grouped_twin_on_fp4_stacks_equals_the_loop(dtype, tokens, monkeypatch):
    """Every expert dequantised at once, and three at a time (``DEQUANT_BYTES``: three chunks,
    each's rows turned to the front), against the loop over the packed experts; the chunks
    give the same bits as one, and no expert id is read on the host."""
    moe = packed_moe(dtype, seed=tokens, device=TWIN)
    x = (torch.randn(tokens, TINY.hidden_size, generator=torch.Generator().manual_seed(2)) * 3).to(TWIN, dtype)
    with torch.no_grad():
        weights, indices = moe.gate(x, None)
        assert moe.runs_grouped(x)
        with HostReads() as reads:
            whole = moe.grouped(x, weights, indices)
        assert not reads.seen, reads.seen
        monkeypatch.setattr(moe_module, "DEQUANT_BYTES", 3 * TINY.hidden_size * TINY.moe_intermediate_size
                            * x.element_size())
        chunked = moe.grouped(x, weights, indices)
        loop = moe._loop(x, weights, indices)
    assert torch.equal(chunked, whole)
    assert_close(whole, loop, TOL[dtype])


def test_a_ranks_grouped_twin_on_fp4_stacks_is_its_loop():
    """One rank of four (experts 2 and 3): its pairs routed elsewhere give zeros."""
    part = packed_moe(torch.float32, world=World(1, 4), device=TWIN)
    x = torch.randn(24, TINY.hidden_size, generator=torch.Generator().manual_seed(3)).to(TWIN) * 3
    with torch.no_grad():
        weights, indices = part.gate(x, None)
        grouped, loop = part.grouped(x, weights, indices), part._loop(x, weights, indices)
    assert_close(grouped, loop, TOL[torch.float32])
    assert grouped.abs().max() > 0


def test_a_packed_models_decode_step_runs_its_stacked_fp4_experts_as_the_loop(monkeypatch):
    """The tiny preset built packed: its decode steps through ``decode_step``'s fused path on the
    kernels' twins (``DSAGENT_KERNELS=0``) take the grouped experts on the FP4 stacks, so a step
    can be captured (``ffn_capturable``), and give the logits of the per-expert loop
    (``DSAGENT_GROUPED_MOE=0``) over a prefill of five tokens and three decode steps."""
    args = TINY.replace(engram_layer_ids=(), engram_num_embeddings=())
    for name, value in (("DSAGENT_KERNELS", "0"), ("DSAGENT_GRAPHS", "0")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(ds, "takes_fused", ds.is_decode_step)
    net = build(args, weights="packed").to(TWIN)
    moe = net.layers[0].ffn
    assert moe.grouped.fmt == "fp4"
    assert_views(moe)
    ids = torch.randint(3, args.vocab_size, (1, 8), generator=torch.Generator().manual_seed(4)).to(TWIN)
    logits = {}
    for grouped in (True, False):
        monkeypatch.setenv("DSAGENT_GROUPED_MOE", "1" if grouped else "0")
        with torch.no_grad(), Calls(moe.grouped) as calls:
            assert ds.ffn_capturable(net, torch.zeros(1, 1, args.hidden_size, device=TWIN)) == grouped
            cache = net.new_cache(1)
            net(ids[:, :5], cache)
            logits[grouped] = torch.stack([ds.forward(net, ids[:, t: t + 1], cache)[:, -1] for t in range(5, 8)])
        assert (calls.n > 0) == grouped
    assert_close(logits[True], logits[False], TOL[torch.float32])


# ----------------------------------------------------------------------------- the fused kernels

FORMS = ["by-pair-early", "by-pair", "by-expert"]


@needs_triton
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_moe_on_fp4_experts_is_the_plain_kernels_on_their_dequantised_weights(dtype, form, monkeypatch):
    """A packed MoE's decode step takes the fused kernels on its FP4 stacks and FP8 shared
    expert: by pair the row kernels (each row's 32-input blocks summed and scaled apart, so
    within the MoE kernel tests' tolerance of the plain kernels on the dequantised weights),
    grouped by expert the tiles the plain kernels load, decoded — their bits (see the docstring
    above; on a GPU within the tolerance); inputs that hit the clamps."""
    from model.kernels import moe as kmoe

    interpretable(monkeypatch)
    use_form(form, monkeypatch)
    packed = packed_moe(dtype, seed=5)
    dense = dequantised(packed, dtype)
    x = (torch.randn(3, TINY.hidden_size, generator=torch.Generator().manual_seed(6)) * 20).to(DEVICE, dtype)
    calls, by_rows = [], []
    real, real_rows = kernels.moe_decode, kmoe.fp4_rows
    monkeypatch.setattr(kernels, "moe_decode", lambda *a, **k: calls.append(k["scales"] is not None) or real(*a, **k))
    monkeypatch.setattr(kmoe, "fp4_rows", lambda *a, **k: by_rows.append(1) or real_rows(*a, **k))
    with torch.no_grad():
        assert ds.moe_runs_fused(packed, x)
        got, want = ds.moe_step(packed, x), ds.moe_step(dense, x)
    assert calls == [True, False] and not kernels._FAILED
    assert len(by_rows) == (form != "by-expert")
    if ON_CUDA or by_rows:  # the row kernels sum each row in another order than the plain kernels
        rtol = 1e-5 if dtype == torch.float32 else 2 ** -6
        torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=rtol * want.float().abs().max().item())
    else:
        assert torch.equal(got, want)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_fp4_row_kernels_over_several_steps_give_the_plain_sums(dtype, monkeypatch):
    """The row kernels with two steps a row (32 bytes a step of TINY's 64) and one row a program
    give the plain kernels' sums on the dequantised weights, a token's slots summed in order."""
    from model.kernels import moe as kmoe

    interpretable(monkeypatch)
    use_form("by-pair", monkeypatch)
    for name, value in (("ROWS_UP_B", 32), ("ROWS_DOWN_B", 32), ("ROWS_UP_I", 1),
                        ("ROWS_DOWN_O", 1)):
        monkeypatch.setattr(kmoe, name, value)
    packed = packed_moe(dtype, seed=11)
    x = (torch.randn(2, TINY.hidden_size, generator=torch.Generator().manual_seed(12)) * 20).to(DEVICE, dtype)
    with torch.no_grad():
        got = ds.moe_step(packed, x)
        want = ds.moe_step(dequantised(packed, dtype), x)
    assert not kernels._FAILED
    rtol = 1e-5 if dtype == torch.float32 else 2 ** -6
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=rtol * want.float().abs().max().item())


def packed_parts(dtype: torch.dtype, size: int, seed: int = 0) -> tuple[MoE, list[MoE]]:
    """A whole packed MoE (:func:`packed_moe`) and the parts its ``size`` ranks hold of it
    (``model.loading.local_state``: a range of the experts' stored bytes, a share of the shared
    expert's FP8 rows / columns and their scales), each part's sums left to the caller (its
    ``world`` one process alone: the part's own output, not the ranks' sum)."""
    whole = packed_moe(dtype, seed)
    parts = []
    for rank in range(size):
        part = packed_moe(dtype, seed, world=World(rank, size))
        part.args = TINY  # local_state reads a model's config (its heads' sinks: none here)
        part.load_state_dict(local_state(part, whole.state_dict()))
        part.world = World()
        parts.append(part)
    return whole, parts


# every form in both dtypes over 2 and 4 ranks on a GPU; three of them under the interpreter (~50 s each)
PART_CASES = [pytest.param(*case, id=f"{case[0]}-ranks-{str(case[1])[6:]}-{case[2]}") for case in (
    itertools.product([2, 4], [torch.float32, torch.bfloat16], FORMS) if ON_CUDA else
    [(4, torch.float32, "by-pair-early"), (2, torch.bfloat16, "by-pair"), (4, torch.bfloat16, "by-expert")])]


@needs_triton
@pytest.mark.parametrize("size,dtype,form", PART_CASES)
def test_a_ranks_fused_moe_is_its_part_and_the_parts_sum_to_the_whole(size, dtype, form, monkeypatch):
    """Each rank of an expert-parallel MoE runs the fused kernels on its range of the FP4
    experts (``first``; a slot routed to another rank's expert adds nothing) and its share of
    the FP8 shared expert (4 ranks: 32 of its 128 channels, one scale block): its decode step
    is its torch path's output (the grouped twin on its stacks, its shared part) to the kernel
    tests' tolerance, and the ranks' fp32 parts add up to the whole MoE's kernels — exactly
    the same routed products, the shared expert's rounded in parts (fp32: ~1e-6; bf16: a bf16
    step of it). Tokens that pick experts of every rank."""
    interpretable(monkeypatch)
    use_form(form, monkeypatch)
    whole, parts = packed_parts(dtype, size, seed=7)
    x = (torch.randn(5, TINY.hidden_size, generator=torch.Generator().manual_seed(8)) * 3).to(DEVICE, dtype)
    with torch.no_grad():
        chosen = whole.gate(x, None)[1]
    assert {int(e) * size // TINY.n_routed_experts for e in chosen.flatten()} == set(range(size))
    tol = TOL[torch.float32] * 10 if dtype == torch.float32 else 2 ** -6
    total = torch.zeros(x.shape, dtype=torch.float32, device=DEVICE)
    with torch.no_grad():
        for rank, part in enumerate(parts):
            assert part.grouped.first == rank * TINY.n_routed_experts // size and part.grouped.split
            assert part.shared_experts.w1.weight.shape[0] == TINY.moe_intermediate_size // size
            assert ds.moe_runs_fused(part, x)
            assert_close(ds.moe_step(part, x), torch_path(part, x), tol)
            total += decode_call(part, x, first=part.grouped.first)
        assert not kernels._FAILED  # no fallback to the twin
        assert_close(total, decode_call(whole, x), TOL[torch.float32] * 10 if dtype == torch.float32 else 2 ** -7)


def _expert_parallel_rank(world: World, dtype: torch.dtype, x: torch.Tensor, results) -> None:
    """One rank of a gloo world: its part of the packed MoE, summed over the world as a decode
    step sums it, through the fused kernels (the interpreter's form without channel loops) and
    through its torch path."""
    from model.kernels import moe as kmoe

    torch.set_num_threads(1)
    kmoe.GATE_EARLY = kmoe.UP_EARLY = kmoe.DOWN_EARLY = True
    part = packed_parts(dtype, world.size, seed=9)[1][world.rank]
    part.world = world
    calls, real = [], kernels.moe_decode
    kernels.moe_decode = lambda *a, **k: calls.append(k["first"]) or real(*a, **k)
    with torch.no_grad():
        assert ds.moe_runs_fused(part, x)
        fused = ds.moe_step(part, x)
        results[world.rank] = (fused, torch_path(part, x), calls, dict(kernels._FAILED))


@pytest.mark.skipif(ON_CUDA or not kernels.triton_available(),
                    reason="Triton's interpreter, in processes of a gloo world (on a GPU: the test above)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_expert_parallel_decode_steps_sum_the_fused_parts_over_the_world(dtype, tmp_path):
    """Two gloo processes, each its half of the experts and of the shared expert's channels:
    ``moe_step`` runs the fused kernels on its part (fp32), adds the parts over the world and
    rounds once — the MoE's torch path over the same world, and the whole MoE in one process,
    to the kernel tests' tolerance, on every rank."""
    import torch.multiprocessing as mp

    from model.distributed import run_ranks

    x = (torch.randn(3, TINY.hidden_size, generator=torch.Generator().manual_seed(10)) * 3).to(dtype)
    with mp.Manager() as manager:
        results = manager.dict()
        run_ranks(_expert_parallel_rank, 2, dtype, x, results, init_method=f"file://{tmp_path / 'rendezvous'}",
                  timeout_s=600)
        got = dict(results)
    whole = torch_path(packed_moe(dtype, seed=9), x)
    tol = TOL[torch.float32] * 10 if dtype == torch.float32 else 2 ** -6
    for rank in (0, 1):
        fused, twin, calls, failed = got[rank]
        assert calls == [rank * TINY.n_routed_experts // 2] and not failed
        assert fused.dtype == dtype and fused.shape == x.shape
        assert_close(fused, twin, tol)
        assert_close(fused, whole, tol)
    assert torch.equal(got[0][0], got[1][0])  # one all-reduce: every rank the same bits


# ----------------------------------------------------------------------------- builds for the H200

def fp4_launches() -> list[dict]:
    """Each expert kernel with FP4 routed experts and an FP8 shared expert (32 x 32 scales), bf16
    tokens, `small`'s decode shapes (top-6), as dependent launches."""
    u8, pdl = "*u8", {"launch_pdl": True}
    packed = {"FMT": "fp4", "S_FMT": "fp8", "SR": 32, "SC": 32, "PDL": True}
    up_typed = {**dict.fromkeys(("w1_ptr", "w3_ptr", "s1_ptr", "s3_ptr", "w1_sc", "w3_sc", "s1_sc", "s3_sc"), u8),
                "x_ptr": "*bf16", "wsel_ptr": "*fp32", "isel_ptr": "*i64", "h_ptr": "*i16", "limit": "fp32",
                **dict.fromkeys(("N", "NK", "D", "I", "SI"), "i32")}
    down_typed = {**dict.fromkeys(("w2_ptr", "s2_ptr", "w2_sc", "s2_sc"), u8), "h_ptr": "*i16", "isel_ptr": "*i64",
                  "wsel_ptr": "*fp32", "out_ptr": "*i16", "part_ptr": "*fp32",
                  **dict.fromkeys(("N", "NK", "D", "I", "SI"), "i32")}

    def typed(name: str, types: dict) -> dict:
        import inspect

        from model.kernels import moe as kmoe

        params = inspect.signature(getattr(kmoe, name).fn).parameters
        return {k: v for k, v in types.items() if k in params}

    from model.kernels import moe as kmoe

    by_pair = {"K": 6, "BF16": True, **packed}
    grouped = {"K": 6, "K_P2": 8, "BLOCK_N": 16, "BF16": True, "DOT": "tf32", **packed}

    def aligned(launch: dict) -> dict:
        """The launch as a GPU specialises it: tensors at 16-byte addresses, widths multiples of 16
        (so the row kernels' 16 bytes a thread are one load, as the GPU builds them)."""
        return {**launch, "aligned": [n for n, t in launch["signature"].items()
                                      if t.startswith("*") or n in ("D", "I", "SI")]}

    rows = [
        moe_launch("_up_rows_kernel", typed("_up_rows_kernel", {**up_typed, "x_ptr": "*i16", "xw_ptr": "*i32"}),
                   {**by_pair, "BLOCK_I": kmoe.ROWS_UP_I, "BLOCK_B": kmoe.ROWS_UP_B, "CLAMP": True},
                   {**pdl, "num_warps": kmoe.ROWS_UP_WARPS}),
        moe_launch("_down_rows_kernel", typed("_down_rows_kernel", {**down_typed, "hw_ptr": "*i32"}),
                   {**packed, "BF16": True, "BLOCK_O": kmoe.ROWS_DOWN_O, "BLOCK_B": kmoe.ROWS_DOWN_B},
                   {**pdl, "num_warps": kmoe.ROWS_DOWN_WARPS}),
    ]
    return [
        *map(aligned, rows),
        moe_launch("_up_grouped_kernel", typed("_up_grouped_kernel", up_typed),
                   {**grouped, "BLOCK_I": 32, "BLOCK_D": 128, "CLAMP": True}, {**pdl, "num_warps": 4}),
        moe_launch("_down_grouped_kernel", typed("_down_grouped_kernel", down_typed),
                   {**grouped, "BLOCK_O": 32, "BLOCK_I": 128}, {**pdl, "num_warps": 4}),
    ]


@pytest.mark.skipif(ON_CUDA or importlib.util.find_spec("triton") is None,
                    reason="needs Triton installed; on a GPU the kernels themselves run in the tests above")
def test_fp4_moe_kernels_compile_for_hopper(tmp_path):
    """Triton's GPU compiler for sm_90 on the CPU: the FP4 forms of the up and down kernels by
    pair (the row kernels) and grouped, whose both branches (a routed slot's FP4, the shared
    expert's FP8) the interpreter never types together."""
    r = compile_for_hopper(fp4_launches(), tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
