"""The prefill GEMMs on packed weights (``model.kernels.gemm``: FP8 / FP4 bytes decoded in
registers, tensor-core dots) against their twins: the dequantised weight, then an fp32 product
(the exact sums) and the twins the model runs where the kernels do not (``F.linear`` on the
dequantised weight; the FP4 experts dequantised by chunks, then ``torch._grouped_mm``).

The kernels run on CUDA when present, else under ``TRITON_INTERPRET=1``, else skip; the
routing tests and the twins run everywhere, and the builds for the H200 need Triton installed,
no GPU. Tolerances: fp32 operands (the interpreter) sum in another order than the reference,
a few ulps; bf16 operands round the output once more than the fp32 reference (2^-9
relative at most), and agree with torch's bf16 twin to that rounding.
"""
from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch

import model.kernels as kernels
from model.linear import Linear
from model.moe import swiglu
from tests.hopper import compile_for_hopper
from tests.interpreted import interpretable
from tests.test_moe_fp4 import TINY, packed_moe
from tests.test_moe_grouped import TOL, assert_close

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
needs_triton = pytest.mark.skipif(not kernels.triton_available(),
                                  reason="needs Triton with CUDA, or TRITON_INTERPRET=1 for its CPU interpreter")
DTYPES = [torch.bfloat16] if ON_CUDA else [torch.float32, torch.bfloat16]  # fp32: the interpreter's alone
REL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}
SMALL_TILE = (32, 32, 32, 4, 1)  # few programs under the interpreter; the defaults on the GPU


def tile():
    return SMALL_TILE if not ON_CUDA else None


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def packed_linear(out_f: int, in_f: int, fmt: str, seed: int) -> Linear:
    layer = Linear(in_f, out_f)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed)) * in_f ** -0.5)
    layer.pack(fmt)
    return layer.to(DEVICE)


def rows(n: int, d: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@pytest.mark.parametrize("shape", [(70, 96, 160), (33, 200, 64), (5, 96, 256)], ids=["tails", "narrow", "few rows"])
def test_a_packed_gemm_is_the_product_of_the_dequantised_weight(fmt, dtype, shape):
    """Rows, outputs and inputs that no tile divides (masked tails), FP8 of 32 x 32 blocks and
    FP4 of 1 x 32; against the fp32 product of the same values, and torch's own twin. A few
    rows (a batch's decode step) take their own narrow tile."""
    from model.kernels import gemm

    m, n, k = shape
    layer = packed_linear(n, k, fmt, seed=m)
    x = rows(m, k, seed=n, dtype=dtype)
    w = layer.gemv_weight()
    assert w.decodable()
    y = gemm.packed_matmul(x, w, None if m <= gemm.FEW_ROWS else tile())
    assert y.dtype == dtype and y.shape == (m, n)
    exact = x.float() @ layer.dense_weight(torch.float32).T
    assert rel_err(y, exact) < REL[dtype]
    twin = torch.nn.functional.linear(x, layer.dense_weight(dtype))
    assert rel_err(y, twin) < 2 * REL[dtype]


@needs_triton
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_a_grouped_projection_reads_each_groups_own_inputs(fmt):
    """The attention's ``wo_a``: 4 groups of 48 outputs (a program's width cut to 16, the
    largest power of two dividing a group), group g of the output from group g of the input,
    through ``model.linear.grouped_linear`` on a prefill's rows as on the twin's."""
    from model.linear import grouped_linear

    layer = packed_linear(4 * 48, 64, fmt, seed=20)
    x = rows(50, 4 * 64, seed=21, dtype=DTYPES[0])
    exact = kernels.gemv_ref(x.float(), layer.dense_weight(torch.float32), groups=4)[0]
    assert rel_err(kernels.packed_matmul(x, layer.gemv_weight(), groups=4), exact) < REL[x.dtype]
    with torch.no_grad():
        assert rel_err(grouped_linear(layer, x, 4), exact) < REL[x.dtype]


@needs_triton
def test_an_fp8_weight_of_128_blocks_decodes_its_own_blocks():
    """V4's 128 x 128 scale blocks (a `wo_a` may carry them in V4.1): the scale index follows
    the block, not the 32 the family defaults to."""
    from model.kernels import gemm

    layer = Linear(256, 192, block=128)
    with torch.no_grad():
        w = torch.randn(192, 256, generator=torch.Generator().manual_seed(5)) * 0.06
        w[:128, :128] *= 64  # one block's scale far from the others'
        layer.weight.copy_(w)
    layer.pack("fp8")
    layer = layer.to(DEVICE)
    assert layer.gemv_weight().scale_block() == (128, 128)
    x = rows(40, 256, seed=6, dtype=DTYPES[0])
    exact = x.float() @ layer.dense_weight(torch.float32).T
    assert rel_err(gemm.packed_matmul(x, layer.gemv_weight(), tile()), exact) < REL[DTYPES[0]]


def sorted_rows(counts: list[int], k: int, seed: int, dtype: torch.dtype, extra: int = 0):
    """Rows grouped by expert (``counts`` each, then ``extra`` rows of no expert here) and the ends."""
    ends = torch.tensor(counts).cumsum(0).to(DEVICE, torch.int32)
    return rows(sum(counts) + extra, k, seed, dtype), ends


def grouped_exact(x: torch.Tensor, ends: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """Each expert's rows times its dequantised weight in fp32 (rows past the last end: zero)."""
    out = torch.zeros(x.shape[0], dense.shape[1], device=x.device)
    start = 0
    for e, end in enumerate(ends.tolist()):
        out[start:end] = x[start:end].float() @ dense[e].float().T
        start = end
    return out


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_the_grouped_fp4_gemm_takes_each_expert_its_own_rows(dtype):
    """Experts with no rows, one row, and more rows than a tile; rows routed to another rank's
    experts (after the last end) are left unwritten and never read; the tile map is made on the
    device and its unused programs exit."""
    from model.kernels import gemm

    moe = packed_moe(torch.float32)
    w1 = moe.grouped.w1
    counts = [0, 1, 40, 0, 3, 70, 2, 0]
    x, ends = sorted_rows(counts, TINY.hidden_size, seed=8, dtype=dtype, extra=5)
    dense = w1.dense(0, len(counts), torch.float32)
    y = gemm.grouped_fp4(x, ends, w1.weight, w1.scale, tile=tile())
    mine = int(ends[-1])
    exact = grouped_exact(x, ends, dense)
    assert rel_err(y[:mine], exact[:mine]) < REL[dtype]
    tiles = gemm.expert_tiles(ends, x.shape[0], 32)
    used = tiles[tiles[:, 0] >= 0]
    assert used[:, 0].tolist() == [1, 2, 2, 4, 5, 5, 5, 6]
    assert used[:, 1].tolist() == [0, 1, 33, 41, 44, 76, 108, 114]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("limit", [0.0, 0.5], ids=["no clamp", "clamped"])
def test_the_paired_fp4_gemm_is_the_route_weighted_swiglu(dtype, limit):
    """w1 and w3 in one launch: route * swiglu(x w1^T, x w3^T, limit), each product rounded
    to the activations' dtype first as the twin's GEMM outputs are; the clamp where set."""
    from model.kernels import gemm

    moe = packed_moe(torch.float32)
    w1, w3 = moe.grouped.w1, moe.grouped.w3
    counts = [5, 0, 37, 1, 0, 0, 20, 9]
    x, ends = sorted_rows(counts, TINY.hidden_size, seed=9, dtype=dtype)
    route = torch.rand(x.shape[0], generator=torch.Generator().manual_seed(10)).to(DEVICE)
    y = gemm.grouped_fp4(x, ends, w1.weight, w1.scale, paired=(w3.weight, w3.scale), route=route, limit=limit,
                         tile=tile())
    g = grouped_exact(x, ends, w1.dense(0, 8, torch.float32)).to(dtype)
    u = grouped_exact(x, ends, w3.dense(0, 8, torch.float32)).to(dtype)
    ref = route[:, None] * swiglu(g, u, limit)
    assert rel_err(y, ref) < 2 * REL[dtype]
    if limit:
        assert rel_err(y, route[:, None] * swiglu(g, u, 0.0)) > 10 * REL[dtype]  # the clamp bites here
    # the rows read in place: x[rows] of a shorter, unsorted x (a token's row for each of its slots)
    source = rows(29, TINY.hidden_size, seed=12, dtype=dtype)
    pick = torch.randint(0, 29, (x.shape[0],), generator=torch.Generator().manual_seed(13)).to(DEVICE)
    gathered = gemm.grouped_fp4(source[pick], ends, w1.weight, w1.scale, paired=(w3.weight, w3.scale), route=route,
                                limit=limit, tile=tile())
    in_place = gemm.grouped_fp4(source, ends, w1.weight, w1.scale, paired=(w3.weight, w3.scale), route=route,
                                limit=limit, rows=pick, tile=tile())
    assert in_place.shape == gathered.shape and torch.equal(in_place, gathered)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_a_packed_moe_runs_its_routed_experts_through_the_kernels_as_the_loop(dtype, monkeypatch):
    """A tiny MoE with FP4 routed experts and an FP8 shared one, 48 tokens: the grouped path
    sends the up projection (w1 with w3) and the down projection to the kernel, and the routed
    sum equals the reference loop over the experts to the tolerance of the grouped twin."""
    interpretable(monkeypatch)
    from model.kernels import gemm

    monkeypatch.setattr(gemm, "GROUPED_TILE", tile() or gemm.GROUPED_TILE)
    monkeypatch.setattr(gemm, "PAIRED_TILE", tile() or gemm.PAIRED_TILE)
    launched = []
    real = gemm.grouped_fp4
    monkeypatch.setattr(gemm, "grouped_fp4", lambda *a, **k: launched.append(k.get("paired") is not None)
                        or real(*a, **k))
    moe = packed_moe(dtype, seed=3)
    x = (torch.randn(48, TINY.hidden_size, generator=torch.Generator().manual_seed(11)) * 3).to(DEVICE, dtype)
    with torch.no_grad():
        weights, indices = moe.gate(x, None)
        assert moe.runs_grouped(x)
        grouped = moe.grouped(x, weights, indices)
        loop = moe._loop(x, weights, indices)
    assert launched == [True, False]
    assert_close(grouped, loop, TOL[dtype])


@needs_triton
def test_a_ranks_fp4_experts_through_the_kernels_are_its_loop(monkeypatch):
    """One rank of four (experts 2 and 3): the pairs routed to other ranks sort after its last
    expert, the kernels leave their rows unwritten, and they give zeros."""
    from model.kernels import gemm
    from model.linear import World

    interpretable(monkeypatch)
    monkeypatch.setattr(gemm, "GROUPED_TILE", tile() or gemm.GROUPED_TILE)
    monkeypatch.setattr(gemm, "PAIRED_TILE", tile() or gemm.PAIRED_TILE)
    part = packed_moe(DTYPES[0], world=World(1, 4))
    x = (torch.randn(40, TINY.hidden_size, generator=torch.Generator().manual_seed(17)) * 3).to(DEVICE, DTYPES[0])
    with torch.no_grad():
        weights, indices = part.gate(x, None)
        grouped, loop = part.grouped(x, weights, indices), part._loop(x, weights, indices)
    assert_close(grouped, loop, TOL[DTYPES[0]])
    assert grouped.abs().max() > 0 and (grouped.abs().sum(1) == 0).any()  # tokens with no expert here


@needs_triton
def test_a_packed_linear_takes_the_gemm_on_a_prefills_rows(monkeypatch):
    """More rows than the GEMV takes: the packed GEMM, within bf16's rounding of the twin;
    off with ``DSAGENT_PACKED_GEMM=0`` (the twin, bit for bit torch's) and under autograd."""
    from model.kernels import gemm

    monkeypatch.setattr(kernels, "_FAILED", {})
    monkeypatch.setattr(gemm, "DENSE_TILE", tile() or gemm.DENSE_TILE)
    layer = packed_linear(64, 128, "fp8", seed=12)
    x = rows(3 * 24, 128, seed=13, dtype=DTYPES[-1]).view(3, 24, 128)
    calls = []
    real = kernels.packed_matmul
    monkeypatch.setattr(kernels, "packed_matmul", lambda *a: calls.append(a[0].shape) or real(*a))
    twin = torch.nn.functional.linear(x, layer.dense_weight(x.dtype))
    with torch.no_grad():
        y = layer(x)
        assert calls == [(3, 24, 128)] and y.shape == (3, 24, 64)
        assert rel_err(y, twin) < 2 * REL[x.dtype]
        monkeypatch.setenv("DSAGENT_PACKED_GEMM", "0")
        assert torch.equal(layer(x), twin) and len(calls) == 1


def test_without_the_kernels_the_packed_paths_are_their_twins(monkeypatch):
    """Where the kernels do not run (here: ``DSAGENT_KERNELS=0``), a packed Linear and the FP4
    experts compute exactly their dequantising twins, and nothing reaches ``model.kernels.gemm``."""
    monkeypatch.setenv("DSAGENT_KERNELS", "0")
    layer = packed_linear(48, 64, "fp4", seed=14).to("cpu")
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(15))
    moe = packed_moe(torch.float32, seed=4, device="cpu")
    xs = torch.randn(30, TINY.hidden_size, generator=torch.Generator().manual_seed(16)) * 3
    with torch.no_grad():
        assert not kernels.packed_gemm_runs(x)
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.dense_weight(torch.float32)))
        weights, indices = moe.gate(xs, None)
        assert_close(moe.grouped(xs, weights, indices), moe._loop(xs, weights, indices), TOL[torch.float32])


def test_the_packed_gemm_never_runs_with_a_gradient_or_half_rows(monkeypatch):
    """The kernels have no backward and take bf16 rows (fp32 only under the interpreter)."""
    monkeypatch.setattr(kernels, "enabled", lambda t: True)
    monkeypatch.setattr(kernels, "_kernel_runs", lambda path, x, grads=(): True)
    x = torch.zeros(8, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        assert kernels.packed_gemm_runs(x)
        assert not kernels.packed_gemm_runs(x.half())
        monkeypatch.setenv("DSAGENT_PACKED_GEMM", "0")
        assert not kernels.packed_gemm_runs(x)
    monkeypatch.delenv("DSAGENT_PACKED_GEMM")
    assert not kernels.packed_gemm_runs(x)  # gradients on


# ----------------------------------------------------------------------------- builds for the H200

needs_compiler = pytest.mark.skipif(ON_CUDA or importlib.util.find_spec("triton") is None,
                                    reason="needs Triton installed; on a GPU the kernel itself runs in the tests above")


def gemm_launch(fmt: str, grouped: bool, paired: bool, tile: tuple) -> dict:
    """``_gemm_kernel``'s launch for ``compile_for_hopper`` at a tile, bf16 rows."""
    from model.kernels import gemm

    block_m, block_n, block_k, warps, stages = tile
    typed = {"x_ptr": "*bf16", "out_ptr": "*i16", "route_ptr": "*fp32", "tiles_ptr": "*i32", "ends_ptr": "*i32",
             **dict.fromkeys(("w_ptr", "w_sc", "v_ptr", "v_sc"), "*u8"),
             **dict.fromkeys(("M", "N", "K", "W_STRIDE", "S_STRIDE", "X_STRIDE", "GROUP_N"), "i32"), "limit": "fp32"}
    params = inspect.signature(gemm._gemm_kernel.fn).parameters
    constants = {"FMT": fmt, "SR": 32 if fmt == "fp8" else 1, "SC": 32, "GROUPED": grouped, "PAIRED": paired,
                 "CLAMP": paired, "BF16": True, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k}
    return {"module": "model.kernels.gemm", "name": "_gemm_kernel",
            "signature": {name: typed.get(name, "constexpr") for name in params}, "constants": constants,
            "options": {"num_warps": warps, "num_stages": stages}}


@needs_compiler
def test_the_packed_gemms_compile_for_hopper(tmp_path):
    """Triton's GPU compiler on the CPU for sm_90: the dense FP8 and FP4 forms (and FP8 at the
    few rows' tile) and the grouped FP4 forms (alone, paired with its SwiGLU) at the default
    tiles."""
    from model.kernels import gemm

    launches = [gemm_launch("fp8", False, False, gemm.DENSE_TILE), gemm_launch("fp4", False, False, gemm.DENSE_TILE),
                gemm_launch("fp8", False, False, gemm.FEW_ROWS_TILE),
                gemm_launch("fp4", True, False, gemm.GROUPED_TILE), gemm_launch("fp4", True, True, gemm.PAIRED_TILE)]
    r = compile_for_hopper(launches, tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
