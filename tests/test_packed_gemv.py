"""The decode GEMV on packed weights (``kernels.Packed``: FP8 / FP4 as the checkpoint stores
them, decoded in the kernel's registers) against the same kernel on the dequantised floats
(``Linear.dense_weight``), to the rounding of sums in another order, as the decode step
launches it with each layer; the linear family and the fused decode step on it; and its
builds for the H200.

Runs on CUDA when present, else under ``TRITON_INTERPRET=1``, else skips (the twin's tests
and the model's run everywhere: without the kernels they check the twins). An FP8 tile sums
each 32-input block's products before its scale multiplies them (``matvec._fp8_dot``); an FP4
tile holds the dequantised values and sums them in the plain tile's order under the
interpreter (and its reductions run on the plain build's layouts: the compile test below),
yet on an H200 (2026-12-05) its fp32 outputs were not the plain kernel's bits: so both are
checked to rounding.
"""
from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

import model.kernels as kernels
from model import decode_step as ds
from model.args import ModelArgs
from model.linear import Linear
from model.loading import build
from tests.hopper import compile_for_hopper
from tests.interpreted import interpretable
from tests.test_gemv_kernel import gemv_launch

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
needs_triton = pytest.mark.skipif(not kernels.triton_available(),
                                  reason="needs Triton with CUDA, or TRITON_INTERPRET=1 for its CPU interpreter")
FORMATS = ("fp8", "fp4")
DTYPES = (torch.float32, torch.bfloat16)


def packed(out_f: int, in_f: int, fmt: str, seed: int, block: int = 32) -> Linear:
    """A Linear of a checkpoint's scale (1 / sqrt(in) values) held packed in ``fmt``."""
    layer = Linear(in_f, out_f, block=block)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed)) * in_f ** -0.5)
    layer.pack(fmt)
    return layer.to(DEVICE)


def rows(n: int, d: int, seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(n, 1, d, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE, dtype)


def angles(half: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.rand(1, half, generator=torch.Generator().manual_seed(seed)) * 6.0
    return a.cos().to(DEVICE), a.sin().to(DEVICE)


def norm_of(d: int, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    w = 1 + 0.1 * torch.randn(d, generator=torch.Generator().manual_seed(seed))
    return w.to(DEVICE, dtype), 1e-6


def same_as_dense(x, layers: list[Linear], **options) -> None:
    """The GEMV on the layers' packed weights against the GEMV on their dequantised floats, to
    the rounding of sums in another order (FP8: each 32-input block's products summed before its
    scale multiplies them, ``matvec._fp8_dot``; FP4: the plain tile's order on the CPU's
    interpreter, not bit for bit in fp32 on an H200, 2026-12-05); ``keep``'s normalised x bit
    for bit; and the twin to rounding."""
    from model.kernels import matvec

    got = matvec.gemv(x, *(m.gemv_weight() for m in layers), **options)
    want = matvec.gemv(x, *(m.dense_weight(x.dtype) for m in layers), **options)
    assert len(got) == len(want)
    rtol = 1e-5 if x.dtype == torch.float32 else 2 ** -7
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype
        if options.get("keep") and i == len(got) - 1:
            assert torch.equal(g, w)
        else:
            torch.testing.assert_close(g.float(), w.float(), rtol=rtol, atol=rtol * w.float().abs().max().item())
    twin = kernels.gemv_ref(x, *(m.gemv_weight() for m in layers), **options)
    for g, t in zip(got, twin):
        torch.testing.assert_close(g.float(), t.float(), rtol=rtol, atol=rtol * t.float().abs().max().item())


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_last_projection_on_packed_weights_is_the_dense_ones(fmt, dtype):
    """``wo_b``'s launch (no options) at 1-4 rows; an odd output width (masked rows, a scale
    block cut short), and inputs wider than ``BLOCK_D_MAX`` (the chunks after the wait): one
    that only a chunk cut short covers, one of 5 x 1,024 (V4.1-Flash's head: chunks that divide it)."""
    from model.kernels import matvec

    wide = (16, 2 * matvec.BLOCK_D_MAX + 64)
    for n, (out_f, in_f) in zip((1, 2, 3, 4, 1), ((128, 128), (37, 320), wide, (64, 256), (24, 5 * 1024))):
        same_as_dense(rows(n, in_f, seed=n, dtype=dtype), [packed(out_f, in_f, fmt, seed=10 + n)])


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_fp8_off_its_blocks_takes_the_dequantised_tile(dtype, monkeypatch):
    """``matvec.FP8_BLOCKS`` off (the step's A/B knob): an FP8 weight decoded whole into the
    plain tile, as FP4 is; the same values to rounding, and to rounding the blocks' form."""
    from model.kernels import matvec

    launched, real = [], matvec._gemv_kernel

    class Seen:  # the kernel, each launch's BLOCKS noted
        def __getitem__(self, grid):
            return lambda *a, **k: launched.append(k.get("BLOCKS")) or real[grid](*a, **k)

    monkeypatch.setattr(matvec, "_gemv_kernel", Seen())
    x, layer = rows(2, 320, seed=5, dtype=dtype), packed(37, 320, "fp8", seed=6)
    blocks = matvec.gemv(x, layer.gemv_weight())[0]
    monkeypatch.setattr(matvec, "FP8_BLOCKS", False)
    same_as_dense(x, [layer])
    whole = matvec.gemv(x, layer.gemv_weight())[0]
    assert launched[0] is True and launched[-1] is False
    rtol = 1e-5 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(whole.float(), blocks.float(), rtol=rtol, atol=rtol * blocks.float().abs().max().item())


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_query_and_latent_projections_in_one_launch(fmt, dtype):
    """``wq_a`` and ``wkv`` (the tiny preset's 64 and 512 rows of 128 inputs) in one launch at
    1 row, and at 3 with the site's norm inside, kept for x's other readers."""
    wq_a, wkv = packed(64, 128, fmt, seed=1), packed(512, 128, fmt, seed=2)
    same_as_dense(rows(1, 128, seed=1, dtype=dtype), [wq_a, wkv])
    same_as_dense(rows(3, 128, seed=3, dtype=dtype, scale=5.0), [wq_a, wkv], norm=norm_of(128, 3, dtype), keep=True)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_query_projection_with_its_norm_and_rope(fmt, dtype):
    """``wq_b`` as ``decode_step._project`` launches it: q_norm inside, the output's RoPE
    (4 heads of 512, 32 pairs turned), q_res kept; 2 rows."""
    cos, sin = angles(32, seed=4)
    same_as_dense(rows(2, 64, seed=5, dtype=dtype, scale=3.0), [packed(4 * 512, 64, fmt, seed=6)],
                  norm=norm_of(64, 7, dtype), rope_out=(cos, sin, 512), keep=True)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_grouped_output_projection_with_its_derotation(fmt, dtype):
    """``wo_a``: 2 groups of 2 heads of 512 (the tiny preset's), x's heads de-rotated inside;
    4 rows. And a 128-block FP8 weight whose layer says 32 (a V4.1 ``wo_a``'s): the block is
    read off the scale's shape."""
    cos, sin = angles(32, seed=8)
    x = rows(4, 4 * 512, seed=9, dtype=dtype)
    same_as_dense(x, [packed(2 * 64, 2 * 512, fmt, seed=10)], groups=2, rope_in=(cos, -sin, 512))
    if fmt == "fp8":
        wide = packed(2 * 256, 2 * 512, fmt, seed=11, block=128)
        wide.block = 32
        assert wide.gemv_weight().scale_block() == (128, 128)
        same_as_dense(x, [wide], groups=2, rope_in=(cos, -sin, 512))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_indexer_query_with_its_rope(fmt, dtype):
    """The indexer's ``wq_b``: 4 heads of 128, 32 pairs turned; 3 rows."""
    cos, sin = angles(32, seed=12)
    same_as_dense(rows(3, 64, seed=13, dtype=dtype), [packed(4 * 128, 64, fmt, seed=14)], rope_out=(cos, sin, 128))


@needs_triton
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_packed_linear_takes_the_gemv_on_a_decode_steps_rows(fmt, monkeypatch):
    """``Linear.forward`` on a few rows: the GEMV on its stored bytes (no dequantised copy), the
    plain layer of its dequantised weight; a prefill's rows: the packed GEMM, or ``F.linear``
    on the dequantised weight where no kernel runs; each to the rounding of another order of sums."""
    layer = packed(96, 256, fmt, seed=15)
    plain = Linear(256, 96).to(DEVICE)
    seen = []
    real = kernels.gemv
    monkeypatch.setattr(kernels, "gemv", lambda x, *w, **k: seen.append(isinstance(w[0], kernels.Packed))
                        or real(x, *w, **k))
    with torch.no_grad():
        plain.weight.copy_(layer.dense_weight(torch.float32))
        x = rows(2, 256, seed=16, dtype=torch.float32)
        got, want = layer(x), plain(x)
        assert seen == [True, False]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        long = rows(kernels.GEMV_TOKENS + 1, 256, seed=17, dtype=torch.float32)
        want = torch.nn.functional.linear(long, layer.dense_weight(torch.float32))
        torch.testing.assert_close(layer(long), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert len(seen) == 2


@needs_triton
def test_a_packed_weight_takes_the_gemv_even_where_a_plain_one_would_not(monkeypatch):
    """``gemv=False`` (the Engram projection, made beside the layers by cuBLAS) keeps a plain
    weight off the GEMV; a packed one still takes it on a decode step's rows: the twin would
    dequantise the whole weight every step."""
    seen = []
    real = kernels.gemv
    monkeypatch.setattr(kernels, "gemv", lambda x, *w, **k: seen.append(type(w[0]).__name__) or real(x, *w, **k))
    dense = []
    real_dense = Linear.dense_weight
    monkeypatch.setattr(Linear, "dense_weight", lambda self, dtype: dense.append(self.fmt) or real_dense(self, dtype))
    x = rows(2, 256, seed=20, dtype=torch.float32)
    with torch.no_grad():
        plain = Linear(256, 96, gemv=False).to(DEVICE)
        plain(x)
        assert seen == [] and dense == ["plain"]
        layer = packed(96, 256, "fp8", seed=21)
        layer.gemv = False
        got = layer(x)
        assert seen == ["Packed"] and dense == ["plain"]
        torch.testing.assert_close(got, torch.nn.functional.linear(x, real_dense(layer, torch.float32)),
                                   rtol=1e-5, atol=1e-5)


def test_the_twin_dequantises_a_packed_weight():
    """``gemv_ref`` on a ``Packed`` weight: ``F.linear`` of the weight as ``dense_weight`` makes it."""
    for fmt in FORMATS:
        layer = packed(48, 96, fmt, seed=18)
        for dtype in DTYPES:
            x = rows(2, 96, seed=19, dtype=dtype)
            (y,) = kernels.gemv_ref(x, layer.gemv_weight())
            assert torch.equal(y, torch.nn.functional.linear(x, layer.dense_weight(dtype)))


@needs_triton
def test_gemv_runs_on_packed_weights_of_one_kind(monkeypatch):
    """Packed layers take the GEMV, two at once where they share a format and scale block; a
    launch of a plain and a packed weight, of two formats, or of a scale block that is not a
    power of two does not (their callers run torch)."""
    monkeypatch.delenv("DSAGENT_GEMV", raising=False)
    x = rows(1, 96, seed=20, dtype=torch.bfloat16)
    fp8, fp8b, fp4 = packed(64, 96, "fp8", seed=21), packed(32, 96, "fp8", seed=22), packed(64, 96, "fp4", seed=23)
    plain = Linear(96, 64).to(DEVICE, torch.bfloat16)
    odd = packed(96, 96, "fp8", seed=24, block=96)  # one 96 x 96 block
    with torch.no_grad():
        assert kernels.gemv_runs(x, fp8) and kernels.gemv_runs(x, fp4) and kernels.gemv_runs(x, fp8, fp8b)
        assert not kernels.gemv_runs(x, fp8, plain) and not kernels.gemv_runs(x, fp8, fp4)
        assert odd.gemv_weight().scale_block() == (96, 96) and not kernels.gemv_runs(x, odd)
        assert torch.equal(odd(x), torch.nn.functional.linear(x, odd.dense_weight(torch.bfloat16)))
    assert not kernels.gemv_runs(x, fp8)  # gradients on: torch


def test_a_packed_model_decodes_as_its_dequantised_twin(monkeypatch):
    """The tiny preset built packed, and the same model with every packed weight replaced by its
    dequantised floats: the same logits over a prefill of five tokens and three
    fused decode steps. Where the kernels run, the packed model's projections, shared experts (FP8) and
    routed experts (FP4, one by one: ``DSAGENT_GROUPED_MOE=0``, and the fused MoE off in both,
    so that both run one computation) go through the GEMV on their stored bytes, the same to
    1e-4 (the FP8 GEMV sums each 32-input block before its scale); else both run the twins,
    the same bits. Under the interpreter, where each program runs as Python, the GEMV's tiles
    are cut into fewer programs, both models' alike."""
    args = ModelArgs.preset("tiny").replace(engram_layer_ids=(), engram_num_embeddings=())
    interpretable(monkeypatch)
    if os.environ.get("TRITON_INTERPRET") == "1" and kernels.triton_available():
        from model.kernels import matvec

        monkeypatch.setattr(matvec, "MIN_PROGRAMS", 4)
    for name, value in (("DSAGENT_FUSED_MOE", "0"), ("DSAGENT_GROUPED_MOE", "0"), ("DSAGENT_GRAPHS", "0"),
                        ("DSAGENT_PACKED_GEMM", "0")):  # the prefill's GEMMs: another summation order
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(ds, "takes_fused", ds.is_decode_step)
    nets = {"packed": build(args, weights="packed"), "dense": build(args)}
    with torch.no_grad():
        for name, m in nets["packed"].named_modules():
            if isinstance(m, Linear) and m.fmt != "plain":
                nets["dense"].get_submodule(name).weight.copy_(m.dense_weight(torch.float32))
    formats = []
    real = kernels.gemv
    monkeypatch.setattr(kernels, "gemv", lambda x, *w, **k: formats.extend(getattr(v, "fmt", "plain") for v in w)
                        or real(x, *w, **k))
    ids = torch.randint(3, args.vocab_size, (1, 8), generator=torch.Generator().manual_seed(25))
    logits = {}
    with torch.no_grad():
        for name, net in nets.items():
            net = net.to(DEVICE)
            cache = net.new_cache(1)
            net(ids[:, :5].to(DEVICE), cache)
            logits[name] = torch.stack([ds.forward(net, ids[:, t: t + 1].to(DEVICE), cache)[:, -1]
                                        for t in range(5, 8)])
            if name == "packed" and kernels.enabled(logits[name]):
                assert {"fp8", "fp4"} <= set(formats), set(formats)
    if kernels.enabled(logits["packed"]):  # the FP8 GEMVs sum each 32-input block before its scale
        torch.testing.assert_close(logits["packed"], logits["dense"], rtol=1e-4,
                                   atol=1e-4 * logits["dense"].abs().max().item())
    else:
        assert torch.equal(logits["packed"], logits["dense"])


# ----------------------------------------------------------------------------- builds for the H200

def packed_launch(constants: dict, fmt: str, pdl: bool) -> dict:
    """``_gemv_kernel``'s launch with weights of ``fmt`` (bytes and scale bytes; "plain": the
    float weights of ``test_gemv_kernel``'s launch), aligned as a model's are (pointers at 16
    bytes, widths multiples of 16), VEC and BLOCKS as the launcher sets them."""
    from model.kernels import matvec

    elem = 2 if constants["BF16"] else 4
    extra = {} if fmt == "plain" else {"FMT": fmt, "SR": 32 if fmt == "fp8" else 1, "SC": 32,
                                       "VEC": matvec.vector(constants["BLOCK_O"], constants["BLOCK_D"], 16, elem),
                                       "BLOCKS": fmt == "fp8"}
    pointers = {} if fmt == "plain" else dict.fromkeys(("w_ptr", "w2_ptr", "s_ptr", "s2_ptr"), "*u8")
    launch = gemv_launch({"TWO": False, **constants, "PDL": pdl, **extra}, {"launch_pdl": True} if pdl else {},
                         pointers)
    launch["aligned"] = [k for k, v in launch["signature"].items() if v.startswith("*")] + ["O", "O2", "D", "DG", "OG"]
    return launch


# each decode-step launch of a layer at `small`'s shapes (BLOCK_O, BLOCK_D as the launcher picks them)
STEP_LAUNCHES = {
    "wq_a+wkv": {"BLOCK_O": 4, "BLOCK_D": 2048, "TWO": True, "NORM": True, "KEEP": True},
    "wq_b": {"BLOCK_O": 16, "BLOCK_D": 512, "NORM": True, "ROPE_OUT": True, "KEEP": True},
    "wo_a": {"BLOCK_O": 4, "BLOCK_D": 2048, "ROPE_IN": True},
    "wo_b": {"BLOCK_O": 4, "BLOCK_D": 2048},
    "indexer wq_b": {"BLOCK_O": 16, "BLOCK_D": 512, "ROPE_OUT": True},
    "tiny wo_b": {"BLOCK_O": 1, "BLOCK_D": 128},
}


needs_compiler = pytest.mark.skipif(ON_CUDA or importlib.util.find_spec("triton") is None,
                                    reason="needs Triton installed; on a GPU the kernel itself runs in the tests above")


@needs_compiler
@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_gemv_compiles_for_hopper_as_a_dependent_launch(fmt, tmp_path):
    """Triton's GPU compiler on the CPU for sm_90 (a process without the interpreter): each
    launch of a decode step's layers with ``fmt`` weights, bf16 and fp32, as a dependent launch
    (PDL): the tile's bytes and scales asked for before the wait."""
    launches = [packed_launch({**constants, "BF16": bf16}, fmt, pdl=True)
                for constants in STEP_LAUNCHES.values() for bf16 in (True, False)]
    r = compile_for_hopper(launches, tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


@needs_compiler
@pytest.mark.parametrize("bf16", [True, False])
def test_packed_gemv_sums_in_the_plain_gemvs_order_on_hopper(bf16, tmp_path):
    """Each reduction of an FP4 build sums a tensor of the layout the plain build's sums at the
    same tile: the same registers a thread, lanes and warps, so the same order of sums and the
    same bits from the same values on the GPU too (``gpu_compile_check.py``'s
    ``DSAGENT_REDUCE``, read off the TTGIR of sm_90 builds). An FP8 build sums by 32-input
    blocks first (``matvec._fp8_dot``): other layouts, built here too."""
    from gpu_compile_check import compile_apart

    launches = [packed_launch({**constants, "BF16": bf16}, fmt, pdl=False)
                for constants in STEP_LAUNCHES.values() for fmt in ("plain", *FORMATS)]
    r = compile_apart(launches, tmp_path / "launches.json", env={"DSAGENT_REDUCE": "1"}, capture_output=True,
                      text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    by_tile = {}
    for line in r.stdout.splitlines():
        if line.startswith("reduce "):
            built = json.loads(line.removeprefix("reduce "))
            tile = {k: v for k, v in built["constants"].items() if k not in ("FMT", "SR", "SC", "VEC", "BLOCKS", "s_ptr", "s2_ptr")}
            by_tile.setdefault(json.dumps(tile, sort_keys=True), {})[built["constants"].get("FMT", "plain")] = \
                built["layouts"]
    assert len(by_tile) == 2 * len(STEP_LAUNCHES)  # each also built as a dependent launch
    for tile, layouts in by_tile.items():
        assert set(layouts) == {"plain", *FORMATS} and layouts["plain"], tile
        assert layouts["fp4"] == layouts["plain"] and layouts["fp8"] != layouts["plain"], (tile, layouts)
